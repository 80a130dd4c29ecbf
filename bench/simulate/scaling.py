"""Predictions on GPU clusters: asynchronous against synchronous asyncrl at several scales, and published results.

:func:`scaling` runs, for every scale and workload, the colocated synchronous baseline and every
asynchronous setting of :data:`ASYNC_SETTINGS` on every split of :data:`ROLLOUT_FRACTIONS`, and
keeps the best. :data:`PUBLISHED` holds the speed-ups other systems measured on their clusters,
tabulated next to the predictions (docs/scaling.md#predictions-on-gpus).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from .calibration import GLOBAL_BATCH_GROUPS, WORKLOADS, gpu_config
from .model import simulate

__all__ = ["PUBLISHED", "ASYNC_SETTINGS", "ROLLOUT_FRACTIONS", "scaling"]

#: Published speed-ups of asynchronous over synchronous RL (measured on their clusters, not predictions).
PUBLISHED = [
    {"system": "AReaL (arXiv:2505.24298; blog/AReaL_v0_3.md)", "setup": "R1-Distill-Qwen-1.5B, math, 16 nodes, 1000 PPO steps",
     "sync_hours": 41.0, "async_hours": 14.8, "speedup": 41.0 / 14.8},
    {"system": "AReaL (arXiv:2505.24298; blog/AReaL_v0_3.md)", "setup": "R1-Distill-Qwen-7B, math, 24 nodes, 1000 PPO steps",
     "sync_hours": 57.7, "async_hours": 25.4, "speedup": 57.7 / 25.4},
    {"system": "verl fully_async_policy (docs/advance/fully_async.md)", "setup": "Qwen2.5-Math-7B, DAPO, 28K response, H20, 32 GPUs (16:16), 400 steps",
     "speedup": 2.66},
    {"system": "verl fully_async_policy", "setup": "same, 64 GPUs (32:32), 400 steps", "speedup": 1.92},
    {"system": "verl fully_async_policy", "setup": "same, 128 GPUs (64:64), 400 steps (2.67x at 100 steps)", "speedup": 2.35},
    {"system": "Kimi k1.5 (arXiv:2501.12599, section 2.6.2)", "setup": "partial rollouts, 128k context",
     "speedup": None},
]


#: The asynchronous settings tried at every scale: (label, partial_percent, budget (None: the
#: workload's), max_staleness, pause_mode).
ASYNC_SETTINGS = [
    ("overlap, eta 1", 1.0, "L", 1, "in_place"),
    ("partial, eta 4", 0.5, None, 4, "in_place"),
    ("partial, eta 4, abort", 0.5, None, 4, "abort"),
]
#: Fractions of the GPUs given to rollout in asynchronous mode.
ROLLOUT_FRACTIONS = (0.25, 0.375, 0.5, 0.625, 0.75)


def scaling(scales: Iterable[int] = (8, 64, 512), workloads: Iterable[str] = ("long-tail", "short"),
            seed: int = 0, quick: bool = False, log: Callable[[str], None] | None = None,
            groups: int = GLOBAL_BATCH_GROUPS) -> dict[str, Any]:
    """Predicted sync and async throughput for every scale, workload, setting and split.

    Args:
        scales: total GPUs of each cluster.
        workloads: keys of :data:`WORKLOADS`.
        seed: the simulations' seed.
        quick: fewer train steps per run (3 sync and 8 async instead of 5 and 12).
        log: called with one line per simulated run (progress), or None.
        groups: B, prompt groups per train step at every scale (:data:`GLOBAL_BATCH_GROUPS`).

    Returns:
        ``{"runs", "best", "groups"}``: ``runs`` every simulated run (:meth:`SimResult.row`
        plus ``workload``, ``gpus``, ``setting``, ``rollout_fraction``, ``speedup``); ``best``
        one per (workload, scale): the synchronous run, the fastest asynchronous one and the
        fastest with ``pause_mode abort``, with their speed-ups over synchronous.

    Raises:
        KeyError: an unknown workload. ValueError: a scale too small to split (fewer than 2 GPUs).
    """
    out: dict[str, Any] = {"runs": [], "best": [], "groups": int(groups)}
    for wl in workloads:
        for G in scales:
            steps_sync, steps_async = (3, 8) if quick else (5, 12)
            sync = simulate(gpu_config(G, wl, "sync", steps=steps_sync, groups=groups, seed=seed))
            runs = [("sync", None, sync)]
            if log:
                log(f"{sync.name}: {sync.seconds_per_step:.0f} s/step, {sync.samples_per_second:.2f} samples/s")
            for label, p, budget, eta, pause in ASYNC_SETTINGS:
                for frac in ROLLOUT_FRACTIONS:
                    M = WORKLOADS[wl]["L"] if budget == "L" else budget
                    cfg = gpu_config(G, wl, "async", rollout_gpus=max(1, int(round(G * frac))), partial_percent=p,
                                     max_staleness=eta, budget=M, pause_mode=pause, steps=steps_async,
                                     groups=groups, seed=seed)
                    r = simulate(cfg)
                    runs.append((label, frac, r))
                    if log:
                        log(f"{r.name} ({pause}): {r.seconds_per_step:.0f} s/step, {r.samples_per_second:.2f} samples/s, "
                            f"x{r.samples_per_second / sync.samples_per_second:.2f}")
            for label, frac, r in runs:
                d = r.row()
                d.update({"workload": wl, "gpus": G, "setting": label, "rollout_fraction": frac,
                          "speedup": r.samples_per_second / sync.samples_per_second})
                out["runs"].append(d)
            asyn = [(label, frac, r) for label, frac, r in runs if label != "sync"]
            best = max(asyn, key=lambda x: x[2].samples_per_second)
            default = max((x for x in asyn if "abort" in x[0]), key=lambda x: x[2].samples_per_second)
            out["best"].append({"workload": wl, "gpus": G, "sync": sync.row(), "best_setting": best[0],
                                "best_rollout_fraction": best[1], "best": best[2].row(),
                                "speedup": best[2].samples_per_second / sync.samples_per_second,
                                "abort_setting": default[0], "abort_rollout_fraction": default[1],
                                "abort_speedup": default[2].samples_per_second / sync.samples_per_second})
    return out
