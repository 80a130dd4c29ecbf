"""The training loop: named, timed phases around the :class:`trainer.trainer.Trainer` API.

    wait_batch -> forward_backward (per mini-batch) -> optim_step -> publish_weights (every
    weight_sync.interval steps) -> checkpoint (every checkpoint_interval steps)

Rank 0 asks the batch source for the next batch and broadcasts it (with a stop flag) to the
other ranks; every rank runs the same phases. The learning-rate schedule lives here
(:func:`trainer.engine.lr_at` of the optimizer step). Each step's metrics (losses, ratios,
advantage and reward stats, staleness histogram, tokens, grad norm, lr, the seconds of each
phase, and on Linux the process's resident memory after the publish and its peak within the
step, ``memory_resident_gb`` and ``memory_peak_resident_gb``) go to a callback, to
``<run_dir>/metrics/trainer.jsonl`` and to Prometheus (:class:`asyncrl.metrics.TrainerMetrics`)
on rank 0.

Batch sources (rank 0 only) satisfy :class:`trainer.batch.BatchSource`:
``next_batch(step)`` (plain or async; ``step`` is the 1-based number of the step about to be
trained) returns a list of prompt groups, an object with ``.groups`` (``asyncrl.core.types.Batch``),
or None when exhausted; ``acknowledge(step)`` after the step; optional ``commit(step)`` after
a checkpoint and ``state_dict()`` (dataset cursor, stored in checkpoints). The sources are in
:mod:`trainer.sources` (``ListBatchSource`` and ``FileBatchSource`` also import from here).

SIGTERM / SIGINT (:func:`install_signal_handlers`): the flag is read between steps; the
current step is finished, a checkpoint is written, and the loop returns normally (exit 0).
Determinism: micro-batch order depends only on the batch; seeds come from ``run.seed``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.memory import reset_peak_resident, resident_memory
from trainer.sources import FileBatchSource, ListBatchSource

__all__ = ["PhaseTimer", "LoopResult", "train_loop", "install_signal_handlers", "ListBatchSource", "FileBatchSource"]


class PhaseTimer:
    """Seconds spent in each named phase of the current step, not counting evaluation stops.

    While the controller runs the held-out evaluation it stops every role with SIGSTOP; a wall
    clock keeps running meanwhile, so a phase that spans the stop would read the whole
    evaluation (a 40-second forward and backward read 178 s). The controller records each stop
    as a ``time.monotonic()`` interval in the run's ``clock.json`` before it lets the roles
    continue (:class:`asyncrl.metrics.tracking.RunClock`); a phase's seconds are its
    ``time.perf_counter()`` duration minus its overlap with those intervals.

    Args:
        metrics: an :class:`asyncrl.metrics.TrainerMetrics` (rank 0) or None: the four
            phases of docs/architecture.md#training-step are also observed into its step-duration histogram (the same
            corrected seconds) and ``wait_batch`` marks the trainer idle.
        clock: the run's :class:`asyncrl.metrics.tracking.RunClock` or None (no correction).
    """

    def __init__(self, metrics: Any = None, clock: Any = None):
        self.seconds: dict[str, float] = {}
        self.stopped_seconds = 0.0
        self._metrics = metrics
        self._clock = clock

    @contextmanager
    def phase(self, name: str):
        """Time a phase; the block's stopped time (evaluation pauses) is left out."""
        prom = self._metrics is not None and name in ("wait_batch", "forward_backward", "optim_step", "publish_weights")
        if prom and name == "wait_batch":
            self._metrics.idle.set_idle(True)
        start, start_mono = time.perf_counter(), time.monotonic()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            stopped = self._clock.paused_between(start_mono, time.monotonic()) if self._clock is not None else 0.0
            stopped = min(max(0.0, stopped), elapsed)
            self.stopped_seconds += stopped
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - stopped
            if prom:
                self._metrics.step_duration.labels(name).observe(elapsed - stopped)
                if name == "wait_batch":
                    self._metrics.idle.set_idle(False)


