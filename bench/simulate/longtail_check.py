"""Predicted against measured for the long-tail task (docs/results.md section H, docs/scaling.md).

``configs/smollm2_longtail.yaml`` (the ``chain`` task: single-turn answers whose length follows a
heavy-tailed number of steps, up to 512 tokens) was run on this machine in a synchronous arm and
asynchronous ones. Each run is simulated with **its own response lengths**: the lengths of every
group it trained, by the policy version of the group's oldest token, read from its ``trace/``
timelines (:func:`groups_from_trace`) and kept in ``docs/bench/longtail_lengths.json``; a group
keeps its samples together (in this task a group's lengths follow its problem). A run whose
directory is gone is simulated with another run's groups, scaled to its own mean trained
response length (:data:`DERIVED_LENGTHS`). Its knobs are the arm's (:data:`LT_ARMS`), the component
rates the machine's (:mod:`bench.simulate.calibration`); what is compared is the systems model:
seconds per train step, each role's idle ratio, restarted samples, and the synchronous /
asynchronous step-time ratio.

    python -m bench.simulate longtail                          # the table (seconds)
    python -m bench.simulate longtail --extract keep-s1=RUN_DIR   # add a run's lengths and records

Adding a run: ``--extract KEY=RUN_DIR`` (its groups and, from its metrics, its measured record)
and one line in :data:`LT_RUNS`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import statistics
from pathlib import Path
from typing import Any

from .calibration import CPU_LOAD_S, cpu_engine, cpu_trainer
from .lengths import RecordedGroupLengths
from .model import SimConfig, simulate, train_batch_groups
from .validation import relative_error

__all__ = ["LT_PROMPT_TOKENS", "LT_ARMS", "LT_RUNS", "DERIVED_LENGTHS", "DERIVED_DECODE", "LENGTHS_FILE", "longtail_config",
           "groups_from_trace", "decode_slowdown", "run_record", "measured_summary", "longtail_validation",
           "longtail_forecast", "extract_runs", "format_longtail_validation", "format_longtail_forecast"]

_BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"
#: Each run's trained groups' lengths and, for runs extracted from their directory, their records.
LENGTHS_FILE = _BENCH / "longtail_lengths.json"
#: The long-tail prompt: SmolLM2's chat template around the config's system prompt, two few-shot
#: turns, the problem and the "{first_step} =" prefill. 217 tokens = the mean over the synchronous
#: seed-1 run's 18 steps of (train/processed_tokens - train/response_tokens) / 6 groups (its trainer
#: processes each group's prompt once); 170-262 by step, as the problems' lengths vary.
LT_PROMPT_TOKENS = 217
#: Each arm's knobs (docs/results.md section H): (R, p, M, eta, stale_policy, layout). Layout
#: ``shared``: both roles on both cores, alternating (synchronous); ``split``: rollout on core 0,
#: trainer on core 1; ``follow``: ``split`` but the rollout server takes the trainer's core while
#: the trainer waits for a batch (``resources.core_sharing: follow``).
LT_ARMS = {
    "sync": (6, 1.0, 512, 0, "restart", "shared"),
    "async": (8, 0.75, 64, 2, "restart", "split"),
    "keep": (8, 0.75, 64, 2, "keep", "split"),
    "keepfollow": (8, 0.75, 64, 2, "keep", "follow"),
    "eta4": (8, 0.75, 64, 4, "restart", "split"),
}
#: The runs predicted, ``<arm>-s<seed>`` -> where its measured record is: (a multiseed JSON in
#: docs/bench, the arm's name there, the seed), or None for the record ``--extract`` stored with
#: the run's lengths in :data:`LENGTHS_FILE`.
LT_RUNS: dict[str, tuple[str, str, int] | None] = {
    "sync-s1": ("multiseed_longtail.json", "sync", 1),
    "async-s1": ("longtail_check_partial.json", "partial", 1),
    "keep-s1": ("multiseed_longtail.json", "keep", 1),
    "sync-s2": None,
    "async-s2": None,
    "sync-s3": None,
    "async-s3": None,
    "eta4-s1": None,
    "eta4-s2": None,
    "eta4-s3": None,
}
#: Runs whose directory (and ``trace/``) is gone -> the run whose groups stand in for theirs. Same
#: task and seed, so the same problems in the same order; each length is scaled by the ratio of the
#: two runs' mean ``train/response_tokens`` per step. An approximation: the policies differ, and
#: under ``stale_policy: restart`` the trained lengths are biased short (long answers are restarted).
DERIVED_LENGTHS = {"async-s1": "sync-s1"}
#: Runs without a trace -> the run whose decode slowdown (:func:`decode_slowdown`) stands in for
#: theirs: the same layout (one core, split), budget and pause mode. Without it, the lengths' run's.
DERIVED_DECODE = {"async-s1": "keep-s1"}

_STEP_FIELDS = ("time/step_seconds", "time/wait_batch_seconds", "time/publish_seconds", "train/response_tokens",
                "train/samples")


def _arm(key: str) -> str:
    return key.rsplit("-s", 1)[0]


def _seed(key: str) -> int:
    return int(key.rsplit("-s", 1)[1])


def longtail_config(arm: str, lengths: RecordedGroupLengths, steps: int, seed: int = 0,
                    trainer_tokens_per_second: float | None = None, prefill_scale: float = 1.0,
                    decode_scale: float = 1.0) -> SimConfig:
    """The long-tail job of configs/smollm2_longtail.yaml for ``arm`` (:data:`LT_ARMS`).

    Component rates are the main job's (:func:`~bench.simulate.calibration.cpu_engine`,
    :func:`~bench.simulate.calibration.cpu_trainer`: one thread per role when split, two when
    shared; with ``follow`` the engine has two threads while the trainer waits) with the two
    settings that differ here, as for the calculator agent: the trainer shares each group's prompt
    and the engine prefills a group's prompt once (its prompt cache). ``pause_mode: in_place``,
    ``max_inflight_requests`` 32, n = 8, ``max_response_len`` 512. ``trainer_tokens_per_second``,
    when given, replaces the trainer's rate and folds the optimizer step into it (a run's own
    trainer); ``prefill_scale`` divides the derived prefill cost; ``decode_scale`` multiplies the
    decode step time (alpha and beta of eq. 1: a run's own decode rate, :func:`decode_slowdown`).

    Raises:
        KeyError: an unknown arm.
        ValueError: ``prefill_scale`` or ``decode_scale`` <= 0.
    """
    if not (prefill_scale > 0 and decode_scale > 0):
        raise ValueError(f"prefill_scale and decode_scale must be > 0, got {prefill_scale}, {decode_scale}")
    R, p, M, eta, policy, layout = LT_ARMS[arm]
    threads = 2 if layout == "shared" else 1

    def engine(t: int):
        e = cpu_engine(t)
        return dataclasses.replace(e, shared_prefix=True, prefill_per_token=e.prefill_per_token / prefill_scale,
                                   alpha=e.alpha * decode_scale, beta=e.beta * decode_scale)

    trainer = dataclasses.replace(cpu_trainer(threads), share_prompts=True)
    if trainer_tokens_per_second is not None:
        trainer = dataclasses.replace(trainer, tokens_per_second=trainer_tokens_per_second, optim=0.0,
                                      name=f"{trainer.name}, the run's own rate")
    return SimConfig(name=f"long tail, {arm}", rollout_batch_size=R, partial_percent=p, n_samples=8, max_budget=M,
                     max_response_len=512, max_staleness=eta, stale_policy=policy, prompt_tokens=LT_PROMPT_TOKENS,
                     lengths=lengths, servers=1, engine=engine(threads), max_inflight=32, pause_mode="in_place",
                     load=CPU_LOAD_S, trainer=trainer, steps=steps, warmup_steps=1, seed=seed,
                     engine_wide=engine(2) if layout == "follow" else None)


def groups_from_trace(run_dir: str | os.PathLike) -> dict[int, list[list[int]]]:
    """The response lengths of every group a run trained, by version, from its ``trace/`` timelines.

    Returns:
        version -> list of groups, each the list of its samples' response tokens (sample order);
        a group's version is the oldest token version (``minv``) among its samples.

    Raises:
        FileNotFoundError: no ``trace/*.jsonl`` in ``run_dir``.
        ValueError: no committed group.
    """
    files = sorted(glob.glob(os.path.join(os.fspath(run_dir), "trace", "*.jsonl")))
    if not files:
        raise FileNotFoundError(f"no trace/*.jsonl in {run_dir}: run with the sample timeline on (docs/buffer.md)")
    out: dict[int, list[list[int]]] = {}
    for path in files:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("kind") != "group" or rec.get("how") != "committed" or not rec.get("samples"):
                    continue
                samples = sorted(rec["samples"], key=lambda s: s.get("i", 0))
                v = min(int(s.get("minv", 0)) for s in samples)
                out.setdefault(max(0, v), []).append([max(1, int(s["tokens"])) for s in samples])
    if not out:
        raise ValueError(f"{run_dir}: no committed group in trace/")
    return out


_EVENT = re.compile(r"^(gen|park|complete|turn|restart)\s+(\d+)\b(?:.*?\blen=(\d+))?")


def _segments(run_dir: str | os.PathLike) -> list[tuple[float, float, int]]:
    """Every decoded segment of the committed samples: (first flush, end, tokens), seconds and tokens."""
    out = []
    for path in sorted(glob.glob(os.path.join(os.fspath(run_dir), "trace", "*.jsonl"))):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("kind") != "group" or rec.get("how") != "committed":
                    continue
                for smp in rec.get("samples", []):
                    start = None
                    for ev in smp.get("tl", "").splitlines():
                        m = _EVENT.match(ev)
                        if m is None:
                            continue
                        kind, t, n = m.group(1), int(m.group(2)) / 1000.0, int(m.group(3) or 0)
                        if kind == "gen" and start is None:
                            start = (t, n)
                        elif kind == "restart":
                            start = None
                        elif kind != "gen" and start is not None:
                            if n > start[1] and t > start[0]:
                                out.append((start[0], t, n - start[1]))
                            start = None
    return out


def decode_slowdown(run_dir: str | os.PathLike, threads: int, pause_gap: float = 120.0) -> float:
    """How much slower the run's engine decoded than :func:`~bench.simulate.calibration.cpu_engine` says.

    From the ``trace/`` timelines: every segment of a committed sample runs from its first tokens
    reaching the buffer (``gen``) to its park or completion; at each moment the engine's rows are
    the segments open then. The model's engine (``threads`` threads, eq. 1 without context) would
    generate ``dt / t_step(rows)`` tokens per row in each interval; the result is the sum of those
    over every segment divided by the tokens the segments hold (> 1: the run decoded slower).
    Stretches of over ``pause_gap`` seconds in which no segment starts or ends (the evaluation
    pauses every role for minutes) are left out. An approximation: the tokens of a segment before
    its first flush (``buffer.flush_tokens``) are counted inside it, and segments of restarted
    attempts are not in the trace.

    Raises:
        FileNotFoundError: no trace; ValueError: no segment.
    """
    if not glob.glob(os.path.join(os.fspath(run_dir), "trace", "*.jsonl")):
        raise FileNotFoundError(f"no trace/*.jsonl in {run_dir}")
    segs = _segments(run_dir)
    if not segs:
        raise ValueError(f"{run_dir}: no decoded segment in trace/")
    eng = cpu_engine(threads)
    points = sorted({t for a, b, _ in segs for t in (a, b)})
    delta = [0] * (len(points) + 1)
    index = {t: i for i, t in enumerate(points)}
    for a, b, _ in segs:
        delta[index[a]] += 1
        delta[index[b]] -= 1
    rate, rows = [], 0  # tokens per second per row in [points[i], points[i + 1])
    for i in range(len(points) - 1):
        rows += delta[i]
        gap = points[i + 1] - points[i] > pause_gap
        rate.append(0.0 if gap or rows == 0 else 1.0 / eng.step_seconds(rows, 0.0))
    cum = [0.0]
    for i, r in enumerate(rate):
        cum.append(cum[-1] + r * (points[i + 1] - points[i]))
    model = sum(cum[index[b]] - cum[index[a]] for a, b, _ in segs)
    return model / sum(n for _, _, n in segs)


def run_record(run_dir: str | os.PathLike) -> dict[str, Any]:
    """A run's measured record from its metrics, in the shape of ``bench/multiseed.py``'s ``read_run``.

    Returns:
        ``{"steps": [{"step", <time/step_seconds, time/wait_batch_seconds, time/publish_seconds,
        train/response_tokens, train/samples>}], "final_step", "idle": {role: mean of the
        controller's idle_ratio/<role> records (the trainer's own when the controller has none)},
        "books": {"buffer/restarts": last value}}``.

    Raises:
        FileNotFoundError: no ``metrics-controller.jsonl`` or ``metrics-trainer.jsonl``.
    """
    run_dir = Path(run_dir)
    idle: dict[str, list[float]] = {}
    books: dict[str, float] = {}
    for line in (run_dir / "metrics-controller.jsonl").read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        for k, v in rec.items():
            if k.startswith("idle_ratio/") and isinstance(v, (int, float)):
                idle.setdefault(k.split("/", 1)[1], []).append(float(v))
        if "buffer/restarts" in rec:
            books["buffer/restarts"] = rec["buffer/restarts"]
    steps, own_idle = [], []
    for line in (run_dir / "metrics-trainer.jsonl").read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "step" not in rec or "reward/mean" not in rec:
            continue
        steps.append({"step": rec["step"], **{k: rec[k] for k in _STEP_FIELDS if k in rec}})
        if "idle_ratio/trainer" in rec:
            own_idle.append(float(rec["idle_ratio/trainer"]))
    if "trainer" not in idle and own_idle:
        idle["trainer"] = own_idle
    return {"steps": steps, "final_step": steps[-1]["step"] if steps else 0, "books": books,
            "idle": {role: statistics.fmean(v) for role, v in sorted(idle.items())}}


def measured_summary(key: str, record: dict[str, Any]) -> dict[str, Any]:
    """What a run measured, from its record (:func:`run_record` or a multiseed JSON's run).

    Returns:
        ``key``, ``arm``, ``steps`` (the last step), ``seconds_per_step`` (mean of
        ``time/step_seconds`` from step 2 on: step 1 holds the start-up), ``rollout_idle`` and
        ``trainer_idle`` (the controller's ratios over the run), ``restarted_samples`` (the
        buffer's count), ``response_tokens`` (mean ``train/response_tokens`` per step) and
        ``trainer_tokens_per_second`` (tokens processed, responses plus each group's prompt, per
        second of step time outside ``wait_batch`` and the publish).

    Raises:
        KeyError: an unknown arm or a record without the fields; ValueError: no step after step 1.
    """
    arm = _arm(key)
    R, p = LT_ARMS[arm][:2]
    later = [s for s in record["steps"] if s["step"] >= 2 and "time/step_seconds" in s]
    if not later:
        raise ValueError(f"{key}: no step after step 1")
    B = train_batch_groups(p, R)
    busy = sum(s["time/step_seconds"] - s["time/wait_batch_seconds"] - s["time/publish_seconds"] for s in later)
    tokens = sum(s["train/response_tokens"] + B * LT_PROMPT_TOKENS for s in later)
    return {"key": key, "arm": arm, "steps": record["final_step"],
            "seconds_per_step": statistics.fmean(s["time/step_seconds"] for s in later),
            "rollout_idle": record["idle"]["rollout-0"], "trainer_idle": record["idle"]["trainer"],
            "restarted_samples": int(record.get("books", {}).get("buffer/restarts", 0)),
            "response_tokens": statistics.fmean(s["train/response_tokens"] for s in record["steps"]),
            "trainer_tokens_per_second": tokens / busy}


def _record(key: str, stored: dict[str, Any], bench_dir: Path) -> dict[str, Any] | None:
    where = LT_RUNS[key]
    if where is None:
        return stored.get(key, {}).get("run")
    path = bench_dir / where[0]
    if not path.exists():
        return None
    for r in json.loads(path.read_text())["runs"]:
        if r["arm"] == where[1] and r["seed"] == where[2]:
            return r
    return None


def _lengths(key: str, stored: dict[str, Any], measured: dict[str, dict[str, Any]]) -> RecordedGroupLengths | None:
    src = DERIVED_LENGTHS.get(key, key)
    if src not in stored or (src != key and src not in measured):
        return None
    by_version = {int(v): [tuple(g) for g, n in gs for _ in range(int(n))] for v, gs in stored[src]["groups"].items()}
    scale = 1.0 if src == key else measured[key]["response_tokens"] / measured[src]["response_tokens"]
    return RecordedGroupLengths(by_version, scale=scale, source=src)


_KINDS = ("predicted", "predicted_own_trainer", "predicted_own_rates")


def longtail_validation(seed: int = 0, bench_dir: str | os.PathLike | None = None,
                        prefill_scale: float = 1.0, seeds: int = 20) -> dict[str, Any]:
    """Simulate each run of :data:`LT_RUNS` with its own lengths and pair prediction with measurement.

    Runs without a record or lengths in ``bench_dir`` are left out. Each prediction is the mean
    over ``seeds`` simulations (seeds ``seed`` to ``seed + seeds - 1``: a run of 12-18 steps
    trains ~100 of the recorded groups, drawn at random, so one simulation varies by up to a
    third). ``prefill_scale``: see :func:`longtail_config`.

    Returns:
        ``{"runs": [...], "ratios": [...]}``: per run ``key``, ``arm``, ``steps``, ``lengths`` (the
        run whose groups were used and their scale), ``decode_slowdown`` (the factor used for the
        own-rates prediction, at this arm's thread count; None: not known) and ``decode_run`` (the
        run it was measured on: :data:`DERIVED_DECODE`, else the lengths' run), and
        for each of ``seconds_per_step``, ``rollout_idle``, ``trainer_idle``, ``restarted_samples``
        the ``measured`` value and, with an ``error_<kind>`` and for seconds per step a ``range_<kind>``
        (the seeds' lowest and highest), ``predicted`` (the machine's rates),
        ``predicted_own_trainer`` (the run's own trainer rate) and ``predicted_own_rates`` (its own
        trainer and decode rates; None without a decode slowdown); per asynchronous arm the ratio of
        the synchronous arm's mean seconds per step to its own (> 1: asynchronous steps are faster),
        measured and by each kind of prediction, paired by seed: over the arm's runs whose seed has
        a synchronous run, against those synchronous runs (an arm with none is left out).

    Raises:
        OSError, ValueError, KeyError: a record cannot be read.
        ValueError: ``seeds`` < 1.
    """
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    bench_dir = Path(bench_dir) if bench_dir is not None else _BENCH
    path = bench_dir / LENGTHS_FILE.name
    stored = json.loads(path.read_text()) if path.exists() else {}
    measured = {}
    for key in LT_RUNS:
        rec = _record(key, stored, bench_dir)
        if rec is not None:
            measured[key] = measured_summary(key, rec)
    rows = []
    for key, m in measured.items():
        lengths = _lengths(key, stored, measured)
        if lengths is None:
            continue
        threads = 2 if LT_ARMS[m["arm"]][5] == "shared" else 1
        dsrc = DERIVED_DECODE.get(key, lengths.source)
        if dsrc not in stored:
            dsrc = lengths.source
        slow = stored[dsrc].get("decode_slowdown", {}).get(str(threads))
        rate = m["trainer_tokens_per_second"]
        results = [[simulate(longtail_config(m["arm"], lengths, steps=m["steps"], seed=k, trainer_tokens_per_second=t,
                                             prefill_scale=prefill_scale, decode_scale=d))
                    for k in range(seed, seed + seeds)]
                   for t, d in ((None, 1.0), (rate, 1.0), (rate, slow or 1.0))]
        row = {"key": key, "arm": m["arm"], "steps": m["steps"], "lengths": {"run": lengths.source, "scale": lengths.scale},
               "trainer_tokens_per_second": rate, "decode_slowdown": slow, "decode_run": dsrc}
        for q in ("seconds_per_step", "rollout_idle", "trainer_idle", "restarted_samples"):
            row[q] = {"measured": m[q]}
            for kind, rs in zip(_KINDS, results):
                vals = [r.buffer["restarted_samples"] if q == "restarted_samples" else getattr(r, q) for r in rs]
                none = kind == "predicted_own_rates" and slow is None
                val = None if none else statistics.fmean(vals)
                row[q][kind] = val
                row[q]["error" + kind[9:]] = None if val is None else relative_error(val, m[q])
                if q == "seconds_per_step":
                    row[q]["range" + kind[9:]] = None if none else (min(vals), max(vals))
        rows.append(row)
    ratios = []
    sync_by_seed = {_seed(r["key"]): r for r in rows if r["arm"] == "sync"}
    if sync_by_seed:
        def ratio(runs: list[dict[str, Any]], sync: list[dict[str, Any]], kind: str) -> float | None:
            vals = [[r["seconds_per_step"][kind] for r in rs] for rs in (sync, runs)]
            if any(v is None for vs in vals for v in vs):
                return None
            return statistics.fmean(vals[0]) / statistics.fmean(vals[1])
        for arm in dict.fromkeys(r["arm"] for r in rows if r["arm"] != "sync"):
            # paired by seed: an arm's runs against the synchronous runs of the same seeds
            runs = [r for r in rows if r["arm"] == arm and _seed(r["key"]) in sync_by_seed]
            if not runs:
                continue
            sync = [sync_by_seed[_seed(r["key"])] for r in runs]
            q = {"arm": arm, "runs": len(runs), "sync_runs": len(sync), "measured": ratio(runs, sync, "measured")}
            for kind in _KINDS:
                q[kind] = ratio(runs, sync, kind)
                q["error" + kind[9:]] = None if q[kind] is None else relative_error(q[kind], q["measured"])
            ratios.append(q)
    return {"runs": rows, "ratios": ratios}


def longtail_forecast(res: dict[str, Any], lengths_run: str = "sync-s1", steps: int = 15, seed: int = 0,
                      seeds: int = 20, bench_dir: str | os.PathLike | None = None,
                      prefill_scale: float = 1.0) -> dict[str, Any]:
    """Every arm of :data:`LT_ARMS` on the same lengths: what the model attributes the step times to.

    Each arm is simulated for ``steps`` steps (mean over ``seeds`` seeds) with ``lengths_run``'s
    recorded groups, unscaled, under the three kinds of rates of :func:`longtail_validation`
    (``res``, its result): the machine's; the measured runs' own trainer rates (mean over the runs
    with the arm's thread count: two for ``shared``, one otherwise); and those with the decode
    slowdowns measured on those runs' own traces (mean; none: that kind is None). ``prefill_scale``:
    see :func:`longtail_config`.

    Returns:
        ``{"lengths": lengths_run, "steps", "arms": [{"arm", <kind>: seconds per step or None,
        "ratio_<kind>": the sync arm's seconds per step / the arm's, or None}]}`` with the kinds
        ``predicted``, ``predicted_own_trainer``, ``predicted_own_rates``; a kind is None when no
        measured run gives its rate.

    Raises:
        KeyError: ``lengths_run`` is not in the lengths file; ValueError: ``seeds`` < 1.
    """
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    bench_dir = Path(bench_dir) if bench_dir is not None else _BENCH
    stored = json.loads((bench_dir / LENGTHS_FILE.name).read_text())
    src = stored[lengths_run]
    lengths = RecordedGroupLengths({int(v): [tuple(g) for g, n in gs for _ in range(int(n))]
                                    for v, gs in src["groups"].items()}, source=lengths_run)
    arms = []
    for arm, knobs in LT_ARMS.items():
        threads = 2 if knobs[5] == "shared" else 1
        same = [r for r in res["runs"] if (2 if LT_ARMS[r["arm"]][5] == "shared" else 1) == threads]
        rate = statistics.fmean(r["trainer_tokens_per_second"] for r in same) if same else None
        slows = [r["decode_slowdown"] for r in same if r.get("decode_run") == r["key"] and r["decode_slowdown"]]
        slow = statistics.fmean(slows) if slows else None
        row: dict[str, Any] = {"arm": arm}
        for kind, ok, t, d in (("predicted", True, None, 1.0), ("predicted_own_trainer", rate is not None, rate, 1.0),
                               ("predicted_own_rates", rate is not None and slow is not None, rate, slow)):
            row[kind] = statistics.fmean(
                simulate(longtail_config(arm, lengths, steps=steps, seed=k, trainer_tokens_per_second=t,
                                         prefill_scale=prefill_scale, decode_scale=d or 1.0)).seconds_per_step
                for k in range(seed, seed + seeds)) if ok else None
        arms.append(row)
    sync = next(r for r in arms if r["arm"] == "sync")
    for r in arms:
        for kind in _KINDS:
            r["ratio" + kind[9:]] = None if r[kind] is None or sync[kind] is None else sync[kind] / r[kind]
    return {"lengths": lengths_run, "steps": steps, "arms": arms}


def format_longtail_forecast(fc: dict[str, Any]) -> str:
    """The markdown table of :func:`longtail_forecast` (docs/scaling.md)."""
    lines = [f"| arm, on {fc['lengths']}'s lengths ({fc['steps']} steps) | s/step (sync ÷ arm): the machine's rates | "
             "the runs' trainer rates | their trainer and decode rates |", "|---|---:|---:|---:|"]
    for r in fc["arms"]:
        cells = [f"{r[k]:.1f} ({r['ratio' + k[9:]]:.2f})" if r[k] is not None else "—" for k in _KINDS]
        lines.append(f"| {r['arm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def extract_runs(pairs: list[str], path: str | os.PathLike | None = None) -> list[str]:
    """Add ``KEY=RUN_DIR`` runs to the JSON: groups (:func:`groups_from_trace`), record
    (:func:`run_record`) and decode slowdown against the model's one- and two-thread engine
    (:func:`decode_slowdown`).

    Raises:
        ValueError: a pair without ``=`` or a key whose arm is not in :data:`LT_ARMS`;
        FileNotFoundError: a run without ``trace/`` or metrics.
    """
    path = Path(path) if path is not None else LENGTHS_FILE
    data = json.loads(path.read_text()) if path.exists() else {}
    done = []
    for pair in pairs:
        key, sep, run_dir = pair.partition("=")
        if not sep or not key or not run_dir:
            raise ValueError(f"--extract takes KEY=RUN_DIR (e.g. keep-s1=runs/keep-s1), got {pair!r}")
        if _arm(key) not in LT_ARMS:
            raise ValueError(f"{key}: the arm {_arm(key)!r} is not one of {sorted(LT_ARMS)} (KEY is <arm>-s<seed>)")
        groups = groups_from_trace(run_dir)
        counted: dict[str, list] = {}
        for v in sorted(groups):
            counts: dict[tuple[int, ...], int] = {}
            for g in groups[v]:
                counts[tuple(g)] = counts.get(tuple(g), 0) + 1
            counted[str(v)] = [[list(g), n] for g, n in counts.items()]
        data[key] = {"groups": counted, "run": run_record(run_dir),
                     "decode_slowdown": {str(t): round(decode_slowdown(run_dir, t), 4) for t in (1, 2)}}
        done.append(key)
    path.write_text(json.dumps(dict(sorted(data.items())), separators=(",", ":")) + "\n")
    return done


def _cell(x: dict[str, Any], kind: str, fmt: str) -> str:
    v = x[kind]
    return "—" if v is None else format(v, fmt)


def format_longtail_validation(res: dict[str, Any]) -> str:
    """The markdown tables of docs/scaling.md's long-tail section."""
    lines = ["| run | steps | lengths of | s/step measured | predicted (error; seeds' range) | with the run's trainer rate | "
             "with its trainer and decode rates | rollout idle: measured / predicted / trainer rate / both | "
             "trainer idle: same | restarted samples: same |",
             "|---|---:|---|---:|---:|---:|---:|---|---|---|"]
    for r in res["runs"]:
        s = r["seconds_per_step"]
        src = r["lengths"]["run"] + ("" if r["lengths"]["run"] == r["key"] else f" × {r['lengths']['scale']:.2f}")
        of = "" if r.get("decode_run", r["key"]) == r["key"] else f" of {r['decode_run']}"
        slow = "" if r["decode_slowdown"] is None else f" (decode ×{r['decode_slowdown']:.2f}{of})"
        cells = [f"{s['measured']:.1f}"] + [
            f"{s[k]:.1f} ({s['error' + k[9:]]}; {s['range' + k[9:]][0]:.0f}–{s['range' + k[9:]][1]:.0f})"
            if s[k] is not None else "—" for k in _KINDS]
        cells[-1] += slow
        for q, fmt in (("rollout_idle", ".2f"), ("trainer_idle", ".2f"), ("restarted_samples", ".0f")):
            cells.append(" / ".join(_cell(r[q], k, fmt) for k in ("measured", *_KINDS)))
        lines.append(f"| {r['key']} | {r['steps']} | {src} | " + " | ".join(cells) + " |")
    lines += ["", "| arm | runs (sync runs) | sync s/step ÷ arm s/step: measured | predicted (error) | "
              "with the runs' trainer rates (error) | with their trainer and decode rates (error) |",
              "|---|---|---:|---:|---:|---:|"]
    for q in res["ratios"]:
        cells = [f"{_cell(q, k, '.2f')} ({q['error' + k[9:]]})" if q[k] is not None else "—" for k in _KINDS]
        lines.append(f"| {q['arm']} | {q['runs']} ({q['sync_runs']}) | {q['measured']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
