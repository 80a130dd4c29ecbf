"""asyncrl against TRL's GRPOTrainer on the same machine, model, prompts, reward and knobs:
held-out accuracy against training wall time, and the time each needs to reach 60, 70 and 80%.

The workload is the main job (``configs/smollm2_arith.yaml``): SmolLM2-135M-Instruct fp32;
asyncrl's own train-prompt stream (chat template, system prompt, ``A + B =`` prefill, in stream
order); the ``math_verify`` reward; 6 prompts x 8 samples per step; lr 2e-5 constant; PPO clip
0.2 / 0.28; no KL; temperature 1.0; at most 64 new tokens; gradient clip 1.0; token-level loss
aggregation (TRL ``loss_type="dapo"``, asyncrl ``aggregation: token``).

- **TRL** (synchronous ``GRPOTrainer``, ``transformers.generate``, 2 torch threads, one
  process). TRL is not an asyncrl dependency: run this script with a Python that has ``trl``
  (e.g. ``python -m venv --system-site-packages /tmp/trlenv && /tmp/trlenv/bin/pip install trl``).
  The model is saved every ``--save_every`` seconds of training (saving time excluded) and each
  snapshot is scored afterwards.
- **asyncrl** (``asyncrl train`` on the main config as a user runs it, asynchronous default
  knobs): periodic held-out evaluation every ``--asyncrl_eval_every`` steps, time excluded from
  the training clock.
- **asyncrl_sync** (the same config with the synchronous knobs of docs/results.md:
  ``--partial_percent 1 --max_budget 64 --max_staleness 0 --rollout.rollout_batch_size 6``, so
  each step trains the same 6 groups x 8 samples and every phase gets both cores): the
  asynchronous default against asyncrl's own synchronous mode, with each run's phase timings
  (``asyncrl report``'s summary).
- **asyncrl_dynamic** (the asynchronous default with DAPO dynamic sampling,
  ``--rollout.dynamic_sampling true``): its time to the synchronous run's best accuracy beside
  the default's, and the share of zero-variance groups over training in both runs
  (``zero_variance``: [minutes, share of finished groups so far], from the controller's records).

Both are scored by ``asyncrl eval`` on the same 400 held-out problems, sampled at T = 1 (the
embedded engine; 95% Wilson intervals). "Time to X%" is the training wall time of the first
evaluation at or above X (so it is resolved to the evaluation spacing). Output: one JSON with
both curves and the ratios.

Usage: ``/tmp/trlenv/bin/python bench/trl_compare.py --minutes 13 [--systems asyncrl,asyncrl_dynamic,asyncrl_sync,trl]
[--json F] [--plot F.png]``. The JSON is rewritten after each system, so an interrupted run keeps
what finished; ``--replot --json F --plot F.png`` redraws the figure from a finished JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _report import emit  # bench/_report.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "configs" / "smollm2_arith.yaml"
THRESHOLDS = (0.6, 0.7, 0.8)


def eval_model(model_dir: Path, num_problems: int, threads: int, seed: int = 0, config: Path = CONFIG) -> dict:
    """``asyncrl eval`` (sampled, T = 1, sampling seed ``seed`` as an asyncrl run's ``run.seed``) of
    one model directory on ``config``'s held-out problems; the sampled result dict."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "eval", "--config", str(config), "--model", str(model_dir),
           "--modes", "sampled", "--num_problems", str(num_problems), "--threads", str(threads), "--json",
           "--seed", str(seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"asyncrl eval failed on {model_dir}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)[0]


def _env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def run_trl(out_dir: Path, seconds: float, save_every: float, threads: int,
            num_problems: int, seed: int = 0, config: Path = CONFIG,
            overrides: Sequence[str] = ()) -> tuple[list[dict], dict]:
    """TRL GRPOTrainer for ``seconds`` of training (``seed``: TRL's seed, i.e. its sampling and
    initialisation; the prompt stream is asyncrl's, fixed by ``data.seed``) on ``config``'s model,
    task, prompts (chat template and any assistant prefill included, as asyncrl renders them),
    reward (``data.reward``, with the prefill in front of the completion as asyncrl's reward sees
    it), response cap, learning rate and group shape. ``overrides``: config flags applied on top of
    ``config`` as ``asyncrl train`` applies them (bench/multiseed.py passes only ``--data.*`` ones);
    the held-out evaluation scores correctness whatever the training reward.

    Returns (curve, summary): [{minutes, step, accuracy, ci95_low, ci95_high}] (minute 0 is the
    base model) and {steps, wall_seconds, seconds_per_step}.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.core.config import load_config
    from asyncrl.models import resolve_model_path
    from asyncrl.tasks.rewards import load_reward_fn
    from asyncrl.tasks.tasks import TrainPromptStream

    torch.set_num_threads(threads)
    cfg = load_config(["--config", str(config), *overrides], environ={})
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stream = TrainPromptStream(cfg.data, tokenizer, seed=cfg.data.seed)
    n_prompts = 6 * 400  # more than any run here consumes
    rows = [stream.get(c) for c in range(n_prompts)]
    if cfg.data.format_reward_weight:
        raise SystemExit(f"run_trl: {config} sets data.format_reward_weight; the TRL arm scores correctness only")
    score = load_reward_fn(cfg.data.reward)
    data = Dataset.from_dict({"prompt": [r.prompt_text for r in rows],
                              "meta": [json.dumps({**r.problem.metadata, "gold": r.problem.gold}) for r in rows]})

    def reward(prompts, completions, meta, **_):
        out = []
        for p, c, m in zip(prompts, completions, meta):
            md = json.loads(m)
            out.append(float(score(p, md.get("response_prefix", "") + c, md)))
        return out

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(out_dir / "trl"), per_device_train_batch_size=48, num_generations=8,
        max_completion_length=cfg.rollout.max_response_len, temperature=1.0, top_p=1.0,
        learning_rate=cfg.trainer.optimizer.lr, lr_scheduler_type="constant", warmup_steps=0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", max_grad_norm=1.0,
        num_iterations=1, max_steps=400, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, bf16=False, seed=seed, shuffle_dataset=False, dataloader_num_workers=0,
    )
    snapshots: list[tuple[float, int, Path]] = []

    class Clock(TrainerCallback):
        """Training wall time without the snapshot saves; snapshot every ``save_every`` s; stop at ``seconds``."""

        def __init__(self):
            self.start = time.perf_counter()
            self.paused = 0.0
            self.next_save = save_every
            self.steps = 0
            self.train_seconds = 0.0

        def on_step_end(self, args_, state, control, model=None, **kw):
            t = time.perf_counter() - self.start - self.paused
            self.steps, self.train_seconds = state.global_step, t
            if t >= self.next_save or t >= seconds:
                t0 = time.perf_counter()
                path = out_dir / "trl" / f"snapshot-{state.global_step:04d}"
                model.save_pretrained(path, safe_serialization=True)
                tokenizer.save_pretrained(path)
                snapshots.append((t, state.global_step, path))
                self.paused += time.perf_counter() - t0
                self.next_save += save_every
            if t >= seconds:
                control.should_training_stop = True
            return control

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    curve = [{"minutes": 0.0, "step": 0, **_acc(eval_model(model_dir, num_problems, threads, seed, config))}]
    for t, step, path in snapshots:
        curve.append({"minutes": t / 60.0, "step": step, **_acc(eval_model(path, num_problems, threads, seed, config))})
        print("trl", json.dumps(curve[-1]), flush=True)
    summary = {"steps": clock.steps, "wall_seconds": clock.train_seconds,
               "seconds_per_step": clock.train_seconds / clock.steps if clock.steps else None}
    return curve, summary


def _acc(r: dict) -> dict:
    return {"accuracy": r["accuracy"], "ci95_low": r["accuracy_ci_low"], "ci95_high": r["accuracy_ci_high"]}


#: asyncrl's synchronous mode on the main config (docs/results.md section 2).
SYNC_ARGS = ["--partial_percent", "1", "--max_budget", "64", "--max_staleness", "0", "--rollout.rollout_batch_size", "6"]
#: DAPO dynamic sampling on the asynchronous default (issue #16's measurement).
DYNAMIC_ARGS = ["--rollout.dynamic_sampling", "true"]
SYSTEMS = ("asyncrl", "asyncrl_dynamic", "asyncrl_sync", "trl")


def run_asyncrl(out_dir: Path, name: str, seconds: float, eval_every: int, num_problems: int,
                extra: list[str]) -> tuple[list[dict], dict]:
    """``asyncrl train`` on the main config for ``seconds`` of training.

    Returns (curve, summary): the periodic evaluations as [{minutes, step, accuracy, ci95_low,
    ci95_high}] and ``asyncrl report``'s summary of the run (steps, phase medians, CPU shares),
    with ``zero_variance``: [[minutes, share of the groups finished so far whose rewards were all
    equal], ...] about every 30 s of training.
    Raises SystemExit when the run fails (its log is named).
    """
    from asyncrl.metrics.report import load_run, summarize
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "--config", str(CONFIG), "--run.name", name,
           "--run.output_dir", str(out_dir), "--run.max_wall_seconds", str(int(seconds)), "--run.total_steps", "100000",
           "--monitoring.eval_interval", str(eval_every), "--monitoring.eval_num_problems", str(num_problems),
           "--monitoring.eval_modes", '["sampled"]', "--overwrite", *extra]
    with (out_dir / f"{name}.log").open("w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT).returncode
    if rc != 0:
        raise SystemExit(f"asyncrl train exited {rc}; see {out_dir / (name + '.log')}")
    curve = []
    zero_variance: list[list[float]] = []
    for line in (out_dir / name / "metrics-controller.jsonl").read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "buffer/zero_variance_share" in rec and "wall_seconds" in rec and (
                not zero_variance or rec["wall_seconds"] / 60.0 - zero_variance[-1][0] >= 0.5):
            zero_variance.append([rec["wall_seconds"] / 60.0, rec["buffer/zero_variance_share"]])
        if "eval/accuracy_sampled" in rec:
            curve.append({"minutes": rec["wall_seconds"] / 60.0, "step": rec["step"],
                          "accuracy": rec["eval/accuracy_sampled"], "ci95_low": rec["eval/ci95_low"],
                          "ci95_high": rec["eval/ci95_high"]})
    summary = summarize(load_run(out_dir / name))
    summary["zero_variance"] = zero_variance
    return curve, summary


def time_to(curve: list[dict], level: float) -> float | None:
    """Minutes of the first evaluation at or above ``level`` (None: never reached)."""
    for point in curve:
        if point["accuracy"] >= level:
            return point["minutes"]
    return None


def _environment() -> dict:
    """Where and when the figures were taken."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    import torch
    return {"commit": commit, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0]}


def compare(report: dict) -> None:
    """Add the time-to-accuracy table and the ratios to ``report`` (in place).

    ``time_to_accuracy_minutes[level][system]``: minutes of training wall time of the system's
    first evaluation at or above ``level``. ``trl_over_asyncrl``: TRL's time / asyncrl's (> 1:
    asyncrl is sooner). ``sync_best``: the synchronous run's best accuracy and the time each
    asyncrl mode needs to reach it; ``sync_over_async`` > 1 means asynchrony is sooner
    (``dynamic_minutes``/``sync_over_dynamic``: the same for the run with dynamic sampling).
    """
    systems = [k for k in SYSTEMS if k in report]
    report["time_to_accuracy_minutes"] = {
        f"{int(level * 100)}%": {k: time_to(report[k]["curve"], level) for k in systems} for level in THRESHOLDS}
    if "trl" in report and "asyncrl" in report:
        report["trl_over_asyncrl"] = {
            lvl: (v["trl"] / v["asyncrl"] if v.get("trl") and v.get("asyncrl") else None)
            for lvl, v in report["time_to_accuracy_minutes"].items()}
    if "asyncrl_sync" in report and "asyncrl" in report and report["asyncrl_sync"]["curve"]:
        best = max(report["asyncrl_sync"]["curve"], key=lambda p: p["accuracy"])
        t_async = time_to(report["asyncrl"]["curve"], best["accuracy"])
        report["sync_best"] = {"accuracy": best["accuracy"], "sync_minutes": best["minutes"], "async_minutes": t_async,
                               "sync_over_async": best["minutes"] / t_async if t_async else None}
        if "asyncrl_dynamic" in report:
            t_dyn = time_to(report["asyncrl_dynamic"]["curve"], best["accuracy"])
            report["sync_best"].update({"dynamic_minutes": t_dyn,
                                        "sync_over_dynamic": best["minutes"] / t_dyn if t_dyn else None})


def plot(report: dict, path: Path) -> None:
    """Held-out accuracy (95% interval shaded) against training wall time, one line per system (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"asyncrl": "asyncrl (async default)", "asyncrl_dynamic": "asyncrl (async, dynamic sampling)",
              "asyncrl_sync": "asyncrl (synchronous knobs)",
              "trl": "TRL GRPOTrainer (synchronous)"}
    fig, ax = plt.subplots(figsize=(8, 4.8), constrained_layout=True)
    for system, color in zip(SYSTEMS, ("tab:blue", "tab:purple", "tab:orange", "tab:green")):
        if system not in report:
            continue
        curve = report[system]["curve"]
        xs = [pt["minutes"] for pt in curve]
        ax.plot(xs, [pt["accuracy"] for pt in curve], "o-", color=color, label=labels[system])
        ax.fill_between(xs, [pt["ci95_low"] for pt in curve], [pt["ci95_high"] for pt in curve], color=color, alpha=0.12)
    for level in THRESHOLDS:
        ax.axhline(level, color="gray", lw=0.6, ls=":")
    ax.set_xlabel("training wall time (minutes; evaluation excluded)")
    ax.set_ylabel("held-out accuracy, 400 problems, T = 1")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("SmolLM2-135M on arithmetic, 2 CPU cores: same model, prompts, reward and knobs")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=13.0, help="training wall time of each system")
    ap.add_argument("--save_every", type=float, default=90.0, help="TRL snapshot spacing, seconds of training")
    ap.add_argument("--asyncrl_eval_every", type=int, default=5, help="asyncrl evaluation spacing, steps")
    ap.add_argument("--num_problems", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default="asyncrl,asyncrl_sync,trl",
                    help="comma-separated, in run order: " + ", ".join(SYSTEMS))
    ap.add_argument("--asyncrl_args", default="", help="extra flags for both asyncrl runs (space-separated)")
    ap.add_argument("--out_dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="write the accuracy curves (PNG) here")
    ap.add_argument("--replot", action="store_true", help="only redraw --plot from --json (no runs)")
    args = ap.parse_args(argv)
    if args.replot:
        if not (args.json and args.plot and args.json.exists()):
            ap.error("--replot needs an existing --json and a --plot path")
        report = json.loads(args.json.read_text())
        compare(report)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        plot(report, args.plot)
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")

    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="trl_compare_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    seconds = args.minutes * 60.0
    report: dict = {}
    if args.json and args.json.exists():
        report.update(json.loads(args.json.read_text()))  # keep the other systems' results when re-running one
    report.update({"minutes": args.minutes, "num_problems": args.num_problems, "threads": args.threads,
                   "environment": _environment()})
    for system in systems:
        t0 = time.perf_counter()
        if system == "trl":
            curve, summary = run_trl(out_dir, seconds, args.save_every, args.threads, args.num_problems)
        else:
            extra = args.asyncrl_args.split() + {"asyncrl_sync": SYNC_ARGS, "asyncrl_dynamic": DYNAMIC_ARGS}.get(system, [])
            curve, summary = run_asyncrl(out_dir, f"{system.replace('_', '-')}-vs-trl", seconds,
                                         args.asyncrl_eval_every, args.num_problems, extra)
        report[system] = {"curve": curve, "summary": summary, "real_seconds": time.perf_counter() - t0}
        compare(report)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
