"""How the roles should share the CPU cores: ``asyncrl train`` on the main job in each
``resources.core_sharing`` mode, and synchronously, for the same number of steps.

Each run is the real main job (``configs/smollm2_arith.yaml``: SmolLM2-135M-Instruct, 6 prompt
groups x 8 samples per step, embedded Redis, rollout server and trainer as separate processes),
without held-out evaluation, for ``--steps`` trainer steps. The figure is the training wall
clock per step over steps ``--skip + 1 .. --steps`` (the first steps include model loading and
the pipeline filling), from the run's own ``metrics-trainer.jsonl``; with it, each run's mean
trainer phase seconds (waiting for a batch, forward and backward, optimizer) and reward.
Ratios are against ``split`` (the fixed halves the controller used before) run in this script.

Runs are sequential, so a machine shared with other work disturbs them unequally: the load
average before each run is recorded; repeat with ``--repeats`` and read the best.

Modes: the five ``core_sharing`` values of an asynchronous run; ``split_abort`` (``split`` with
``--rollout.pause_mode abort``: every weight update aborts the in-flight samples, which are
re-prefilled on resume, against the main config's ``in_place``); and ``sync``
(``--partial_percent 1 --max_budget 64 --max_staleness 0 --rollout.rollout_batch_size 6``; a
synchronous config always gives both roles every core, since one of them always waits).
``--max_seconds`` bounds each run's training wall time (a mode that stalls is cut short and
its figure is over the steps it reached).

Usage: ``python bench/core_sharing_bench.py [--steps 14] [--modes split,follow,split_abort,shared,trainer_first,rollout_first,sync]
[--json docs/bench/core_sharing.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import emit  # bench/_report.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
SYNC_FLAGS = ["--partial_percent", "1", "--max_budget", "64", "--max_staleness", "0", "--rollout.rollout_batch_size", "6"]
#: every mode's flags on top of the config
MODES = {
    "split": ["--resources.core_sharing", "split"],
    "follow": ["--resources.core_sharing", "follow"],
    "split_abort": ["--resources.core_sharing", "split", "--rollout.pause_mode", "abort"],
    "shared": ["--resources.core_sharing", "shared"],
    "trainer_first": ["--resources.core_sharing", "trainer_first"],
    "rollout_first": ["--resources.core_sharing", "rollout_first"],
    # a synchronous config always gives every role every core (one of them always waits)
    "sync": SYNC_FLAGS,
}


def run_mode(mode: str, steps: int, out_dir: Path, config: Path, max_seconds: int = 3000) -> Path:
    """Run the main job in one mode for ``steps`` steps or ``max_seconds`` of training; returns its run directory."""
    name = f"cores-{mode}"
    flags = MODES[mode]
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "--config", str(config), "--run.name", name,
           "--run.output_dir", str(out_dir), "--run.total_steps", str(steps), "--run.max_wall_seconds", str(max_seconds),
           "--monitoring.eval_interval", "null", "--overwrite", *flags]
    env = dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log = out_dir / f"{name}.log"
    with log.open("w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0:
        raise SystemExit(f"{mode}: asyncrl train exited {rc}; see {log}")
    return out_dir / name


def summarise(run_dir: Path, skip: int) -> dict[str, float]:
    """Seconds per step after ``skip`` steps, mean phase seconds and reward from the trainer records."""
    recs = [json.loads(line) for line in (run_dir / "metrics-trainer.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "time/forward_backward_seconds" in r]
    by_step = {int(r["step"]): r for r in recs}
    last = max(by_step)
    if skip not in by_step or last <= skip:
        raise SystemExit(f"{run_dir}: steps {sorted(by_step)} do not reach past --skip {skip}")
    span = [by_step[s] for s in range(skip + 1, last + 1) if s in by_step]
    mean = lambda key: sum(float(r.get(key, 0.0)) for r in span) / len(span)  # noqa: E731
    return {
        "steps": float(last),
        "seconds_per_step": (by_step[last]["wall_seconds"] - by_step[skip]["wall_seconds"]) / (last - skip),
        "wait_batch_seconds": mean("time/wait_batch_seconds"),
        "forward_backward_seconds": mean("time/forward_backward_seconds"),
        "optim_step_seconds": mean("time/optim_step_seconds"),
        "publish_weights_seconds": mean("time/publish_weights_seconds"),
        "reward_mean": mean("reward/mean"),
        "staleness_max": max(float(r.get("staleness/max", 0.0)) for r in span),
        **_controller_means(run_dir, by_step[skip]["wall_seconds"]),
    }


def _controller_means(run_dir: Path, after_wall: float) -> dict[str, float]:
    """Mean CPU share and idle ratio of each role over the controller's samples after ``after_wall`` seconds."""
    sums: dict[str, list[float]] = {}
    path = run_dir / "metrics-controller.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        rec = json.loads(line) if line.strip() else {}
        if float(rec.get("wall_seconds", -1.0)) <= after_wall:
            continue
        for key, value in rec.items():
            if key.startswith(("cpu_share/", "idle_ratio/")) and isinstance(value, (int, float)):
                sums.setdefault(key, []).append(float(value))
    return {key: sum(vs) / len(vs) for key, vs in sorted(sums.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2_arith.yaml")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--skip", type=int, default=2, help="steps excluded from the per-step figure")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max_seconds", type=int, default=3000, help="training wall-time cap of each run")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out_dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="core_sharing_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            load = os.getloadavg()[0]
            try:
                summary = summarise(run_mode(mode, args.steps, out_dir, args.config, args.max_seconds), args.skip)
            except SystemExit as exc:  # a mode that stalls or fails is reported, the others still run
                summary = {"error": str(exc)}
            summary["load_average_1min_before"] = load
            results[mode].append(summary)
            print(mode, json.dumps(summary), flush=True)
    best = {m: min(r["seconds_per_step"] for r in rs if "seconds_per_step" in r)
            for m, rs in results.items() if any("seconds_per_step" in r for r in rs)}
    report = {"steps": args.steps, "skip": args.skip, "runs": results, "best_seconds_per_step": best}
    if "split" in best:
        report["speedup_vs_split"] = {m: best["split"] / s for m, s in best.items()}
    sync_modes = [m for m in best if m.startswith("sync")]
    if sync_modes:
        fastest_sync = min(best[m] for m in sync_modes)
        report["speedup_vs_fastest_sync"] = {m: fastest_sync / s for m, s in best.items()}
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
