"""``asyncrl trainer --config F [--FIELD VALUE ...]``: run the DeepSpeed trainer.

Works as a single process, under ``torchrun --nproc-per-node N -m asyncrl.cli trainer ...``
(or ``torchrun $(which asyncrl) trainer ...``) and under the ``deepspeed`` launcher: every rank
builds the engine; rank 0 talks to the buffer and broadcasts each batch. On start the newest
checkpoint in ``<run_dir>/checkpoints`` is restored and the buffer is rewound to it
(``recover``: ARCHITECTURE §6); with no checkpoint the buffer is rewound to step 0, version 0
(a trainer killed before its first checkpoint starts over, acknowledged steps are handed out
again). SIGTERM/SIGINT: the current step finishes, a checkpoint is written, exit 0.

Batches come from the Redis buffer at ``buffer.redis_url``; for offline runs and tests the
environment variable ``ASYNCRL_TRAINER_BATCHES=file.jsonl`` replays recorded batches instead
(:class:`trainer.loop.FileBatchSource`). Heavy imports happen after the config is parsed so
``--help`` is instant.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import Any

__all__ = ["main", "BufferBatchSource"]


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


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl trainer``; returns the exit code."""
    from asyncrl.config_cli import config_from_argv

    argv = _strip_launcher_args(argv)
    cfg = config_from_argv(argv, "trainer")
    if isinstance(cfg, int):
        return cfg
    replay = os.environ.get("ASYNCRL_TRAINER_BATCHES")
    if replay and not os.path.isfile(replay):
        print(f"asyncrl trainer: ASYNCRL_TRAINER_BATCHES={replay} is not a file", file=sys.stderr)
        return 2
    if not replay and not cfg.buffer.redis_url:
        print("asyncrl trainer: needs --buffer.redis_url (the run's Redis buffer), or "
              "ASYNCRL_TRAINER_BATCHES=file.jsonl to replay recorded batches", file=sys.stderr)
        return 2
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")

    from trainer.loop import FileBatchSource, install_signal_handlers, train_loop
    from trainer.trainer import Trainer

    stop = threading.Event()
    install_signal_handlers(stop)
    holder: dict[str, Any] = {}

    def announce(version: int, uri: str, checksum: str):
        src = holder.get("source")
        return src.announce(version, uri, checksum) if hasattr(src, "announce") else None

    trainer = Trainer(cfg, announce=announce)
    source = None
    try:
        if trainer.rank == 0:
            try:
                source = FileBatchSource(replay) if replay else trainer.run_async(BufferBatchSource.open(cfg, stop))
            except (ValueError, OSError) as exc:
                print(f"asyncrl trainer: {exc}", file=sys.stderr)
                return 2
            holder["source"] = source
        extra = trainer.load_checkpoint()
        if trainer.rank == 0:
            if extra is not None and hasattr(source, "load_state_dict"):
                source.load_state_dict(extra)
            if hasattr(source, "recover"):
                # Always, also without a checkpoint: a trainer that died before its first
                # checkpoint may have acknowledged steps and moved the clock; it restarts from
                # step 0 at version 0 (a new lineage when the clock had moved). On a fresh
                # buffer this changes nothing.
                result = trainer.run_async(source.recover(trainer.step, trainer.published_version)) or {}
                trainer.lineage = int(result.get("lineage", trainer.lineage))
        metrics = None
        if trainer.rank == 0 and cfg.monitoring.trainer_metrics_port is not None:
            from prometheus_client import CollectorRegistry

            from asyncrl.metrics import BufferMetrics, TrainerMetrics, build_info, start_metrics_server

            reg = CollectorRegistry()
            build_info(reg, "trainer")
            metrics = TrainerMetrics(reg)
            if isinstance(source, BufferBatchSource):
                source.buffer_metrics = BufferMetrics(reg)
                source.buffer_metrics.set_bounds(cfg.buffer.max_staleness, cfg.rollout.rollout_batch_size)
            start_metrics_server(reg, cfg.monitoring.trainer_metrics_port, host=cfg.monitoring.metrics_host)
        result = train_loop(trainer, source, stop=stop, metrics=metrics,
                            on_step=lambda r: print(_line(r), flush=True) if trainer.rank == 0 else None)
        if trainer.rank == 0:
            print(f"asyncrl trainer: {result.steps} steps, stopped because {result.reason}; step {trainer.step}", flush=True)
        return 0
    finally:
        if source is not None and hasattr(source, "close"):
            trainer.run_async(source.close())
        trainer.close()


def _strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop ``--local_rank N`` / ``--local_rank=N`` that the ``deepspeed`` launcher appends (LOCAL_RANK is also in the environment)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--local_rank", "--local-rank"):
            skip = True
            continue
        if a.startswith(("--local_rank=", "--local-rank=")):
            continue
        out.append(a)
    return out


def _line(r: dict[str, float]) -> str:
    keys = ("step", "loss", "reward_mean", "grad_norm", "lr", "clip_fraction", "importance_weight_mean", "staleness_max")
    return "step " + " ".join(f"{k}={r[k]:.4g}" for k in keys if k in r)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
