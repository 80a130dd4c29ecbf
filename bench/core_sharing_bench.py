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

Modes: the four ``core_sharing`` values of an asynchronous run, and ``sync``
(``--partial_percent 1 --max_budget 64 --max_staleness 0``; a synchronous config always gives
both roles every core, since one of them always waits).

Usage: ``python bench/core_sharing_bench.py [--steps 14] [--modes split,shared,trainer_first,rollout_first,sync]
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
SYNC_FLAGS = ["--partial_percent", "1", "--max_budget", "64", "--max_staleness", "0"]


def run_mode(mode: str, steps: int, out_dir: Path, config: Path) -> Path:
    """Run the main job in one mode; returns its run directory."""
    name = f"cores-{mode}"
    # a synchronous config always gives every role every core (one of them always waits)
    flags = SYNC_FLAGS if mode == "sync" else ["--resources.core_sharing", mode]
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "--config", str(config), "--run.name", name,
           "--run.output_dir", str(out_dir), "--run.total_steps", str(steps), "--run.max_wall_seconds", "3000",
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
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2_arith.yaml")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--skip", type=int, default=2, help="steps excluded from the per-step figure")
    ap.add_argument("--modes", default="split,shared,trainer_first,rollout_first,sync")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out_dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="core_sharing_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            load = os.getloadavg()[0]
            summary = summarise(run_mode(mode, args.steps, out_dir, args.config), args.skip)
            summary["load_average_1min_before"] = load
            results[mode].append(summary)
            print(mode, json.dumps(summary), flush=True)
    best = {m: min(r["seconds_per_step"] for r in rs) for m, rs in results.items()}
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
