"""Predicted against measured: the simulator on the runs this repository measured on its 2-core machine.

:func:`validation` simulates the main job of docs/results.md (asynchronous before and after the
admission change, synchronous) and every run of docs/rollout.md benchmark (b) stored in
``docs/bench/partial_*.json``, and pairs each prediction with its measurement. The tables of
docs/scaling.md#validation-against-this-machines-runs are rendered from its result by
:mod:`bench.simulate.tables`.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from .calibration import MAIN_MEASURED, bench_b_configs, main_job_config
from .model import simulate

__all__ = ["BENCH_DIR", "MAIN_RUNS", "BENCH_B_QUANTITIES", "relative_error", "within_bound", "validation"]

#: The measured records of benchmark (b): the repository's docs/bench, wherever the command runs.
BENCH_DIR = Path(__file__).resolve().parents[2] / "docs" / "bench"
#: The main-job runs predicted: key of :data:`MAIN_MEASURED` -> (mode, admission rule before the
#: third session, simulated seconds or None for the run's own length).
MAIN_RUNS = {"async": ("async", True, None), "sync": ("sync", True, None), "async_after_change": ("async", False, 1228.0)}
#: The quantities compared for every benchmark (b) run.
BENCH_B_QUANTITIES = ("tokens_per_second", "engine_tokens_per_second", "running_requests", "staleness_mean")


def relative_error(pred: float, meas: float) -> str:
    """``(pred - meas) / |meas|`` as a signed percentage (``"+3%"``), or the absolute difference
    (``"+0.00 abs"``) when the measured value is 0."""
    if meas == 0:
        return f"{pred - meas:+.2f} abs"
    return f"{(pred - meas) / abs(meas) * 100:+.0f}%"


def within_bound(pred: float, meas: float) -> bool:
    """The validation's criterion: within 20% of the measured value, or within 0.1 absolute when it is 0."""
    return (abs(pred - meas) <= 0.2 * abs(meas)) if meas else abs(pred - meas) <= 0.1


def validation(seed: int = 0, bench_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Predicted vs measured for the runs of docs/results.md and docs/rollout.md benchmark (b).

    Args:
        seed: the simulations' seed.
        bench_dir: where the benchmark (b) records ``partial_*.json`` are (default :data:`BENCH_DIR`).

    Returns:
        ``{"rows", "bench_b_speedups", "main", "bench_b"}``: ``rows`` one per quantity
        (``run``, ``quantity``, ``measured``, ``predicted``, ``error``, ``within_20pct``, and
        ``key`` (a :data:`MAIN_RUNS` key or the record's file name) and ``mode`` (``partial`` /
        ``sync`` for benchmark (b), None for the main job)); ``bench_b_speedups`` one per record
        holding both modes (``setup`` (file name), ``measured_speedup``, ``predicted_speedup``,
        ``error``); ``main`` the knobs of each main-job run (``partial_percent``,
        ``max_budget``, ``max_staleness``); ``bench_b`` each record's setup (``sequential``,
        ``threads``, ``max_response_len``, ``rollout_batch_size``).

    Raises:
        OSError, ValueError, KeyError: a record cannot be read.
    """
    import json

    bench_dir = Path(bench_dir) if bench_dir is not None else BENCH_DIR
    rows: list[dict[str, Any]] = []
    main: dict[str, dict[str, Any]] = {}
    for key, (mode, counts_ready, duration) in MAIN_RUNS.items():
        cfg = main_job_config(mode, admission_counts_ready=counts_ready, duration=duration, seed=seed)
        main[key] = {"partial_percent": cfg.partial_percent, "max_budget": cfg.max_budget,
                     "max_staleness": cfg.max_staleness}
        r = simulate(cfg)
        for q, m in MAIN_MEASURED[key].items():
            p = getattr(r, q)
            rows.append({"run": f"main job {key.replace('_', ' ')}", "key": key, "mode": None, "quantity": q,
                         "measured": m, "predicted": p, "error": relative_error(p, m), "within_20pct": within_bound(p, m)})
    bench = []
    setups: dict[str, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(bench_dir, "partial_*.json"))):
        name = os.path.basename(path)
        with open(path) as f:
            d = json.load(f)
        setups[name] = {"sequential": bool(d["sequential"]), "threads": int(d["threads"]),
                        "max_response_len": int(d["max_response_len"]), "rollout_batch_size": int(d["rollout_batch_size"])}
        pair = {}
        for cfg, meas in bench_b_configs(path, seed=seed):
            r = simulate(cfg)
            pred = {"batches": r.steps, "samples": r.trained_samples, "tokens": r.trained_tokens,
                    "tokens_per_second": r.tokens_per_second, "engine_tokens_per_second": r.engine_tokens_per_second,
                    "running_requests": r.running_requests, "staleness_mean": r.staleness_mean}
            mode = "partial" if cfg.partial_percent < 1 else "sync"
            pair[mode] = (meas, pred)
            for q in BENCH_B_QUANTITIES:
                m, p = meas[q], pred[q]
                rows.append({"run": cfg.name, "key": name, "mode": mode, "quantity": q, "measured": m, "predicted": p,
                             "error": relative_error(p, m), "within_20pct": within_bound(p, m)})
        if "sync" in pair and "partial" in pair:
            ms = pair["partial"][0]["tokens_per_second"] / pair["sync"][0]["tokens_per_second"]
            ps = pair["partial"][1]["tokens_per_second"] / pair["sync"][1]["tokens_per_second"]
            bench.append({"setup": name, "measured_speedup": ms, "predicted_speedup": ps,
                          "error": relative_error(ps, ms)})
    return {"rows": rows, "bench_b_speedups": bench, "main": main, "bench_b": setups}
