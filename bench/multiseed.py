"""Several seeds per arm, interleaved, with the statistics a claim about learning needs.

One run of the main job is an anecdote: the held-out curve of the same command swings by 20-50
points between runs (docs/results.md, section 5). This harness runs every arm of a comparison
once per seed, **interleaved** (seed 1 of every arm, then seed 2, ...), so that a slow drift of
the machine hits every arm alike, and reports for each arm:

- the mean held-out curve with its spread across seeds (min, max, standard deviation) at each
  evaluation step;
- each seed's time to 60/70/80% held-out accuracy (training wall minutes of the first evaluation
  at or above the level; ``None`` when never reached);
- ratios of times to a level between arms, ``mean(time of the reference arm) / mean(time of the
  arm)`` (> 1: the arm is sooner), with a 95% percentile-bootstrap interval over seeds (Efron &
  Tibshirani 1993, ch. 13); a seed that never reached the level counts with its whole training
  time, so such a ratio is a bound and is marked ``censored``;
- the time to the reference arm's best: for each seed, the level is the reference run's best
  held-out accuracy, the reference's time is when it first reached it and the arm's when it first
  reached the same level (issue 28's "time to the synchronous run's best"), as a bootstrapped
  ratio like the others;
- each run's idle ratio per role (the controller's ``idle_ratio/<role>``, the share of wall time
  the role waited, averaged over the run) and, per step, publish seconds and bytes;
- each run's trainer cost per processed token (forward, backward and optimizer milliseconds), a
  reading of the machine's speed: ``--markdown`` names every run that cost >= 1.5x its arm's
  cheapest run, since such a run's times measure a slower or shared machine as much as the arm;
- with ``--machine_probe``, the machine's speed just before and just after each run (the plain
  decode loop of ``bench/rollout_bench.py``, tokens/s; :func:`machine_probe`), which on a machine
  whose speed drifts between hours says whether two runs' times are comparable at all;
- per-step training records of every run (train reward, behaviour KL, importance weights,
  entropy, gradient norm, staleness), so that a collapse can be read off the raw JSON;
- the buffer's group books per step (groups finished, zero-variance groups, prompts selective
  rollout skipped before generation) and, from them, each run's share of useful groups (a GRPO
  signal) over the whole run and over its second half, where selective rollout acts.

``run.seed`` varies what each run samples (rollout engines, trainer, evaluation sampling) while
``data.seed`` stays fixed, so every seed of every arm sees the same prompts in the same order
(docs/configuration.md): comparisons are paired by seed.

Each finished run is appended to ``--json`` at once and runs already recorded there (same arm,
seed and settings) are skipped, so a comparison can be spread over several sittings; ``--replot``
recomputes the statistics and the figure from the JSON alone.

Usage::

    python bench/multiseed.py --arms async,sync --seeds 3 --steps 100 --eval_every 25 \\
        --json docs/bench/multiseed_async_sync.json --plot docs/results/multiseed_async_sync.png
    python bench/multiseed.py --arm abort="--rollout.pause_mode abort" --arms async,abort --seeds 3 ...
    python bench/multiseed.py --replot --json F --plot F.png

Arms: the built-in ones of :data:`ARMS` (flags added to ``asyncrl train --config
configs/smollm2_arith.yaml``), ``trl`` (TRL's GRPOTrainer, needs ``trl`` importable: see
bench/trl_compare.py; beside asyncrl's own transformers, accelerate and datasets,
``pip install --no-deps --target DIR trl`` and ``PYTHONPATH=DIR`` make it importable; it saves a
snapshot every ``--trl_save_every`` training seconds and evaluates each after training; ``--arm
trl="--data.reward R"`` gives it ``--data.*`` overrides, the only ones it reads), and any
``--arm NAME="FLAGS"``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "smollm2_arith.yaml"
THRESHOLDS = (0.6, 0.7, 0.8)

#: asyncrl's synchronous mode on the main config (docs/results.md): each step trains the same
#: 6 groups x 8 samples as the asynchronous default's B = ceil(0.75 * 8) = 6, every phase gets
#: both cores.
SYNC_ARGS = ["--partial_percent", "1", "--max_budget", "64", "--max_staleness", "0", "--rollout.rollout_batch_size", "6"]

#: Built-in arms: name -> flags added to ``asyncrl train --config configs/smollm2_arith.yaml``.
ARMS: dict[str, list[str]] = {
    "async": [],
    "sync": SYNC_ARGS,
    "dynamic": ["--rollout.dynamic_sampling", "true"],
}

#: Per-step fields kept from ``metrics-trainer.jsonl`` (the trainer's own step records).
STEP_FIELDS = ("reward/mean", "reward/std", "train/behaviour_kl", "train/importance_weight_mean",
               "train/importance_weight_max", "train/importance_weight_capped_fraction", "train/clip_fraction",
               "train/entropy", "train/grad_norm", "train/advantage_std", "train/response_tokens", "train/samples",
               "staleness/mean", "staleness/max", "time/step_seconds", "time/wait_batch_seconds",
               "time/publish_seconds", "train/publish_bytes", "time/forward_backward_seconds",
               "time/optim_step_seconds", "train/processed_tokens", "train/memory_peak_resident_gb")

#: A run whose trainer cost per processed token is at least this many times its arm's cheapest run's
#: is flagged under the costs table: same code, same settings, so the machine was slower (or shared).
SLOW_MACHINE_FACTOR = 1.5


#: Run totals kept from the controller's records (their last value).
BOOK_FIELDS = ("buffer/finished_groups", "buffer/zero_variance_groups", "buffer/zero_variance_share",
               "buffer/restarts", "buffer/drops", "buffer/skipped_prompts", "buffer/dataset_cursor",
               "buffer/skipped_zero_variance_predicted", "buffer/predicted_skips_easy",
               "buffer/predicted_skips_hard", "buffer/appended_tokens", "buffer/restart_discarded_tokens",
               "supervisor/restarts")

#: The group books kept per step (the controller's last record of each step), for the share of
#: useful groups over a window of steps (:func:`group_shares`).
GROUP_FIELDS = ("buffer/finished_groups", "buffer/zero_variance_groups", "buffer/skipped_zero_variance_predicted")

# ----------------------------------------------------------------------------------------------
# statistics


def time_to(curve: Sequence[dict], level: float, key: str = "minutes") -> float | None:
    """``key`` (minutes or step) of the first point of ``curve`` whose ``accuracy`` >= ``level``.

    Args:
        curve: evaluations in training order, each ``{"minutes", "step", "accuracy", ...}``.
        level: accuracy in [0, 1].
        key: ``minutes`` (training wall minutes) or ``step``.

    Returns:
        The first such point's ``key``; None when no evaluation reached ``level``.
    """
    for point in curve:
        if point["accuracy"] >= level:
            return point[key]
    return None


def recipe_check(curve: Sequence[dict], minutes: float | None = None, reach: float = 0.80,
                 hold_from: float = 0.70, floor: float = 0.65) -> dict:
    """Issue 27's bar for a default recipe, on one run's held-out curve.

    The run *reaches* when an evaluation within ``minutes`` of training (all of them when None)
    is >= ``reach``; it *holds* when, after its first evaluation >= ``hold_from``, no later
    evaluation is below ``floor``.

    Args:
        curve: evaluations in training order, each ``{"minutes", "step", "accuracy"}``.
        minutes: the training-time limit of the reach test (training wall minutes).
        reach, hold_from, floor: accuracies in [0, 1].

    Returns:
        ``{"reached_at": minutes or None, "lowest_after": accuracy or None (no evaluation after
        the first >= hold_from), "lowest_after_step", "holds": bool, "passes": bool}``.
    """
    pts = [p for p in curve if minutes is None or p["minutes"] <= minutes + 1e-9]
    reached_at = next((p["minutes"] for p in pts if p["accuracy"] >= reach), None)
    first = next((i for i, p in enumerate(curve) if p["accuracy"] >= hold_from), None)
    later = curve[first + 1:] if first is not None else []
    low = min(later, key=lambda p: p["accuracy"]) if later else None
    holds = low is None or low["accuracy"] >= floor
    return {"reached_at": reached_at, "lowest_after": None if low is None else low["accuracy"],
            "lowest_after_step": None if low is None else low["step"], "holds": holds,
            "passes": holds and reached_at is not None}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _sd(xs: Sequence[float]) -> float:
    """Sample standard deviation (n - 1); 0 for fewer than two values."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def curve_band(curves: Sequence[Sequence[dict]], key: str = "step") -> list[dict]:
    """The mean held-out curve of several seeds and its spread, at each ``key`` value all share.

    Args:
        curves: one curve per seed (see :func:`time_to`).
        key: ``step`` (runs of a fixed number of steps: evaluations line up) or ``minutes``.

    Returns:
        ``[{key, mean, min, max, sd, n, values, minutes_mean}]`` for each ``key`` value present in
        every curve, in increasing order (``values``: each seed's accuracy, in the order given).
    """
    if not curves:
        return []
    common = set.intersection(*({p[key] for p in c} for c in curves))
    out = []
    for x in sorted(common):
        pts = [next(p for p in c if p[key] == x) for c in curves]
        vals = [p["accuracy"] for p in pts]
        out.append({key: x, "mean": _mean(vals), "min": min(vals), "max": max(vals), "sd": _sd(vals),
                    "n": len(vals), "values": vals, "minutes_mean": _mean([p["minutes"] for p in pts])})
    return out