@dataclass
class LoopResult:
    """How the loop ended: steps done, why it stopped, and every step's metrics (rank 0)."""

    steps: int
    reason: str
    history: list[dict[str, float]] = field(default_factory=list)


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop`` (the loop finishes its step, checkpoints, returns)."""

    def handler(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _groups_of(batch: Any) -> list[Any] | None:
    if batch is None:
        return None
    groups = getattr(batch, "groups", batch)
    return list(groups)


def train_loop(
    trainer: Any,
    source: Any,
    *,
    stop: threading.Event | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
    metrics: Any = None,
    max_steps: int | None = None,
) -> LoopResult:
    """Run train steps until ``run.total_steps`` (or ``max_steps`` more), the source ends, or ``stop``.

    Args:
        trainer: a :class:`trainer.trainer.Trainer` (every rank).
        source: the batch source (used on rank 0 only; may be None elsewhere).
        stop: set to stop after the current step (checkpoint first).
        on_step: called on rank 0 with each step's metrics.
        metrics: an :class:`asyncrl.metrics.TrainerMetrics` (rank 0) or None.
        max_steps: stop after this many steps of this call.

    Returns:
        the :class:`LoopResult` (``reason``: ``total_steps``, ``max_steps``, ``source_exhausted``, ``stopped``).
    """
    from trainer.engine import lr_at

    cfg = trainer.cfg
    stop = stop or threading.Event()
    history: list[dict[str, float]] = []
    jsonl = None
    if trainer.rank == 0 and cfg.monitoring.jsonl:
        path = Path(cfg.run.run_dir) / "metrics" / "trainer.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        _restore_checkpointed_record(path, trainer)
        jsonl = open(path, "a")
    done_here = 0
    reason = "total_steps"
    from asyncrl.metrics.tracking import RunClock

    clock = RunClock(cfg.run.run_dir)  # evaluation stops recorded by the controller (none when run alone)
    from asyncrl.core.core_follow import idle_flag_from_env

    # resources.core_sharing: follow — rank 0 holds the idle flag while it waits for a batch
    idle_flag = idle_flag_from_env() if trainer.rank == 0 else None
    if idle_flag is not None:
        idle_flag.clear()  # a killed trainer's flag would keep the rollout servers wide
    export_seen = getattr(source, "export_seconds", 0.0) or 0.0  # the timeline exported before the first step
    try:
        while trainer.step < cfg.run.total_steps:
            if max_steps is not None and done_here >= max_steps:
                reason = "max_steps"
                break
            timer = PhaseTimer(metrics, clock)
            step_no = trainer.step + 1
            with timer.phase("wait_batch"), (idle_flag.waiting() if idle_flag is not None else contextlib.nullcontext()):
                groups = None
                if trainer.rank == 0 and not stop.is_set():
                    groups = _groups_of(trainer.run_async(source.next_batch(step_no)))
                groups, stopping = trainer.broadcast_groups(groups, stop=stop.is_set())
            if stopping:
                reason = "stopped"
                break
            if groups is None:
                reason = "source_exhausted"
                break
            step_metrics: dict[str, float] = {}
            per_minibatch: list[dict[str, float]] = []
            peak_reset = trainer.rank == 0 and reset_peak_resident()  # the step's own peak, recorded below
            with timer.phase("forward_backward"):
                plan = trainer.begin_step(groups)
            for mb in plan.minibatches:
                with timer.phase("forward_backward"):
                    fb = trainer.forward_backward(mb)
                if fb["early_stopped"]:
                    step_metrics["early_stopped"] = 1.0
                    break
                with timer.phase("optim_step"):
                    om = trainer.optim_step(lr_at(trainer.optimizer_steps, cfg.trainer.optimizer, trainer.total_optimizer_steps))
                per_minibatch.append({**fb, **om})
            step_metrics = {**_combine(per_minibatch), **step_metrics}
            if trainer.rank == 0:
                trainer.run_async(source.acknowledge(trainer.step))
            if trainer.step % cfg.weight_sync.interval == 0:
                with timer.phase("publish_weights"):
                    pub = trainer.publish_weights()
                step_metrics.update({k: v for k, v in pub.items() if isinstance(v, float)})
            record: dict[str, float] = {}
            if trainer.rank == 0:
                record = {"step": float(trainer.step), **plan.metrics, **step_metrics}
                memory = resident_memory()
                if memory is not None:  # what the kernel's OOM killer weighs (trainer/memory.py)
                    record["memory_resident_gb"] = memory[0]
                    if peak_reset:
                        record["memory_peak_resident_gb"] = memory[1]
            if trainer.step % cfg.trainer.checkpoint_interval == 0 or stop.is_set() or trainer.step >= cfg.run.total_steps:
                with timer.phase("checkpoint"):
                    # the record so far goes into the checkpoint: a kill between the checkpoint and
                    # the line below would otherwise lose the step's line for good
                    pending = {**record, **{f"{k}_seconds": v for k, v in timer.seconds.items()}}
                    _checkpoint(trainer, source, metrics, stopping=stop.is_set(), step_record=pending or None)
            done_here += 1
            if trainer.rank == 0:
                record.update({f"{k}_seconds": v for k, v in timer.seconds.items()})
                exported = getattr(source, "export_seconds", None)
                if exported is not None:  # the sample timeline's export in this step (part of checkpoint_seconds)
                    record["timeline_export_seconds"] = exported - export_seen
                    export_seen = exported
                if timer.stopped_seconds > 0:
                    record["eval_stopped_seconds"] = timer.stopped_seconds
                history.append(record)
                if jsonl is not None:
                    jsonl.write(json.dumps(record) + "\n")
                    jsonl.flush()
                if metrics is not None:
                    _export(metrics, record, trainer)
                if on_step is not None:
                    on_step(record)
        if reason == "stopped":  # a checkpoint of the step already recorded: it keeps that step's record
            last = history[-1] if history else getattr(trainer, "checkpoint_step_record", None)
            kept = last if trainer.rank == 0 and last and int(last.get("step", -1)) == trainer.step else None
            _checkpoint(trainer, source, metrics, stopping=True, step_record=kept)
    finally:
        if jsonl is not None:
            jsonl.close()
    return LoopResult(done_here, reason, history)


_SUMMED = ("loss_tokens", "processed_tokens", "micro_batches")
_MAXED = ("importance_weight_max",)
_LAST = ("lr", "optimizer_step", "step", "grad_norm")


def _combine(per_minibatch: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its mini-batches: token counts summed, maxima maxed, the
    optimizer's last values kept (``grad_norm_max`` added), everything else averaged."""
    if not per_minibatch:
        return {}
    out: dict[str, float] = {}
    for key in per_minibatch[0]:
        values = [m[key] for m in per_minibatch if key in m]
        if key in _SUMMED:
            out[key] = float(sum(values))
        elif key in _MAXED:
            out[key] = float(max(values))
        elif key in _LAST:
            out[key] = float(values[-1])
        else:
            out[key] = float(sum(values) / len(values))
    out["grad_norm_max"] = float(max(m["grad_norm"] for m in per_minibatch))
    out["minibatches"] = float(len(per_minibatch))
    return out


