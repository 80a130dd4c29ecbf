"""SGLang backend: the ``python -m sglang.launch_server`` command line derived from the config.

:func:`sglang_command` maps asyncrl's config to SGLang's documented server flags
(https://docs.sglang.io/advanced_features/server_arguments.html): model path, host/port,
``--tp-size``, ``--mem-fraction-static``, ``--max-running-requests``, ``--dtype``,
``--api-key``, ``--weight-version`` (the policy version, so every ``meta_info.weight_version``
is an asyncrl version), ``--enable-metrics`` (Prometheus ``/metrics``),
``--incremental-streaming-output`` (deltas; the client detects the mode either way),
``--random-seed``, ``--skip-server-warmup``; ``rollout.sglang_args`` is appended verbatim.
With ``trainer.lora`` (adapters by name, docs/trainer.md#lora) also SGLang's LoRA flags
(https://docs.sglang.io/advanced_features/lora.html): ``--enable-lora``, ``--max-lora-rank``
and ``--lora-target-modules`` (adapters loaded after start must fit them), and
``--max-loaded-loras`` = ``--max-loras-per-batch`` = ``buffer.max_staleness + 2`` (the worker
keeps ``max_staleness + 1`` registered, one more while it loads the next).
:data:`SGLANG_DOCUMENTED_FLAGS` is the flag set the tests check the command against.

The process is launched (and waited for) by :mod:`rollout_server.launch`; whether SGLang is
installed is :func:`sglang_available` (the ``sglang`` extra of the package).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from asyncrl.core.config import AsyncRLConfig

__all__ = ["SGLANG_DOCUMENTED_FLAGS", "sglang_available", "sglang_command"]

#: Server flags documented by SGLang (its server arguments page, above) that asyncrl may emit.
SGLANG_DOCUMENTED_FLAGS: dict[str, bool | str] = {  # flag -> takes a value ("+": one or more)
    "--model-path": True,
    "--tokenizer-path": True,
    "--host": True,
    "--port": True,
    "--tp-size": True,
    "--dp-size": True,
    "--mem-fraction-static": True,
    "--max-running-requests": True,
    "--max-total-tokens": True,
    "--context-length": True,
    "--dtype": True,
    "--skip-tokenizer-init": False,
    "--enable-metrics": False,
    "--api-key": True,
    "--admin-api-key": True,
    "--weight-version": True,
    "--served-model-name": True,
    "--incremental-streaming-output": False,
    "--stream-interval": True,
    "--enable-memory-saver": False,
    "--skip-server-warmup": False,
    "--random-seed": True,
    "--log-level": True,
    "--disable-radix-cache": False,
    "--enable-deterministic-inference": False,
    "--load-format": True,
    "--trust-remote-code": False,
    "--enable-lora": False,
    "--max-lora-rank": True,
    "--lora-target-modules": "+",
    "--max-loaded-loras": True,
    "--max-loras-per-batch": True,
}

_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def sglang_available() -> bool:
    """True when the ``sglang`` package is importable (the ``asyncrl[sglang]`` extra)."""
    return importlib.util.find_spec("sglang") is not None


def sglang_command(cfg: "AsyncRLConfig", model_path: str, port: int, weight_version: str | int = 0,
                   python: str | None = None) -> list[str]:
    """argv of ``python -m sglang.launch_server`` for one rollout server.

    Args:
        cfg: the run config (``rollout.host``, ``rollout.sglang_*``, ``rollout.engine_max_batch_size``,
            ``model.dtype``, ``model.max_context_len``, ``security.api_key`` when
            ``rollout.api_key_required``, ``run.seed``, ``trainer.lora`` and ``buffer.max_staleness``).
        model_path: resolved model directory (or the latest published weights).
        port: the server's port.
        weight_version: policy version of those weights (``--weight-version``).
        python: interpreter (default: this one).
    """
    r = cfg.rollout
    cmd = [python or sys.executable, "-m", "sglang.launch_server",
           "--model-path", str(model_path), "--host", r.host, "--port", str(int(port)),
           "--tp-size", str(r.sglang_tp_size), "--dtype", _DTYPE[cfg.model.dtype],
           "--max-running-requests", str(r.engine_max_batch_size),
           "--weight-version", str(weight_version), "--random-seed", str(cfg.run.seed),
           "--enable-metrics", "--skip-server-warmup"]
    if r.incremental_streaming:
        cmd.append("--incremental-streaming-output")
    if r.sglang_mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(r.sglang_mem_fraction_static)]
    if cfg.model.max_context_len is not None:
        cmd += ["--context-length", str(cfg.model.max_context_len)]
    if r.api_key_required and cfg.security.api_key:
        from asyncrl.core.secret_values import reveal

        # SGLang takes its key on the command line only: visible in `ps` (docs/security.md)
        cmd += ["--api-key", reveal(cfg.security.api_key) or ""]
    lora = cfg.trainer.lora
    if lora is not None:
        keep = str(cfg.buffer.max_staleness + 2)
        cmd += ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *lora.target_modules,
                "--max-loaded-loras", keep, "--max-loras-per-batch", keep]
    cmd += list(r.sglang_args)
    return cmd
