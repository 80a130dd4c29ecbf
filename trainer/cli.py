"""``asyncrl trainer --config F [--FIELD VALUE ...]``: run the DeepSpeed trainer.

Works as a single process, under ``torchrun --nproc-per-node N -m asyncrl.cli trainer ...`` (or
``torchrun $(which asyncrl) trainer ...``) and under the ``deepspeed`` launcher: every rank builds
the engine; rank 0 talks to the buffer and broadcasts each batch. On start the newest checkpoint in
``<run_dir>/checkpoints`` is restored and the buffer is rewound to it (``recover``:
docs/architecture.md#acknowledgement-and-recovery); with no checkpoint the buffer is rewound to step
0, version 0 (a trainer killed before its first checkpoint starts over, acknowledged steps are
handed out again). SIGTERM/SIGINT: the current step finishes, a checkpoint is written, exit 0.

Batches come from the Redis buffer at ``buffer.redis_url``; for offline runs and tests the
environment variable ``ASYNCRL_TRAINER_BATCHES=file.jsonl`` replays recorded batches instead
(:class:`trainer.sources.FileBatchSource`). Heavy imports happen after the config is parsed so
``--help`` is instant; the run itself is :func:`trainer.role.run_trainer`.
"""

from __future__ import annotations

import os
import sys

from trainer.sources import BufferBatchSource  # its import path before trainer/sources.py existed

__all__ = ["main", "BufferBatchSource"]


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl trainer``; returns the exit code."""
    from asyncrl.core.config_cli import config_from_argv

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

    from trainer.role import run_trainer

    return run_trainer(cfg, replay)


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


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
