"""Batch sources of the trainer (rank 0): an in-memory list, a JSONL file of recorded batches, the replay buffer.

One job: hand the training loop its batches. Each satisfies :class:`trainer.batch.BatchSource`
(see :mod:`trainer.loop` for the protocol): :class:`ListBatchSource` (tests, benchmarks),
:class:`FileBatchSource` (``ASYNCRL_TRAINER_BATCHES=file.jsonl``) and :class:`BufferBatchSource`
(the Redis replay buffer, what ``asyncrl trainer`` uses).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ListBatchSource", "FileBatchSource", "BufferBatchSource", "BatchWaitTimeout"]


class BatchWaitTimeout(RuntimeError):
    """No train batch became READY within ``trainer.batch_wait_seconds`` (the message says which step)."""


class ListBatchSource:
    """A batch source over an in-memory list of batches (tests, benchmarks, replaying a file).

    ``acknowledged`` records ``(step, group ids)``; the cursor is the index of the next batch.
    """

    def __init__(self, batches: list[list[Any]]):
        self.batches = list(batches)
        self.cursor = 0
        self.acknowledged: list[tuple[int, list[str]]] = []
        self.committed: list[int] = []
        self._last: list[Any] | None = None

    def next_batch(self, step: int) -> list[Any] | None:
        if self.cursor >= len(self.batches):
            return None
        self._last = self.batches[self.cursor]
        self.cursor += 1
        return self._last

    def acknowledge(self, step: int) -> None:
        from trainer.batch import TrainGroup

        self.acknowledged.append((step, [TrainGroup.from_record(g).group_id for g in self._last or []]))

    def commit(self, step: int) -> None:
        self.committed.append(step)

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state.get("cursor", 0))


class FileBatchSource(ListBatchSource):
    """Batches from a JSONL file: one train batch per line, a list of groups
    (``{"group_id", "prompt_ids", "samples": [{"sample_id", "index", "response_ids",
    "behaviour_logprobs", "versions", "finish_reason", "reward"}]}``).

    Raises:
        ValueError: a line that is not a JSON list (the message names the line).
    """

    def __init__(self, path: Path | str):
        batches = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(data, list):
                raise ValueError(f"{path}:{n}: a batch must be a JSON list of prompt groups")
            batches.append(data)
        super().__init__(batches)


class BufferBatchSource:
    """Adapter from the replay buffer (``buffers.ReplayBuffer``, docs/buffer.md) to the loop's batch source.

    ``next_batch(step)`` polls ``buf.next_batch(step)`` until a batch is READY or ``stop`` is set
    (then returns None); ``acknowledge(step)`` acknowledges that batch; ``commit``,
    ``state_dict`` (the dataset cursor), ``announce`` (the version clock's compare-and-set
    ``publish``) and ``recover`` forward to the buffer.

    ``buffer_metrics`` (an :class:`asyncrl.metrics.BufferMetrics` on rank 0's registry, set by
    ``main``) receives the batch former's events: the staleness (batch version − oldest token
    version) of every sample handed to the trainer, the groups trained, and the version clock.

    Stopping during an outage: once ``stop`` is set, ``commit`` and ``state_dict`` wait out an
    unreachable Redis for at most :attr:`stop_outage_seconds` (not ``buffer.outage_seconds``),
    then raise :class:`asyncrl.core.outage.DependencyOutage`; the stop's checkpoint is written without
    them (``trainer.loop``). Before, a trainer told to stop after its controller died with Redis
    waited the whole outage deadline (300 s) for a Redis nobody would restart.
    """

    #: how long an orderly stop waits for an unreachable Redis before checkpointing without it
    stop_outage_seconds: float = 15.0

    def __init__(self, buf: Any, stop: threading.Event | None = None, poll_seconds: float = 0.05,
                 outage_seconds: float = 300.0, batch_wait_seconds: float = 3600.0):
        from asyncrl.core.outage import OutageGuard

        self.buf = buf
        self.stop = stop or threading.Event()
        self.poll_seconds = poll_seconds
        self.batch_wait_seconds = batch_wait_seconds
        self.guard = OutageGuard("trainer", outage_seconds)
        self._batch_id: str | None = None
        self.buffer_metrics: Any = None
        self._stop_seen: float | None = None  # when a wait first saw ``stop`` (the stop's one grace)
        self.trace_dir: Any = None  # <run_dir>/trace: where export_timeline writes (set by open; None: buffer.timeline off)
        self.export_seconds = 0.0  # wall seconds spent in export_timeline so far (the timeline's cost to the trainer)

    @classmethod
    async def open(cls, cfg: Any, stop: threading.Event | None = None) -> "BufferBatchSource":
        """Connect to ``cfg.buffer.redis_url`` with the run's settings (waiting out a Redis that
        is restarting, up to ``buffer.outage_seconds``).

        Raises:
            ValueError: no ``buffer.redis_url`` configured.
            asyncrl.core.outage.DependencyOutage: Redis unreachable past the deadline.
        """
        if not cfg.buffer.redis_url:
            raise ValueError("asyncrl trainer needs --buffer.redis_url (or ASYNCRL_TRAINER_BATCHES=file.jsonl to replay batches)")
        from asyncrl.core.outage import OutageGuard
        from buffers import ReplayBuffer

        guard = OutageGuard("trainer", cfg.buffer.outage_seconds)
        buf = await guard.call(lambda: ReplayBuffer.open_for(cfg, role="trainer"),
                               "opening the run's buffer")
        src = cls(buf, stop, outage_seconds=cfg.buffer.outage_seconds, batch_wait_seconds=cfg.trainer.batch_wait_seconds)
        src.guard = guard
        if cfg.buffer.timeline:  # off: nothing is recorded, nothing exported, no trace/ directory
            src.trace_dir = Path(cfg.run.run_dir) / "trace"
        # the recovery, publishes and dropped groups recorded before this start reach the files now
        await src.export_timeline()
        return src

    async def next_batch(self, step: int) -> Any:
        """The batch of ``step``, polled until READY; None once ``stop`` is set.

        Raises:
            BatchWaitTimeout: no batch within ``batch_wait_seconds`` (the message names the step
                and the buffer's groups by state).
            asyncrl.core.outage.DependencyOutage: Redis unreachable past ``buffer.outage_seconds``.
        """
        import time

        from asyncrl.core.outage import DependencyOutage

        deadline = time.monotonic() + self.batch_wait_seconds
        while not self.stop.is_set():
            try:
                batch = await self.guard.call(lambda: self.buf.next_batch(step), f"waiting for the batch of step {step}",
                                              give_up=self.stop.is_set)
            except DependencyOutage:
                if self.stop.is_set():
                    return None
                raise
            if batch is not None:
                if self.buffer_metrics is not None and not batch.redelivered:
                    self._observe(batch)
                self._batch_id = batch.batch_id
                return batch
            if time.monotonic() >= deadline:
                try:
                    by_state = (await self.buf.stats()).get("groups_by_state")
                except Exception as exc:  # noqa: BLE001 - best effort for the message
                    by_state = f"unavailable ({exc})"
                raise BatchWaitTimeout(
                    f"asyncrl trainer: waited {self.batch_wait_seconds:.0f} s (trainer.batch_wait_seconds) for the "
                    f"batch of step {step} and none became READY; buffer groups by state: {by_state}. Are the "
                    "rollout servers and the feeder running?")
            await asyncio.sleep(self.poll_seconds)
        return None

    def _observe(self, batch: Any) -> None:
        m = self.buffer_metrics
        m.set_clock(batch.version, batch.lineage)
        for g in batch.groups:
            for sample in g.samples:
                oldest = sample.oldest_version
                m.sample_staleness.observe(max(0, batch.version - (g.oldest_version if oldest is None else oldest)))
        m.groups_trained.inc(len(batch.groups))

    async def acknowledge(self, step: int) -> None:
        """Acknowledge the batch of ``step`` (idempotent, so retried through a Redis outage)."""
        if self._batch_id is not None:
            bid = self._batch_id
            await self.guard.call(lambda: self.buf.acknowledge(bid, step), f"acknowledging step {step}",
                                  give_up=self._give_up_when_stopping())

    def _give_up_when_stopping(self):
        """A ``give_up`` for :meth:`OutageGuard.call`: True once ``stop`` has been set for
        :attr:`stop_outage_seconds`. One grace for every wait of the stop (acknowledge, commit,
        cursor, announce, recover) together, counted from the first wait that saw ``stop``: a role
        told to stop (SIGTERM, or its controller died) is gone within that grace (issue #31 item 5)."""
        import time

        def give_up() -> bool:
            if not self.stop.is_set():
                return False
            if self._stop_seen is None:
                self._stop_seen = time.monotonic()
            return time.monotonic() - self._stop_seen >= self.stop_outage_seconds

        return give_up

    async def commit(self, step: int) -> None:
        """Commit the groups acknowledged up to ``step`` (idempotent and cumulative; retried through
        an outage, for at most :attr:`stop_outage_seconds` once stopping)."""
        await self.guard.call(lambda: self.buf.commit(step), f"committing step {step}",
                              give_up=self._give_up_when_stopping())
        await self.export_timeline()

    async def export_timeline(self) -> int:
        """Move the timeline records the buffer holds (committed and dropped groups, batches, publishes,
        recoveries) to ``<run_dir>/trace/`` (docs/buffer.md#timeline); best effort: a failure is one
        WARNING line, the records stay in Redis for the next commit. Returns how many were exported."""
        if self.trace_dir is None:
            return 0
        start = time.perf_counter()
        try:
            return await self.buf.export_timeline(self.trace_dir)
        except Exception as exc:  # noqa: BLE001 - the trace must never stop training
            print(f"WARNING asyncrl trainer: exporting the sample timelines to {self.trace_dir} failed: {exc}",
                  file=sys.stderr, flush=True)
            return 0
        finally:
            self.export_seconds += time.perf_counter() - start

    async def state_dict(self) -> dict[str, Any]:
        """``{"dataset_cursor": N}`` for the checkpoint (informational; retried like :meth:`commit`)."""
        cursor = await self.guard.call(self.buf.dataset_cursor, "reading the dataset cursor",
                                       give_up=self._give_up_when_stopping())
        return {"dataset_cursor": cursor}

    async def announce(self, version: int, uri: str, checksum: str) -> None:
        """Move the clock to ``version`` (compare-and-set). Retried through a Redis outage: when an
        attempt whose reply was lost had landed, the retry's conflict is recognised (the clock
        already announces this version with this checksum) and is not an error."""
        from buffers.errors import VersionConflict

        attempts = 0

        async def publish() -> None:
            nonlocal attempts
            attempts += 1
            try:
                await self.buf.clock.publish(version, uri, checksum)
            except VersionConflict:
                latest = await self.buf.clock.latest() if attempts > 1 else None
                if latest is None or latest.version != version or latest.checksum != checksum:
                    raise

        await self.guard.call(publish, f"announcing policy version {version}", give_up=self._give_up_when_stopping())

    async def recover(self, step: int, version: int) -> dict[str, Any]:
        return await self.guard.call(lambda: self.buf.recover(step, version), f"rewinding the buffer to step {step}",
                                     give_up=self._give_up_when_stopping())

    async def close(self) -> None:
        await self.buf.close()
