"""Batch sources of the trainer (rank 0): an in-memory list, a JSONL file of recorded batches, the replay buffer.

One job: hand the training loop its batches. Each satisfies :class:`trainer.batch.BatchSource`
(see :mod:`trainer.loop` for the protocol): :class:`ListBatchSource` (tests, benchmarks),
:class:`FileBatchSource` (``ASYNCRL_TRAINER_BATCHES=file.jsonl``) and :class:`BufferBatchSource`
(the Redis replay buffer, what ``asyncrl trainer`` uses).
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

__all__ = ["ListBatchSource", "FileBatchSource", "BufferBatchSource"]


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
    """

    def __init__(self, buf: Any, stop: threading.Event | None = None, poll_seconds: float = 0.05):
        self.buf = buf
        self.stop = stop or threading.Event()
        self.poll_seconds = poll_seconds
        self._batch_id: str | None = None
        self.buffer_metrics: Any = None

    @classmethod
    async def open(cls, cfg: Any, stop: threading.Event | None = None) -> "BufferBatchSource":
        """Connect to ``cfg.buffer.redis_url`` with the run's settings.

        Raises:
            ValueError: no ``buffer.redis_url`` configured.
        """
        if not cfg.buffer.redis_url:
            raise ValueError("asyncrl trainer needs --buffer.redis_url (or ASYNCRL_TRAINER_BATCHES=file.jsonl to replay batches)")
        from buffers import BufferSettings, ReplayBuffer

        buf = await ReplayBuffer.open(cfg.buffer.redis_url, run=cfg.run.name, settings=BufferSettings.from_config(cfg))
        return cls(buf, stop)

    async def next_batch(self, step: int) -> Any:
        while not self.stop.is_set():
            batch = await self.buf.next_batch(step)
            if batch is not None:
                if self.buffer_metrics is not None and not batch.redelivered:
                    self._observe(batch)
                self._batch_id = batch.batch_id
                return batch
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
        if self._batch_id is not None:
            await self.buf.acknowledge(self._batch_id, step)

    async def commit(self, step: int) -> None:
        await self.buf.commit(step)

    async def state_dict(self) -> dict[str, Any]:
        return {"dataset_cursor": await self.buf.dataset_cursor()}

    async def announce(self, version: int, uri: str, checksum: str) -> None:
        await self.buf.clock.publish(version, uri, checksum)

    async def recover(self, step: int, version: int) -> dict[str, Any]:
        return await self.buf.recover(step, version)

    async def close(self) -> None:
        await self.buf.close()
