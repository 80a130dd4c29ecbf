"""The trainer role: build the trainer, restore its checkpoint, rewind the buffer, run the loop.

One job: :func:`run_trainer`, what ``asyncrl trainer`` runs once its command line is parsed
(:mod:`trainer.cli`), on every rank. On start the newest checkpoint in ``<run_dir>/checkpoints`` is
restored and the buffer is rewound to it (``recover``:
docs/architecture.md#acknowledgement-and-recovery); with no checkpoint the buffer is rewound to step
0, version 0. SIGTERM/SIGINT: the current step finishes, a checkpoint is written, exit 0. A batch whose
rewards are all 0 with ``data.check_verifier_status`` on (a broken verifier) exits 2: the
controller does not restart it, and the batch stays in the buffer.

Faults: a Redis outage (restart, AOF loading) is waited out by every buffer call of rank 0
(:mod:`asyncrl.core.outage`: backoff, one WARNING line, ``buffer.outage_seconds``), so it neither
crashes the trainer nor redoes its steps; a wait past its deadline (the outage, or no batch
within ``trainer.batch_wait_seconds``) exits 1 with one line naming what was waited for.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

__all__ = ["run_trainer"]


def run_trainer(cfg: Any, replay: str | None) -> int:
    """Train on batches from the buffer (or replayed from the JSONL file ``replay``); returns the exit code."""
    from asyncrl.core.outage import DependencyOutage
    from asyncrl.tasks.rewards import VerifierStatusError
    from trainer.loop import install_signal_handlers, train_loop
    from trainer.sources import BatchWaitTimeout, BufferBatchSource, FileBatchSource
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
            except DependencyOutage as exc:
                print(str(exc), file=sys.stderr, flush=True)
                return 1
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
        try:
            result = train_loop(trainer, source, stop=stop, metrics=metrics,
                                on_step=lambda r: print(_line(r), flush=True) if trainer.rank == 0 else None)
        except VerifierStatusError as exc:  # a broken verifier: restarting would fail the same way
            print(f"asyncrl trainer: step {trainer.step + 1}: {exc}", file=sys.stderr, flush=True)
            return 2
        except (DependencyOutage, BatchWaitTimeout) as exc:  # a wait past its deadline: fail loudly, no traceback
            print(str(exc), file=sys.stderr, flush=True)
            return 1
        if trainer.rank == 0:
            print(f"asyncrl trainer: {result.steps} steps, stopped because {result.reason}; step {trainer.step}", flush=True)
        return 0
    finally:
        if source is not None and hasattr(source, "close"):
            trainer.run_async(source.close())
        trainer.close()
        _destroy_process_group()


def _destroy_process_group() -> None:
    """Tear down torch.distributed before the interpreter does.

    Without it, gloo's worker threads can still be joinable while the interpreter finalises, and
    C++ aborts the rank with "terminate called without an active exception" (SIGABRT) after a
    run that finished cleanly (seen once in CI on a 2-rank run; pytorch/pytorch#190489, and the
    torch.distributed docs' "Shutdown" section ask for this call near the end of main).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _line(r: dict[str, float]) -> str:
    keys = ("step", "loss", "reward_mean", "grad_norm", "lr", "clip_fraction", "importance_weight_mean", "staleness_max")
    return "step " + " ".join(f"{k}={r[k]:.4g}" for k in keys if k in r)
