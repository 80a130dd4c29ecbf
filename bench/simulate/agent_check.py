"""Predicted against measured for the slow-tool agent (docs/results.md section G, docs/scaling.md).

The calculator agent with its tool on the environment server (``configs/smollm2_calculator_remote.yaml``)
was run on this machine in a synchronous arm and several asynchronous ones
(``docs/bench/multiseed_calculator_remote*.json``). Whether asynchrony pays there depends on the
workload's shape, which the policy changes as it learns (the synchronous runs learned to call the
tool; the staleness-2 runs stopped calling it). So each run is simulated with **its own episodes**
(the model tokens of each call and the observation tokens between calls, per policy version, read
from its ``trace/`` timelines by :func:`bench.simulate.agents.episodes_from_trace` and kept in
``docs/bench/calculator_episodes.json``), its own knobs and the machine's measured component rates
(:mod:`bench.simulate.calibration`); what is compared is the systems model: seconds per train step,
each role's idle ratio, and the asynchronous / synchronous step-time ratio.

    python -m bench.simulate agents                      # the table (seconds)
    python -m bench.simulate agents --extract sync-s1=RUN_DIR ...   # add runs' episodes to the JSON
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path
from typing import Any

from .agents import AgentModel, Episodes, ToolLatency, episodes_from_trace
from .calibration import CPU_LOAD_S, cpu_engine, cpu_trainer
from .model import SimConfig, simulate, train_batch_groups
from .validation import relative_error

__all__ = ["CALC_PROMPT_TOKENS", "CALC_LATENCY", "CALC_ARMS", "EPISODES_FILE", "MEASURED_FILES", "calculator_config",
           "measured_runs", "agent_validation", "extract_episodes", "format_agent_validation"]

_BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"
#: The episodes of the measured runs, keyed ``<arm>-s<seed>``.
EPISODES_FILE = _BENCH / "calculator_episodes.json"
#: The multiseed records whose runs are predicted.
MEASURED_FILES = ("multiseed_calculator_remote.json", "multiseed_calculator_remote_async_b192.json",
                  "multiseed_calculator_remote_overlap.json")
#: The calculator job's prompt: SmolLM2's chat template around the config's system prompt,
#: "What is 47 * 86?" and the "<calc>" prefill (66 tokens with the model's tokenizer).
CALC_PROMPT_TOKENS = 66
#: The environment server's latency of configs/smollm2_calculator_remote.yaml (Modal's sandbox,
#: docs/agents.md): median 1.737 s, sigma 0.233, deadline 10 s.
CALC_LATENCY = ToolLatency(1.737, 0.233, 10.0)
#: Each recorded arm's knobs (docs/results.md section G: the flags over the config as it was then, with
#: ``max_staleness: 2``, so ``async`` is staleness 2): (R, p, M, eta,
#: layout), layout ``split`` = rollout on core 0 and trainer on core 1 (asynchronous), ``shared``
#: = both roles on both cores, alternating (synchronous).
CALC_ARMS = {
    "sync": (6, 1.0, 192, 0, "shared"),
    "async": (8, 0.75, 64, 2, "split"),
    "async_eta1": (8, 0.75, 64, 1, "split"),
    "async_b192": (8, 0.75, 192, 2, "split"),
    "overlap": (6, 1.0, 192, 1, "split"),  # the sync arm's knobs with η 1: the configs' default since 2026-11-29
}


def calculator_config(arm: str, episodes: Episodes, steps: int, seed: int = 0,
                      trainer_tokens_per_second: float | None = None, prefill_scale: float = 1.0) -> SimConfig:
    """The calculator job of configs/smollm2_calculator_remote.yaml for ``arm`` (:data:`CALC_ARMS`).

    Component rates are the main job's (:func:`~bench.simulate.calibration.cpu_engine`,
    :func:`~bench.simulate.calibration.cpu_trainer`) with the two settings that differ here:
    the trainer shares each group's prompt (``trainer.share_prompts``, on by default) and the
    engine prefills a group's prompt once (its prompt cache, docs/rollout.md).
    ``trainer_tokens_per_second``, when given, replaces the trainer's rate and folds the optimizer
    step into it (a run's own trainer, see :func:`measured_runs`). ``prefill_scale`` divides the
    engine's derived prefill cost (a sensitivity check: docs/scaling.md finds the derived cost high).

    Raises:
        KeyError: an unknown arm.
        ValueError: ``prefill_scale`` <= 0.
    """
    if not prefill_scale > 0:
        raise ValueError(f"prefill_scale must be > 0, got {prefill_scale}")
    R, p, M, eta, layout = CALC_ARMS[arm]
    threads = 2 if layout == "shared" else 1
    engine = cpu_engine(threads)
    engine = dataclasses.replace(engine, shared_prefix=True, prefill_per_token=engine.prefill_per_token / prefill_scale)
    trainer = dataclasses.replace(cpu_trainer(threads), share_prompts=True)
    if trainer_tokens_per_second is not None:
        trainer = dataclasses.replace(trainer, tokens_per_second=trainer_tokens_per_second, optim=0.0,
                                      name=f"{trainer.name}, the run's own rate")
    return SimConfig(name=f"calculator, {arm}", rollout_batch_size=R, partial_percent=p, n_samples=8, max_budget=M,
                     max_response_len=192, max_staleness=eta, stale_policy="restart", prompt_tokens=CALC_PROMPT_TOKENS,
                     servers=1, engine=engine, max_inflight=32, pause_mode="abort", load=CPU_LOAD_S, trainer=trainer,
                     steps=steps, warmup_steps=1, seed=seed, agent=AgentModel(episodes, CALC_LATENCY))


def measured_runs(bench_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Every recorded run of :data:`MEASURED_FILES` whose arm is in :data:`CALC_ARMS`.

    Returns:
        One dict per run: ``key`` (``<arm>-s<seed>``), ``arm``, ``seed``, ``steps`` (the run's last
        step), ``seconds_per_step`` (mean of ``time/step_seconds`` from step 2 on: step 1 holds the
        start-up), ``rollout_idle`` and ``trainer_idle`` (the controller's ratios over the run),
        ``trainer_tokens_per_second`` (the run's own trainer: tokens processed, responses plus each
        group's prompt, per second of step time outside ``wait_batch`` and the publish).
    """
    bench_dir = Path(bench_dir) if bench_dir is not None else _BENCH
    out = []
    for name in MEASURED_FILES:
        path = bench_dir / name
        if not path.exists():
            continue
        for r in json.loads(path.read_text())["runs"]:
            if r["arm"] not in CALC_ARMS:
                continue
            later = [s for s in r["steps"] if s["step"] >= 2 and "time/step_seconds" in s]
            if not later:
                continue
            B = train_batch_groups(CALC_ARMS[r["arm"]][1], CALC_ARMS[r["arm"]][0])
            busy = sum(s["time/step_seconds"] - s["time/wait_batch_seconds"] - s["time/publish_seconds"] for s in later)
            tokens = sum(s["train/response_tokens"] + B * CALC_PROMPT_TOKENS for s in later)
            out.append({"key": f"{r['arm']}-s{r['seed']}", "arm": r["arm"], "seed": r["seed"], "steps": r["final_step"],
                        "seconds_per_step": statistics.fmean(s["time/step_seconds"] for s in later), "rollout_idle": r["idle"]["rollout-0"],
                        "trainer_idle": r["idle"]["trainer"], "trainer_tokens_per_second": tokens / busy})
    return out


def agent_validation(seed: int = 0, bench_dir: str | os.PathLike | None = None,
                     prefill_scale: float = 1.0) -> dict[str, Any]:
    """Simulate each measured calculator run with its own episodes and pair prediction with measurement.

    ``prefill_scale``: see :func:`calculator_config`.

    Returns:
        ``{"runs": [...], "ratios": [...]}``: per run ``key``, ``arm``, ``steps`` and for each of
        ``seconds_per_step``, ``rollout_idle``, ``trainer_idle`` the ``measured``, ``predicted`` and
        ``error``; per asynchronous arm the ``measured`` and ``predicted`` ratio of the
        synchronous arm's mean seconds per step to its own (> 1: asynchronous steps are faster).

    Raises:
        OSError, ValueError, KeyError: a record cannot be read.
    """
    bench_dir = Path(bench_dir) if bench_dir is not None else _BENCH
    episodes = json.loads((bench_dir / EPISODES_FILE.name).read_text())
    rows = []
    for m in measured_runs(bench_dir):
        if m["key"] not in episodes:
            continue
        eps = Episodes.from_json(episodes[m["key"]])
        pred, own = (simulate(calculator_config(m["arm"], eps, steps=m["steps"], seed=seed, trainer_tokens_per_second=rate,
                                                prefill_scale=prefill_scale))
                     for rate in (None, m["trainer_tokens_per_second"]))
        rows.append({"key": m["key"], "arm": m["arm"], "steps": m["steps"], "aborted_segments": {
                         "predicted": pred.buffer["parked_abort"], "predicted_own_trainer": own.buffer["parked_abort"]},
                     "trainer_tokens_per_second": m["trainer_tokens_per_second"],
                     **{q: {"measured": m[q], "predicted": getattr(pred, q), "error": relative_error(getattr(pred, q), m[q]),
                            "predicted_own_trainer": getattr(own, q),
                            "error_own_trainer": relative_error(getattr(own, q), m[q])}
                        for q in ("seconds_per_step", "rollout_idle", "trainer_idle")}})
    ratios = []
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_arm.setdefault(r["arm"], []).append(r)
    if "sync" in by_arm:
        def ratio(arm: str, kind: str) -> float:
            def mean(a: str) -> float:
                return statistics.fmean(r["seconds_per_step"][kind] for r in by_arm[a])
            return mean("sync") / mean(arm)
        for arm in by_arm:
            if arm != "sync":
                ms, ps, po = (ratio(arm, k) for k in ("measured", "predicted", "predicted_own_trainer"))
                ratios.append({"arm": arm, "runs": len(by_arm[arm]), "sync_runs": len(by_arm["sync"]), "measured": ms,
                               "predicted": ps, "error": relative_error(ps, ms), "predicted_own_trainer": po,
                               "error_own_trainer": relative_error(po, ms)})
    return {"runs": rows, "ratios": ratios}


def extract_episodes(pairs: list[str], path: str | os.PathLike | None = None) -> list[str]:
    """Add ``KEY=RUN_DIR`` runs' episodes (:func:`~bench.simulate.agents.episodes_from_trace`) to the JSON.

    Raises:
        ValueError: a pair without ``=``; FileNotFoundError: a run without ``trace/``.
    """
    path = Path(path) if path is not None else EPISODES_FILE
    data = json.loads(path.read_text()) if path.exists() else {}
    done = []
    for pair in pairs:
        key, sep, run_dir = pair.partition("=")
        if not sep or not key or not run_dir:
            raise ValueError(f"--extract takes KEY=RUN_DIR (e.g. sync-s1=runs/sync-s1), got {pair!r}")
        data[key] = episodes_from_trace(run_dir, source=key).to_json()
        done.append(key)
    path.write_text(json.dumps(dict(sorted(data.items())), separators=(",", ":")) + "\n")
    return done


def format_agent_validation(res: dict[str, Any]) -> str:
    """The markdown tables of docs/scaling.md's slow-tool section."""
    lines = ["| run | steps | s/step measured | predicted (error) | with the run's trainer rate (error) | "
             "rollout idle: measured / predicted / with the run's rate | trainer idle: same |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in res["runs"]:
        s, ri, ti = r["seconds_per_step"], r["rollout_idle"], r["trainer_idle"]
        lines.append(f"| {r['key']} | {r['steps']} | {s['measured']:.1f} | {s['predicted']:.1f} ({s['error']}) | "
                     f"{s['predicted_own_trainer']:.1f} ({s['error_own_trainer']}) | "
                     f"{ri['measured']:.2f} / {ri['predicted']:.2f} / {ri['predicted_own_trainer']:.2f} | "
                     f"{ti['measured']:.2f} / {ti['predicted']:.2f} / {ti['predicted_own_trainer']:.2f} |")
    lines += ["", "| arm | runs (sync runs) | sync s/step ÷ arm s/step: measured | predicted (error) | "
              "with the runs' trainer rates (error) |", "|---|---|---:|---:|---:|"]
    for q in res["ratios"]:
        lines.append(f"| {q['arm']} | {q['runs']} ({q['sync_runs']}) | {q['measured']:.2f} | {q['predicted']:.2f} "
                     f"({q['error']}) | {q['predicted_own_trainer']:.2f} ({q['error_own_trainer']}) |")
    return "\n".join(lines)