def _restore_checkpointed_record(path: Path, trainer: Any) -> None:
    """Append the resumed checkpoint's step record to ``trainer.jsonl`` if the file lacks it.

    A step's line is written after its checkpoint (it carries ``checkpoint_seconds``), so a
    ``kill -9`` between the two would lose it: the resumed trainer starts after the checkpoint
    and never repeats the step. The checkpoint keeps the record as it stood before the write
    (:meth:`trainer.checkpoint.TrainerCheckpoints.save_checkpoint`); it is missing exactly when the
    file's last step is below the checkpoint's (a record of a later step means the trainer
    went on past the checkpoint, so the line was written). The restored line carries
    ``record_restored: 1.0`` and no ``checkpoint_seconds``. A torn last line (a partial write,
    e.g. a full disk) is cut off first: it is an incomplete record of the same step.
    """
    saved = getattr(trainer, "checkpoint_step_record", None)
    if not saved or int(saved.get("step", -1)) != trainer.step:
        return
    last, whole = -1, 0
    if path.is_file():
        text = path.read_text()
        whole = len(text[:text.rfind("\n") + 1].encode())  # up to the last full line
        for line in text.splitlines():
            try:
                last = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn line
    if last >= trainer.step:
        return
    with open(path, "a") as f:
        f.truncate(whole)
        f.write(json.dumps({**saved, "record_restored": 1.0}) + "\n")
    print(f"trainer.jsonl lacked step {trainer.step}, the step of the resumed checkpoint: its record, "
          "kept with the checkpoint, was written", file=sys.stderr, flush=True)