def bootstrap_ratio(numerator: Sequence[float], denominator: Sequence[float], n_boot: int = 10_000,
                    seed: int = 0, paired: bool = True, confidence: float = 0.95) -> dict:
    """``mean(numerator) / mean(denominator)`` with a percentile-bootstrap interval over seeds.

    The bootstrap (Efron & Tibshirani 1993, *An Introduction to the Bootstrap*, ch. 13) resamples
    seeds with replacement: with ``paired`` the same seed indices for both arms (their runs saw
    the same prompt stream), else each arm independently.

    Args:
        numerator, denominator: one value per seed (e.g. minutes to 80% of the reference arm and of
            the arm), all > 0; paired lists must have equal length.
        n_boot: bootstrap resamples.
        seed: seed of the resampling (the interval is deterministic given the inputs).
        paired: resample seeds jointly.
        confidence: two-sided coverage of the interval.

    Returns:
        ``{"ratio", "ci_low", "ci_high", "n"}``.

    Raises:
        ValueError: an empty list, a non-positive value, or paired lists of different lengths.
    """
    if not numerator or not denominator:
        raise ValueError("bootstrap_ratio needs at least one value in each list")
    if min(numerator) <= 0 or min(denominator) <= 0:
        raise ValueError("bootstrap_ratio needs positive values (times)")
    if paired and len(numerator) != len(denominator):
        raise ValueError(f"paired bootstrap needs equal lengths, got {len(numerator)} and {len(denominator)}")
    rng = random.Random(seed)
    ratios = []
    for _ in range(n_boot):
        if paired:
            idx = [rng.randrange(len(numerator)) for _ in numerator]
            a, b = [numerator[i] for i in idx], [denominator[i] for i in idx]
        else:
            a = [rng.choice(numerator) for _ in numerator]
            b = [rng.choice(denominator) for _ in denominator]
        ratios.append(_mean(a) / _mean(b))
    ratios.sort()
    tail = (1.0 - confidence) / 2.0
    lo = ratios[min(len(ratios) - 1, int(math.floor(tail * n_boot)))]
    hi = ratios[min(len(ratios) - 1, int(math.ceil((1.0 - tail) * n_boot)) - 1)]
    return {"ratio": _mean(numerator) / _mean(denominator), "ci_low": lo, "ci_high": hi, "n": len(numerator)}


def arm_stats(runs: Sequence[dict], key: str = "step", minutes: float | None = None) -> dict:
    """Statistics of one arm's runs (see the module docstring).

    Args:
        runs: the arm's run records (``curve``, ``seed``, ``train_minutes``), one per seed.
        key: what the band lines up on (``step``: also for timed runs, whose evaluations fall on
            the same steps; their last, end-of-time evaluation is in ``final``).
        minutes: the runs' training-time limit, for :func:`recipe_check`.

    Returns:
        ``{"seeds", "band", "time_to", "best", "final", "recipe"}``: the seeds, :func:`curve_band`,
        per-level lists of each seed's minutes to the level (None: never), each seed's best
        accuracy, its last evaluation, and its :func:`recipe_check`.
    """
    runs = sorted(runs, key=lambda r: r["seed"])
    return {
        "seeds": [r["seed"] for r in runs],
        "band": curve_band([r["curve"] for r in runs], key),
        "time_to": {f"{round(lv * 100)}%": [time_to(r["curve"], lv) for r in runs] for lv in THRESHOLDS},
        "best": [max(p["accuracy"] for p in r["curve"]) for r in runs],
        "final": [{"step": r["curve"][-1]["step"], "minutes": r["curve"][-1]["minutes"],
                   "accuracy": r["curve"][-1]["accuracy"]} for r in runs],
        "recipe": [recipe_check(r["curve"], minutes) for r in runs],
    }


def time_ratio(ref_runs: Sequence[dict], arm_runs: Sequence[dict], level: float, **kw: Any) -> dict | None:
    """How much sooner ``arm_runs`` reach ``level`` than ``ref_runs``: ref time / arm time, bootstrapped.

    Seeds present in both arms are paired. A seed that never reached the level counts with its
    training minutes (a lower bound of its time), and the result says ``censored``.

    Returns:
        :func:`bootstrap_ratio`'s dict plus ``censored`` (bool) and ``seeds``; None when no seed of
        either arm reached the level (nothing to compare).
    """
    ref = {r["seed"]: r for r in ref_runs}
    arm = {r["seed"]: r for r in arm_runs}
    seeds = sorted(set(ref) & set(arm))
    if not seeds:
        return None
    num, den, censored, any_reached = [], [], False, False
    for s in seeds:
        pair = []
        for r in (ref[s], arm[s]):
            t = time_to(r["curve"], level)
            any_reached |= t is not None
            if t is None:
                censored = True
                t = r["train_minutes"]
            pair.append(max(t, 1e-6))
        num.append(pair[0])
        den.append(pair[1])
    if not any_reached:
        return None
    return {**bootstrap_ratio(num, den, **kw), "censored": censored, "seeds": seeds}


def time_to_ref_best(ref_runs: Sequence[dict], arm_runs: Sequence[dict], **kw: Any) -> dict | None:
    """How much sooner ``arm_runs`` reach the reference's best than the reference itself, bootstrapped.

    For each seed in both arms, the level is the reference run's best held-out accuracy; the
    reference's time is the first evaluation at that level, the arm's the first at or above it
    (issue 28: "time to the synchronous run's best"). An arm seed that never got there counts
    with its training minutes (a lower bound) and marks the result ``censored``.

    A seed whose reference never rose above its own base evaluation (its best is first reached at
    step 0, before any training) has no time to the best: every arm is there at minute 0, and a
    ratio of two zeros says nothing. Such a seed is left out of the ratio and listed in
    ``no_gain`` with the reference's base and best trained accuracy and the arm's best, so that a
    table shows it rather than hiding it (leaving it out flatters the reference: it is the seed on
    which it learned nothing).

    Returns:
        :func:`bootstrap_ratio`'s dict (ref time / arm time; > 1: the arm is sooner) plus
        ``censored``, ``seeds`` and ``levels`` (each compared seed's reference best) and
        ``no_gain`` (``[{"seed", "ref_base", "ref_best_trained", "arm_best"}]``); when every common
        seed is such a seed, ``ratio``, ``ci_low`` and ``ci_high`` are None and ``n`` is 0. None
        without a common seed.
    """
    ref = {r["seed"]: r for r in ref_runs}
    arm = {r["seed"]: r for r in arm_runs}
    seeds = sorted(set(ref) & set(arm))
    if not seeds:
        return None
    num, den, levels, used, no_gain, censored = [], [], [], [], [], False
    for s in seeds:
        curve = ref[s]["curve"]
        level = max(p["accuracy"] for p in curve)
        first = next(p for p in curve if p["accuracy"] >= level)
        if first.get("step") == 0:
            trained = [p["accuracy"] for p in curve if p.get("step") != 0]
            no_gain.append({"seed": s, "ref_base": first["accuracy"],
                            "ref_best_trained": max(trained) if trained else None,
                            "arm_best": max(p["accuracy"] for p in arm[s]["curve"])})
            continue
        t_ref = time_to(curve, level)
        t_arm = time_to(arm[s]["curve"], level)
        if t_arm is None:
            censored, t_arm = True, arm[s]["train_minutes"]
        num.append(max(t_ref, 1e-6))
        den.append(max(t_arm, 1e-6))
        levels.append(level)
        used.append(s)
    out = (bootstrap_ratio(num, den, **kw) if num
           else {"ratio": None, "ci_low": None, "ci_high": None, "n": 0})
    return {**out, "censored": censored, "seeds": used, "levels": levels, "no_gain": no_gain}


def compute_stats(report: dict) -> dict:
    """Every arm's :func:`arm_stats` and, against the first arm listed in ``report["arms"]``, the
    ratios of times to each threshold and to the reference run's best, seed by seed
    (:func:`time_to_ref_best`, key ``ref_best``) (in place; returned)."""
    # Timed runs evaluate on the same steps too (every eval_every): line them up by step.
    key = "step"
    minutes = report["settings"].get("minutes")
    by_arm: dict[str, list[dict]] = {}
    for r in report["runs"]:
        by_arm.setdefault(r["arm"], []).append(r)
    arms = [a for a in report["arms"] if a in by_arm] + sorted(set(by_arm) - set(report["arms"]))
    stats: dict[str, Any] = {"arms": {a: arm_stats(by_arm[a], key, minutes) for a in arms}}
    if len(arms) > 1:
        ref = arms[0]
        ratios: dict[str, Any] = {}
        for a in arms[1:]:
            ratios[a] = {f"{round(lv * 100)}%": time_ratio(by_arm[ref], by_arm[a], lv) for lv in THRESHOLDS}
            ratios[a]["ref_best"] = time_to_ref_best(by_arm[ref], by_arm[a])
        stats["ratios_vs"] = ref
        stats["ratios"] = ratios
    report["stats"] = stats
    return report


# ----------------------------------------------------------------------------------------------
# runs


def _env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def read_run(run_dir: Path) -> dict:
    """A finished ``asyncrl train`` run's curve and per-step records, from its run directory.

    Returns:
        ``{"curve": [{minutes, step, accuracy, ci95_low, ci95_high, eval_seconds}], "steps": [{step, minutes,
        <STEP_FIELDS>}], "train_minutes", "final_step", "books", "replayed_steps", "groups", "idle"}``,
        plus ``trainer_peak_gb`` where the trainer recorded its memory (minutes of training wall time,
        evaluation excluded; ``eval_seconds``: the evaluation's own wall seconds, where the controller
        recorded them; ``steps``: one record per step, the last one where a restarted trainer trained
        steps again from its checkpoint, ``replayed_steps`` counting the attempts so replaced;
        ``trainer_peak_gb``: the largest per-step peak resident memory of every attempt, replaced ones
        included; ``books``: the controller's last value of each :data:`BOOK_FIELDS`;
        ``groups``: ``[{step, <GROUP_FIELDS>}]``, the controller's last record of
        each step that has them (running totals); ``idle``: role -> mean of its ``idle_ratio/<role>`` records, a share in
        [0, 1] of the wall time the role waited, from the controller's records, or the trainer's own
        when the controller has none for it).
    Raises:
        FileNotFoundError: the run directory has no controller records.
    """
    curve, steps, books, last_wall = [], [], {}, 0.0
    idle: dict[str, list[float]] = {}
    groups: dict[int, dict] = {}
    for line in (run_dir / "metrics-controller.jsonl").read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        books.update({k: v for k, v in rec.items() if k in BOOK_FIELDS})
        if "step" in rec and all(k in rec for k in GROUP_FIELDS[:2]):
            groups[int(rec["step"])] = {"step": int(rec["step"]), **{k: rec[k] for k in GROUP_FIELDS if k in rec}}
        for k, v in rec.items():
            if k.startswith("idle_ratio/") and isinstance(v, (int, float)):
                idle.setdefault(k.split("/", 1)[1], []).append(float(v))
        last_wall = max(last_wall, float(rec.get("wall_seconds", 0.0)))
        if "eval/accuracy_sampled" in rec:
            curve.append({"minutes": rec["wall_seconds"] / 60.0, "step": rec["step"],
                          "accuracy": rec["eval/accuracy_sampled"], "ci95_low": rec["eval/ci95_low"],
                          "ci95_high": rec["eval/ci95_high"],
                          **({"eval_seconds": rec["eval/eval_seconds"]} if "eval/eval_seconds" in rec else {})})
    trainer = run_dir / "metrics-trainer.jsonl"
    replayed, peak = 0, None
    if trainer.exists():
        for line in trainer.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if "step" not in rec or "reward/mean" not in rec:
                continue
            row = {"step": rec["step"], "minutes": rec.get("wall_seconds", 0.0) / 60.0}
            row.update({k: rec[k] for k in STEP_FIELDS if k in rec})
            if "train/memory_peak_resident_gb" in row:  # over every attempt: what the machine had to hold
                peak = max(peak or 0.0, row["train/memory_peak_resident_gb"])
            # a trainer restarted from its last checkpoint trains the steps after it again: the
            # replay's record replaces the lost attempt's (whose weights the run no longer has)
            while steps and steps[-1]["step"] >= row["step"]:
                steps.pop()
                replayed += 1
            steps.append(row)
            if "idle_ratio/trainer" in rec and "trainer" not in idle:  # the controller's records lack it
                idle.setdefault("trainer_records", []).append(float(rec["idle_ratio/trainer"]))
    if "trainer_records" in idle:
        idle.setdefault("trainer", idle.pop("trainer_records"))
    train_minutes = max(last_wall / 60.0, steps[-1]["minutes"] if steps else 0.0)
    return {"curve": curve, "steps": steps, "train_minutes": train_minutes,
            "final_step": steps[-1]["step"] if steps else 0, "books": books, "replayed_steps": replayed,
            **({"trainer_peak_gb": peak} if peak is not None else {}),
            "groups": [groups[k] for k in sorted(groups)],
            "idle": {role: _mean(v) for role, v in sorted(idle.items()) if v}}