def _checkpoint(trainer: Any, source: Any, metrics: Any = None, stopping: bool = False,
                step_record: dict[str, float] | None = None) -> None:
    """Write a checkpoint (with the source's state and ``step_record``, see
    :func:`_restore_checkpointed_record`); its write time and result go to
    ``asyncrl_trainer_checkpoint_duration_seconds`` / ``asyncrl_trainer_checkpoints_total``
    when ``metrics`` (rank 0's TrainerMetrics) is given. Re-raises a failed write.

    ``stopping`` (the loop's stop is set): the source gives up on an unreachable Redis after its
    stop grace (:class:`trainer.sources.BufferBatchSource`), and the checkpoint is then written
    without the dataset cursor and without the commit — safe: commits are cumulative, and a
    resume from this checkpoint does not hand its acknowledged groups out again
    (docs/architecture.md#acknowledgement-and-recovery)."""
    rank0_source = trainer.rank == 0 and source is not None
    state = None
    if rank0_source and hasattr(source, "state_dict"):
        state = _buffer_call(trainer, source.state_dict, stopping,
                             f"the stop's checkpoint of step {trainer.step} is written without the dataset cursor")
    start = time.perf_counter()
    try:
        trainer.save_checkpoint(state, step_record=step_record)
    except BaseException:
        if metrics is not None:
            metrics.checkpoints.labels("error").inc()
        raise
    if metrics is not None:
        metrics.checkpoint_duration.observe(time.perf_counter() - start)
        metrics.checkpoints.labels("ok").inc()
    if rank0_source and hasattr(source, "commit"):
        _buffer_call(trainer, lambda: source.commit(trainer.step), stopping,
                     f"step {trainer.step} is checkpointed but not committed: the next checkpoint commits it")


def _buffer_call(trainer: Any, make: Callable[[], Any], stopping: bool, skipped: str) -> Any:
    """``trainer.run_async(make())``; when stopping, an outage (DependencyOutage) is reported with
    ``skipped`` and None returned instead of raised."""
    from asyncrl.core.outage import DependencyOutage

    try:
        return trainer.run_async(make())
    except DependencyOutage as exc:
        if not stopping:
            raise
        print(f"{exc}; {skipped}", file=sys.stderr, flush=True)
        return None


def _export(metrics: Any, r: dict[str, float], trainer: Any) -> None:
    stats = {k: r[k] for k in ("loss", "reward_mean", "importance_weight_mean", "importance_weight_max",
                               "behaviour_kl", "entropy", "grad_norm", "staleness_max", "value_loss",
                               "explained_variance", "kl_ctl") if k in r}
    if "clip_fraction" in r:
        stats["clip_ratio"] = r["clip_fraction"]
    if "importance_weight_capped_fraction" in r:
        stats["importance_weight_capped_ratio"] = r["importance_weight_capped_fraction"]
    if "lr" in r:
        stats["learning_rate"] = r["lr"]
    metrics.step_done(int(r["step"]), int(r.get("processed_tokens", 0)), int(r.get("response_tokens", 0)),
                      int(r.get("samples", 0)), stats)
    if "publish_seconds" in r:
        metrics.published(int(r["version"]), trainer.cfg.weight_sync.transport, r["publish_seconds"],
                          int(r.get("publish_bytes", 0)), trainer.lineage)