def run_asyncrl(out_dir: Path, arm: str, seed: int, flags: list[str], settings: dict) -> dict:
    """``asyncrl train`` on the main config for one (arm, seed); its :func:`read_run` record.

    Raises:
        SystemExit: the run failed (its log is named).
    """
    name = f"{arm}-s{seed}"
    stop = (["--run.total_steps", str(settings["steps"]), "--run.max_wall_seconds", "36000"] if settings.get("steps")
            else ["--run.total_steps", "100000", "--run.max_wall_seconds", str(int(settings["minutes"] * 60))])
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "--config", str(ROOT / settings["config"]), "--run.name", name,
           "--run.output_dir", str(out_dir), "--run.seed", str(seed), *stop,
           "--monitoring.eval_interval", str(settings["eval_every"]),
           "--monitoring.eval_num_problems", str(settings["num_problems"]),
           "--monitoring.eval_modes", '["sampled"]', "--overwrite", *flags]
    log = out_dir / f"{name}.log"
    with log.open("w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT).returncode
    if rc != 0:
        raise SystemExit(f"asyncrl train exited {rc}; see {log}")
    record = read_run(out_dir / name)
    if not settings.get("keep_run_files"):
        prune_run_dir(out_dir / name)
    return record


def prune_run_dir(run_dir: Path) -> int:
    """Delete a finished run's checkpoints and every weight version but the newest; bytes freed.

    A 10-minute main-job run leaves ~4.6 GB (two DeepSpeed checkpoints of 1.6 GB with the
    optimizer state, three published versions of 517 MB); a 5-seed sweep of two arms filled
    this machine's disk on 2026-11-26. The records the harness reads (metrics, evaluations,
    logs) and the final weights (for ``bench/answer_probe.py``) stay.
    """
    import shutil

    freed = 0
    doomed = [run_dir / "checkpoints"]
    versions = sorted(p for p in (run_dir / "weights").glob("v*") if p.is_dir())
    doomed += versions[:-1]
    for d in doomed:
        if d.exists():
            freed += sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            shutil.rmtree(d)
    return freed


def run_trl_seed(out_dir: Path, seed: int, settings: dict) -> dict:
    """TRL's GRPOTrainer (bench/trl_compare.py) for ``settings["minutes"]`` with ``seed``, on the
    comparison's config (its model, task, prompts, reward and knobs) with the arm's ``--data.*``
    overrides (``settings["overrides"]``), snapshotting every ``settings["save_every"]`` training
    seconds (``--trl_save_every``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trl_compare import run_trl  # needs trl importable

    save_every = settings["save_every"]
    curve, summary = run_trl(out_dir / f"trl-s{seed}", settings["minutes"] * 60.0, save_every,
                             settings.get("threads", 2), settings["num_problems"], seed=seed,
                             config=ROOT / settings["config"], overrides=settings.get("overrides", ()))
    return {"curve": curve, "steps": [], "train_minutes": summary["wall_seconds"] / 60.0,
            "final_step": summary["steps"], "save_every_seconds": save_every}


def reread(report: dict, out_dir: Path) -> int:
    """Refresh the recorded runs (in place) from their run directories ``out_dir/<arm>-s<seed>``.

    The run records of :func:`read_run` (curve, steps, books, idle, minutes) are read again; the
    arm, seed, commit and times of the record stay. Runs without a directory (e.g. TRL's) are left
    as they are. Returns how many runs were refreshed.
    """
    n = 0
    for r in report["runs"]:
        d = out_dir / f"{r['arm']}-s{r['seed']}"
        if (d / "metrics-controller.jsonl").exists():
            r.update(read_run(d))
            n += 1
    return n


def plan(arms: Sequence[str], seeds: Iterable[int], done: set[tuple[str, int]]) -> list[tuple[str, int]]:
    """The (arm, seed) runs still to do, interleaved: every arm's seed s before any arm's seed s + 1."""
    return [(a, s) for s in seeds for a in arms if (a, s) not in done]


def _environment() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"commit": commit, "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}


def machine_probe(model: str = "smollm2-135m-instruct", concurrency: int = 26, threads: int = 2,
                  gen_tokens: int = 128, timeout: float = 900.0) -> dict:
    """The machine's speed now: tokens/s of the plain batched decode loop of ``bench/rollout_bench.py
    --no-server`` (``concurrency`` rows of 64 prompt tokens, ``gen_tokens`` sampled tokens each, on
    ``threads`` threads; 1-2 minutes on two cores for SmolLM2-135M), run in a child process
    between runs, never during one.

    This machine's speed drifts: the same loop gave 149-181 tok/s on 2026-11-29 and 35-186 within
    one evening of 2026-11-30 with nothing else running (docs/results.md, sections O and P). A run's
    times mean little without the speed of the machine it ran on, so ``--machine_probe`` records
    this before and after every run (``machine_before`` and ``machine_after`` in the run's record).

    Returns:
        ``{"tokens_per_second", "concurrency", "threads", "gen_tokens", "utc", "load_average"}``, or
        ``{"error": "...", "utc"}`` when the loop failed (the run itself still goes ahead: a missing
        reading is reported as missing, not as a speed).
    """
    utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="machine_probe_") as d:
        out = Path(d) / "probe.json"
        cmd = [sys.executable, str(ROOT / "bench" / "rollout_bench.py"), "--no-server", "--model", model,
               "--concurrency", str(concurrency), "--threads", str(threads), "--gen-tokens", str(gen_tokens),
               "--json", str(out)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"the decode loop ran past {timeout:g} s", "utc": utc}
        if p.returncode != 0 or not out.exists():
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"error": f"bench/rollout_bench.py exited {p.returncode}: {tail[0]}", "utc": utc}
        rec = json.loads(out.read_text())
    return {"tokens_per_second": rec["rows"][0]["ceiling_tokens_per_second"], "concurrency": concurrency,
            "threads": threads, "gen_tokens": gen_tokens, "utc": utc, "load_average": rec.get("load_average")}


def plot(report: dict, path: Path) -> None:
    """Mean held-out curve per arm (line), min-max band over seeds (shaded), each seed (thin).

    Step-count comparisons are drawn against the step; timed ones against training minutes, each
    seed at its own minutes and the mean of an evaluation step at the seeds' mean minutes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "step" if report["settings"].get("steps") else "minutes"
    fig, ax = plt.subplots(figsize=(8, 4.8), constrained_layout=True)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red", "tab:brown", "tab:pink", "tab:gray",
              "tab:olive", "tab:cyan"]  # ten arms before a colour repeats
    for (arm, st), color in zip(report["stats"]["arms"].items(), colors * 4):
        for r in (r for r in report["runs"] if r["arm"] == arm):
            ax.plot([p[key] for p in r["curve"]], [p["accuracy"] for p in r["curve"]], color=color, lw=0.6, alpha=0.45)
        band = st["band"]  # lined up by step; a timed run's mean is drawn at the seeds' mean minutes
        xs = [b["step"] if key == "step" else b["minutes_mean"] for b in band]
        ax.plot(xs, [b["mean"] for b in band], "o-", color=color, lw=2,
                label=(f"{arm} (mean of {len(st['seeds'])} seeds, min-max shaded)" if len(st["seeds"]) > 1
                       else f"{arm} (one seed: an anecdote)"))
        ax.fill_between(xs, [b["min"] for b in band], [b["max"] for b in band], color=color, alpha=0.15)
    for level in THRESHOLDS:
        ax.axhline(level, color="gray", lw=0.6, ls=":")
    ax.set_xlabel("training step" if key == "step" else "training wall time (minutes; evaluation excluded)")
    ax.set_ylabel("held-out accuracy, T = 1")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(report.get("title") or "held-out accuracy over seeds")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_diagnostics(run: dict) -> dict | None:
    """What a run's per-step records say about its stability (None: no step records, e.g. TRL).

    Returns:
        ``{"min_reward", "min_reward_step"}`` (lowest train reward after step 8, once the early
        long answers are gone), ``{"max_behaviour_kl", "max_behaviour_kl_step"}``,
        ``entropy_steps_9_12`` (mean policy entropy, nats per token), ``max_importance_weight``
        (before the cap), ``max_clip_fraction``, ``zero_variance_share`` and ``restarts`` (the
        buffer's totals at the end).
    """
    steps = [s for s in run.get("steps", []) if "reward/mean" in s]
    if not steps:
        return None
    late = [s for s in steps if s["step"] > 8] or steps
    lo = min(late, key=lambda s: s["reward/mean"])
    kl = max(steps, key=lambda s: s.get("train/behaviour_kl", 0.0))
    ent = [s.get("train/entropy", 0.0) for s in steps if 9 <= s["step"] <= 12]
    books = run.get("books", {})
    return {"min_reward": lo["reward/mean"], "min_reward_step": lo["step"],
            "max_behaviour_kl": kl.get("train/behaviour_kl", 0.0), "max_behaviour_kl_step": kl["step"],
            "entropy_steps_9_12": sum(ent) / len(ent) if ent else float("nan"),
            "max_importance_weight": max(s.get("train/importance_weight_max", 0.0) for s in steps),
            "max_clip_fraction": max(s.get("train/clip_fraction", 0.0) for s in steps),
            "zero_variance_share": books.get("buffer/zero_variance_share", float("nan")),
            "restarts": books.get("buffer/restarts", 0)}


def group_shares(run: dict, first_step: int | None = None, last_step: int | None = None) -> dict | None:
    """The share of useful groups, and of prompts skipped before generation, over a window of steps.

    From the run's ``groups`` records (:func:`read_run`: running totals at the end of each step),
    the differences between the last record at or before ``first_step`` (zero totals when None,
    the whole run from its start, or when no record is that early) and the last at or before
    ``last_step`` (the run's end when None). A useful group is one whose
    samples' rewards differ (a GRPO signal); the others are the buffer's zero-variance groups
    (docs/buffer.md). The skip share is selective rollout's predicted skips / (groups finished +
    predicted skips) in the window.

    Returns:
        ``{"first_step", "last_step", "finished", "useful_share", "predicted_skips",
        "predicted_skip_share"}``; None when the run has no group records or no group finished in
        the window.
    """
    recs = run.get("groups") or []
    if not recs:
        return None
    zero = {k: 0 for k in GROUP_FIELDS}
    before = [] if first_step is None else [r for r in recs if r["step"] <= first_step]
    upto = [r for r in recs if last_step is None or r["step"] <= last_step]
    if not upto:
        return None
    a, b = (before[-1] if before else zero), upto[-1]
    d = {k: b.get(k, 0) - a.get(k, 0) for k in GROUP_FIELDS}
    finished, skips = d["buffer/finished_groups"], d["buffer/skipped_zero_variance_predicted"]
    if finished <= 0:
        return None
    return {"first_step": 0 if first_step is None else first_step, "last_step": b["step"], "finished": finished,
            "useful_share": 1.0 - d["buffer/zero_variance_groups"] / finished,
            "predicted_skips": skips, "predicted_skip_share": skips / (finished + skips)}


def group_shares_markdown(report: dict, arms: Sequence[str]) -> list[str]:
    """A table of :func:`group_shares` per run, over the whole run and over its second half (no
    lines when no run has group records)."""
    rows = []
    for r in sorted(report["runs"], key=lambda r: (arms.index(r["arm"]) if r["arm"] in arms else 99, r["seed"])):
        whole = group_shares(r)
        if whole is None:
            continue
        half = group_shares(r, first_step=r["final_step"] // 2)
        rows.append(f"| {r['arm']} s{r['seed']} | {whole['finished']} | {100 * whole['useful_share']:.1f} | "
                    + ("— | —" if half is None else
                       f"{half['first_step'] + 1}–{half['last_step']}: {100 * half['useful_share']:.1f} | "
                       f"{100 * half['predicted_skip_share']:.1f}")
                    + f" | {whole['predicted_skips']} |")
    if not rows:
        return []
    return ["", "| run | groups finished | useful groups, % (whole run) | useful groups, % (second half: steps) "
            "| prompts skipped before generation, % (second half) | prompts skipped (whole run) |",
            "|---|---|---|---|---|---|", *rows]


def markdown(report: dict) -> str:
    """The statistics as markdown tables: held-out accuracy per evaluation (mean [min, max] over
    seeds, then each seed), times to 60/70/80% per seed, and the bootstrap ratios."""
    key = "step"
    timed = report["settings"].get("minutes")
    st = report["stats"]
    arms = list(st["arms"])
    xs = sorted(set.intersection(*({b[key] for b in st["arms"][a]["band"]} for a in arms))) if arms else []
    fmt = lambda x: f"step {x}"  # noqa: E731
    end = [f"end of {timed:g} min: step, % (each seed)"] if timed else []
    lines = ["| arm (seeds) | " + " | ".join([fmt(x) for x in xs] + end) + " |", "|---|" + "---|" * (len(xs) + len(end))]
    for a in arms:
        band = {b[key]: b for b in st["arms"][a]["band"]}
        cells = []
        for x in xs:
            b = band[x]
            cells.append(f"{100 * b['mean']:.1f} [{100 * b['min']:.1f}, {100 * b['max']:.1f}] "
                         f"({', '.join(f'{100 * v:.1f}' for v in b['values'])})")
        if timed:
            fin = st["arms"][a]["final"]
            cells.append(f"{100 * _mean([f['accuracy'] for f in fin]):.1f} ("
                         + ", ".join(f"{f['step']}: {100 * f['accuracy']:.1f}" for f in fin) + ")")
        lines.append(f"| {a} ({', '.join(map(str, st['arms'][a]['seeds']))}) | " + " | ".join(cells) + " |")
    lines += ["", "| arm | minutes to 60% (each seed) | to 70% | to 80% | best (each seed) |", "|---|---|---|---|---|"]
    for a in arms:
        tt = st["arms"][a]["time_to"]
        cell = (lambda ts: ", ".join("never" if t is None else f"{t:.1f}" for t in ts))
        lines.append(f"| {a} | {cell(tt['60%'])} | {cell(tt['70%'])} | {cell(tt['80%'])} | "
                     + ", ".join(f"{100 * v:.1f}" for v in st["arms"][a]["best"]) + " |")
    if timed:
        lines += ["", f"| arm | seeds reaching 80% within {timed:g} min | seeds holding (no evaluation < 65% after the "
                  "first >= 70%) | lowest evaluation after the first >= 70% (each seed: %, step) |", "|---|---|---|---|"]
        for a in arms:
            rc = st["arms"][a]["recipe"]
            lows = ", ".join("—" if c["lowest_after"] is None else f"{100 * c['lowest_after']:.1f} ({c['lowest_after_step']})"
                             for c in rc)
            lines.append(f"| {a} | {sum(c['reached_at'] is not None for c in rc)} of {len(rc)} | "
                         f"{sum(c['holds'] for c in rc)} of {len(rc)} | {lows} |")
    lines += ["", "| run | lowest train reward after step 8 (step) | largest behaviour KL (step) | entropy, steps 9-12 "
              "| largest importance weight | clip fraction, max | zero-variance groups | restarted samples |",
              "|---|---|---|---|---|---|---|---|"]
    for r in sorted(report["runs"], key=lambda r: (arms.index(r["arm"]) if r["arm"] in arms else 99, r["seed"])):
        d = run_diagnostics(r)
        if d:
            lines.append(f"| {r['arm']} s{r['seed']} | {d['min_reward']:.2f} ({d['min_reward_step']}) | "
                         f"{d['max_behaviour_kl']:.3f} ({d['max_behaviour_kl_step']}) | {d['entropy_steps_9_12']:.2f} | "
                         f"{d['max_importance_weight']:.1f} | {d['max_clip_fraction']:.3f} | "
                         f"{d['zero_variance_share']:.2f} | {d['restarts']} |")
    lines += run_costs_markdown(report, arms)
    lines += group_shares_markdown(report, arms)
    if st.get("ratios"):
        lines += ["", f"| time ratio {st['ratios_vs']} / arm (> 1: the arm is sooner) | 60% | 70% | 80% | "
                  f"{st['ratios_vs']}'s best (each seed's level) |", "|---|---|---|---|---|"]
        for a, per in st["ratios"].items():
            cells = []
            for lv in ("60%", "70%", "80%", "ref_best"):
                r = per.get(lv)
                cell = "—" if r is None or r["ratio"] is None else (
                    f"{r['ratio']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]" + (" (censored)" if r["censored"] else ""))
                if r is not None and lv == "ref_best":
                    if r["levels"]:
                        cell += " (" + ", ".join(f"{100 * v:.1f}" for v in r["levels"]) + ")"
                    for g in r.get("no_gain", []):
                        trained = "—" if g["ref_best_trained"] is None else f"{100 * g['ref_best_trained']:.1f}"
                        cell += (f"; s{g['seed']} left out: {st['ratios_vs']} never rose above its base "
                                 f"({100 * g['ref_base']:.1f}; best trained {trained}; {a}'s best {100 * g['arm_best']:.1f})")
                cells.append(cell)
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_costs(run: dict) -> dict:
    """What a run's records say about where its time went (empty for runs without records, e.g. TRL).

    Returns:
        ``{"idle": {role: share}, "seconds_per_step", "publish_seconds", "publish_megabytes",
        "appended_tokens", "trained_tokens", "restart_discarded_share", "untrained_share"}`` where
        present: the run's mean idle ratio per role (:func:`read_run`), its training minutes per step
        in seconds, the mean publish seconds and megabytes (10^6 bytes) per step; and its token books:
        the response tokens the rollout servers appended to the buffer (``buffer/appended_tokens``),
        the response tokens the trainer trained (the sum of ``train/response_tokens``), the share of
        the appended tokens that restarts threw away (``buffer/restart_discarded_tokens``, recorded
        since 2026-11-29) and the share never trained (discarded, dropped, or still in the buffer
        when the run stopped), each in [0, 1]; ``trainer_ms_per_token``: the median over steps (step 1,
        which warms up, left out when later steps exist) of the trainer's forward, backward and
        optimizer seconds per processed token (prompt and response tokens of the batch), in
        milliseconds; ``machine_before`` and ``machine_after``: the plain decode loop's tokens/s
        measured just before and just after the run (:func:`machine_probe`, with ``--machine_probe``);
        ``trainer_peak_gb``: the largest of the trainer's per-step peak resident memory (recorded since
        2026-12-01); ``role_restarts``: the roles the controller's supervisor restarted in the run
        (a kill by the kernel's OOM killer is one), with ``replayed_steps``, the steps a restarted
        trainer trained again from its checkpoint (their time is in the run's);
        ``base_eval_seconds``: the wall seconds of the run's step-0 evaluation. That evaluation samples
        the base model on the same problems with the run's seed, so for one seed it is the same work
        in every arm (the same tokens): a free reading of the machine's speed as each run started.
        With the same code and settings the trainer's cost measures the machine: a run whose trainer ran
        alone (the synchronous mode) and costs 2x its arm's other runs ran on a slower or shared
        machine (:func:`slow_runs`).
    """
    out: dict[str, Any] = {}
    if run.get("idle"):
        out["idle"] = run["idle"]
    if run.get("final_step"):
        out["seconds_per_step"] = 60.0 * run["train_minutes"] / run["final_step"]
    steps = run.get("steps", [])
    timed = [(s["step"], 1000.0 * (s["time/forward_backward_seconds"] + s["time/optim_step_seconds"])
              / s["train/processed_tokens"]) for s in steps
             if s.get("train/processed_tokens") and "time/forward_backward_seconds" in s and "time/optim_step_seconds" in s]
    if timed:
        later = [v for st, v in timed if st > 1]
        out["trainer_ms_per_token"] = statistics.median(later or [v for _, v in timed])
    for key, name, scale in (("time/publish_seconds", "publish_seconds", 1.0),
                             ("train/publish_bytes", "publish_megabytes", 1e-6)):
        vals = [s[key] for s in steps if key in s]
        if vals:
            out[name] = scale * _mean(vals)
    first = (run.get("curve") or [{}])[0]
    if first.get("step") == 0 and first.get("eval_seconds") is not None:
        out["base_eval_seconds"] = first["eval_seconds"]
    for key in ("machine_before", "machine_after"):
        if (run.get(key) or {}).get("tokens_per_second") is not None:
            out[key] = run[key]["tokens_per_second"]
    if run.get("trainer_peak_gb") is not None:  # read_run's, over every attempt of every step
        out["trainer_peak_gb"] = run["trainer_peak_gb"]
    books = run.get("books", {})
    if "supervisor/restarts" in books or "replayed_steps" in run:
        # the controller records the count when a restart happens: none recorded in a run read
        # by this version of read_run is none made
        out["role_restarts"] = int(books.get("supervisor/restarts", 0))
        out["replayed_steps"] = int(run.get("replayed_steps", 0))
    appended = books.get("buffer/appended_tokens")
    trained = [s["train/response_tokens"] for s in steps if "train/response_tokens" in s]
    if appended:
        out["appended_tokens"] = int(appended)
        if "buffer/restart_discarded_tokens" in books:
            out["restart_discarded_share"] = books["buffer/restart_discarded_tokens"] / appended
        if trained and len(trained) == len(steps):
            out["trained_tokens"] = int(sum(trained))
            out["untrained_share"] = max(0.0, 1.0 - out["trained_tokens"] / appended)
    return out


def slow_runs(report: dict, factor: float = SLOW_MACHINE_FACTOR) -> list[dict]:
    """Runs whose trainer cost per processed token (:func:`run_costs`) is ``>= factor`` times the
    cheapest run of the same arm: the same code and settings, so a slower or shared machine.

    Returns:
        ``[{"arm", "seed", "ms_per_token", "arm_lowest_ms_per_token", "factor"}]`` in the runs' order;
        empty when fewer than two runs of an arm have the figure.
    Raises:
        ValueError: ``factor`` is not above 1.
    """
    if not factor > 1.0:
        raise ValueError(f"factor={factor}: a run is slow when it costs more than its arm's cheapest, so give a "
                         "factor above 1 (the default is 1.5)")
    timed = [(r, v) for r in report["runs"] if (v := run_costs(r).get("trainer_ms_per_token")) is not None]
    by_arm: dict[str, list[float]] = {}
    for r, v in timed:
        by_arm.setdefault(r["arm"], []).append(v)
    out = []
    for r, v in timed:
        costs = by_arm[r["arm"]]
        low = min(costs)
        if len(costs) > 1 and low > 0 and v >= factor * low:
            out.append({"arm": r["arm"], "seed": r["seed"], "ms_per_token": v, "arm_lowest_ms_per_token": low,
                        "factor": v / low})
    return out


def run_costs_markdown(report: dict, arms: Sequence[str]) -> list[str]:
    """A table of :func:`run_costs` per run (no lines when no run has records), and under it a line
    naming the runs :func:`slow_runs` flags (their times measure the machine as much as the arm)."""
    rows = [(r, run_costs(r)) for r in sorted(report["runs"], key=lambda r: (arms.index(r["arm"]) if r["arm"] in arms
                                                                              else 99, r["seed"]))]
    rows = [(r, c) for r, c in rows if c.get("idle") or "publish_seconds" in c]
    if not rows:
        return []
    roles = sorted({role for _, c in rows for role in c.get("idle", {})})
    books = any("appended_tokens" in c for _, c in rows)
    speed = any("trainer_ms_per_token" in c for _, c in rows)
    probe = any("machine_before" in c or "machine_after" in c for _, c in rows)
    base_eval = any("base_eval_seconds" in c for _, c in rows)
    memory = any("trainer_peak_gb" in c for _, c in rows)
    restarts = any(c.get("role_restarts") for _, c in rows)
    fmt = lambda c, k, f: "—" if k not in c else format(c[k], f)  # noqa: E731
    head = (["run", "s per step"] + (["trainer ms per token"] if speed else []) + [f"idle {role}" for role in roles]
            + ["publish s per step", "publish MB per step"]
            + (["step-0 eval s"] if base_eval else [])
            + (["machine tok/s before / after"] if probe else [])
            + (["trainer peak GB"] if memory else [])
            + (["role restarts (steps replayed)"] if restarts else [])
            + (["appended tokens", "trained tokens", "discarded by restarts", "never trained"] if books else []))
    lines = ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, c in rows:
        idle = c.get("idle", {})
        cells = ([f"{r['arm']} s{r['seed']}", fmt(c, "seconds_per_step", ".1f")]
                 + ([fmt(c, "trainer_ms_per_token", ".1f")] if speed else [])
                 + ["—" if role not in idle else f"{idle[role]:.2f}" for role in roles]
                 + [fmt(c, "publish_seconds", ".2f"), fmt(c, "publish_megabytes", ".1f")]
                 + ([fmt(c, "base_eval_seconds", ".0f")] if base_eval else [])
                 + ([f"{fmt(c, 'machine_before', '.1f')} / {fmt(c, 'machine_after', '.1f')}"] if probe else [])
                 + ([fmt(c, "trainer_peak_gb", ".1f")] if memory else [])
                 + ([f"{c['role_restarts']} ({c['replayed_steps']})" if "role_restarts" in c else "—"] if restarts else [])
                 + ([fmt(c, "appended_tokens", ","), fmt(c, "trained_tokens", ","),
                     fmt(c, "restart_discarded_share", ".1%"), fmt(c, "untrained_share", ".1%")] if books else []))
        lines.append("| " + " | ".join(cells) + " |")
    slow = slow_runs(report)
    if slow:
        lines += ["", f"Slower machine (trainer ms per token >= {SLOW_MACHINE_FACTOR:g}x its arm's cheapest run): "
                  + "; ".join(f"{s['arm']} s{s['seed']} {s['ms_per_token']:.1f} ms against {s['arm_lowest_ms_per_token']:.1f} "
                              f"({s['factor']:.1f}x)" for s in slow)
                  + ". Their times measure the machine as much as the arm."]
    return lines


def preflight(config: str | Path, arms: dict[str, list[str] | None]) -> list[str]:
    """Problems that would make every run of a comparison fail, found before the first run starts.

    Each arm's flags are parsed against ``config`` as ``asyncrl train`` parses them, and its
    ``model.path`` is resolved (a fresh machine has not prepared SmolLM2 yet: ``asyncrl models
    prepare``). ``arms`` maps name -> flags (None: the TRL arm, which reads ``config`` as it is).

    Returns:
        one line per problem, naming the arm and what to fix; empty when every arm can start.
    """
    from asyncrl.core.config import ConfigError, load_config
    from asyncrl.models import resolve_model_path
    from asyncrl.models.cache import ModelError

    problems = []
    for name, flags in arms.items():
        try:
            cfg = load_config(["--config", str(config), *(flags or [])], environ={})
            resolve_model_path(cfg.model.path)
        except (ConfigError, ModelError) as exc:
            problems.append(f"arm {name!r}: {exc}")
    return problems


def config_digest(path: str | Path) -> str:
    """SHA-256 (hex) of the config file's bytes: runs of a changed config are never mixed in one JSON.

    Raises:
        FileNotFoundError: when ``path`` does not exist (relative paths are read from the repository).
    """
    import hashlib

    p = Path(path)
    if not p.is_absolute() and not p.exists():
        p = Path(__file__).resolve().parent.parent / p
    return hashlib.sha256(p.read_bytes()).hexdigest()


def parse_arms(names: str, custom: Sequence[str]) -> dict[str, list[str] | None]:
    """``--arms`` and ``--arm NAME=FLAGS`` -> arm name -> flags (None for ``trl`` as it is built in).

    ``--arm trl=FLAGS`` gives TRL's arm config overrides, and only ``--data.*`` ones (e.g.
    ``--data.reward chain_partial_matched``): TRL's GRPOTrainer takes its task, prompts and reward
    from the config (bench/trl_compare.py), while asyncrl's rollout, buffer and trainer knobs have
    no meaning for it, so a flag it would silently ignore is refused.

    Raises:
        ValueError: an unknown arm name, a malformed ``--arm``, or a ``trl`` flag outside ``--data.``.
    """
    defined: dict[str, list[str] | None] = {k: list(v) for k, v in ARMS.items()}
    defined["trl"] = None
    for spec in custom:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip() or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"--arm wants NAME=FLAGS with a plain name, got {spec!r}")
        tokens = shlex.split(flags)
        if name.strip() == "trl":
            foreign = [t for t in tokens if t.startswith("-") and not t.startswith("--data.")]
            if foreign:
                raise ValueError(f"the trl arm takes only --data.* overrides (TRL reads the task, prompts and reward "
                                 f"from the config; asyncrl's rollout and trainer knobs do not apply to it), "
                                 f"got {', '.join(foreign)}")
        defined[name.strip()] = tokens
    out = {}
    for n in (x.strip() for x in names.split(",") if x.strip()):
        if n not in defined:
            raise ValueError(f"unknown arm {n!r}: built in are {', '.join(defined)}; define others with --arm NAME=FLAGS")
        out[n] = defined[n]
    if not out:
        raise ValueError("--arms names no arm")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="async,sync", help="comma-separated arms, the first is the reference of the ratios")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=FLAGS", help="define an arm by its asyncrl flags")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 1..N (run.seed); data.seed stays fixed")
    ap.add_argument("--first_seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="train each run for this many steps (curves by step)")
    ap.add_argument("--minutes", type=float, default=None, help="or for this many training minutes (curves by time)")
    ap.add_argument("--eval_every", type=int, default=25, help="held-out evaluation spacing, steps")
    ap.add_argument("--num_problems", type=int, default=400)
    ap.add_argument("--config", default="configs/smollm2_arith.yaml")
    ap.add_argument("--title", default=None, help="the report's title (kept in --json; also with --replot)")
    ap.add_argument("--out_dir", type=Path, default=None, help="run directories (default: a temporary folder)")
    ap.add_argument("--json", type=Path, required=True, help="results; runs already in it are skipped")
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--replot", action="store_true", help="only recompute statistics and the figure from --json")
    ap.add_argument("--dry_run", action="store_true", help="print the runs still to do and exit")
    ap.add_argument("--trl_save_every", type=float, default=90.0, metavar="SECONDS",
                    help="the trl arm's snapshot spacing in seconds of training; each snapshot is evaluated after "
                         "training (evaluation time excluded). Default 90 (the main job's ~10 s steps); for a task "
                         "with minutes-long steps a spacing near the asyncrl arms' evaluation spacing saves hours")
    ap.add_argument("--keep_run_files", action="store_true",
                    help="keep each run's checkpoints and every weight version (default: keep the newest weights only)")
    ap.add_argument("--markdown", action="store_true", help="with --replot: print the tables for docs/results.md")
    ap.add_argument("--machine_probe", action="store_true",
                    help="measure the machine's speed (bench/rollout_bench.py's plain decode loop, 1-2 min) before "
                         "and after every run and keep it in the run's record (machine_before, machine_after)")
    ap.add_argument("--reread", type=Path, default=None, metavar="OUT_DIR",
                    help="with --replot: refresh each recorded run from its run directory OUT_DIR/<arm>-s<seed> "
                         "(records a newer harness reads, e.g. idle ratios and publish costs)")
    args = ap.parse_args(argv)
    report = json.loads(args.json.read_text()) if args.json.exists() else None
    if report is not None and args.title:
        report["title"] = args.title
    if args.replot:
        if report is None:
            ap.error(f"--replot: {args.json} does not exist")
        if args.reread is not None:
            print(f"multiseed: refreshed {reread(report, args.reread)} runs from {args.reread}", file=sys.stderr)
        compute_stats(report)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        if args.plot:
            plot(report, args.plot)
        print(markdown(report) if args.markdown else json.dumps(report["stats"], indent=1))
        return 0
    if (args.steps is None) == (args.minutes is None):
        ap.error("give exactly one of --steps and --minutes")
    try:
        arms = parse_arms(args.arms, args.arm)
    except ValueError as exc:
        ap.error(str(exc))
    if "trl" in arms and args.steps is not None:
        ap.error("the trl arm runs for a time, not a step count: use --minutes")
    if not args.trl_save_every > 0:
        ap.error(f"--trl_save_every must be > 0 seconds, got {args.trl_save_every}")
    settings = {"config": args.config, "steps": args.steps, "minutes": args.minutes, "eval_every": args.eval_every,
                "num_problems": args.num_problems, "config_sha256": config_digest(args.config)}
    if report is None:
        report = {"title": args.title, "settings": settings, "arms": list(arms), "arm_flags": {}, "runs": []}
    elif report["settings"].get("config_sha256") != settings["config_sha256"] and \
            {k: v for k, v in report["settings"].items() if k != "config_sha256"} == \
            {k: v for k, v in settings.items() if k != "config_sha256"}:
        ap.error(f"{args.json} holds runs of another version of {args.config} (its content changed since: an "
                 "arm without flags, such as the shipped default, would now mean something else); use another --json")
    elif report["settings"] != settings:
        ap.error(f"{args.json} holds runs with other settings ({report['settings']}); use another --json")
    for a in arms:
        if a not in report["arms"]:
            report["arms"].append(a)
        prev = report["arm_flags"].get(a)
        if a in report["arm_flags"] and (prev or []) != (arms[a] or []):
            ap.error(f"arm {a!r} is recorded with flags {prev}, not {arms[a]}: give the new arm another name")
        report["arm_flags"][a] = arms[a]
    done = {(r["arm"], r["seed"]) for r in report["runs"]}
    todo = plan(list(arms), range(args.first_seed, args.first_seed + args.seeds), done)
    if args.dry_run:
        print(json.dumps({"todo": todo, "recorded": sorted(done)}))
        return 0
    problems = preflight(args.config, {a: arms[a] for a in dict.fromkeys(arm for arm, _ in todo)})
    if problems:
        ap.error("no run started:\n  " + "\n  ".join(problems))
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="multiseed_"))
    run_settings = {**settings, "keep_run_files": args.keep_run_files, "save_every": args.trl_save_every}
    out_dir.mkdir(parents=True, exist_ok=True)
    for arm, seed in todo:
        print(f"multiseed: {arm} seed {seed} ...", flush=True)
        probes = {"machine_before": machine_probe()} if args.machine_probe else {}
        if probes:
            print(f"multiseed: machine before: {probes['machine_before']}", flush=True)
        t0 = time.perf_counter()
        if arm == "trl":
            rec = run_trl_seed(out_dir, seed, {**run_settings, "overrides": arms[arm] or []})
        else:
            rec = run_asyncrl(out_dir, arm, seed, arms[arm], run_settings)
        real_seconds = time.perf_counter() - t0
        if probes:
            probes["machine_after"] = machine_probe()
            print(f"multiseed: machine after: {probes['machine_after']}", flush=True)
        rec.update({**probes, "arm": arm, "seed": seed, "real_seconds": real_seconds,
                    "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **_environment()})
        report["runs"].append(rec)
        compute_stats(report)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"multiseed: {arm} seed {seed}: " + ", ".join(f"step {p['step']} {p['accuracy']:.3f}" for p in rec["curve"]),
              flush=True)
    compute_stats(report)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)
    print(json.dumps(report["stats"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
