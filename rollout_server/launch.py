"""Start rollout engines as child processes (embedded torch engine or SGLang), or attach to URLs.

:func:`engine_command` builds the embedded server's argv (``python -m rollout_server.server``,
SGLang-style flags) and :func:`rollout_server.sglang.sglang_command` SGLang's;
:func:`launch_servers` starts ``rollout.num_servers`` of them on ``base_port + i`` (free ports
when ``base_port`` is 0) and waits until each answers ``/health`` and ``/get_model_info``, or
returns handles for ``rollout.server_urls`` without launching anything.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.core.net import free_port
from asyncrl.core.process_guard import pdeathsig_preexec
from rollout_server.client import EngineClient, EngineUnavailable
from rollout_server.limits import limit_flags

if TYPE_CHECKING:  # pragma: no cover
    from asyncrl.core.config import AsyncRLConfig

__all__ = ["ServerHandle", "engine_command", "launch_servers", "stop_servers"]


@dataclass
class ServerHandle:
    """A rollout engine: its URL and, when asyncrl launched it, its process and log file."""

    url: str
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    def stop(self, timeout_seconds: float = 10.0) -> None:
        """Terminate a launched server (SIGTERM, then SIGKILL after the timeout)."""
        p = self.process
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout_seconds)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def by_name_lora_slots(cfg: "AsyncRLConfig") -> int:
    """Named LoRA adapters an embedded engine keeps with ``lora_mode: by_name``: the worker holds
    ``buffer.max_staleness + 1`` versions, one more while it swaps."""
    return cfg.buffer.max_staleness + 2


def engine_command(cfg: "AsyncRLConfig", model_path: str, port: int, weight_version: str | int = 0,
                   python: str | None = None) -> list[str]:
    """argv of the embedded engine server for one rollout server (mirrors SGLang's flags)."""
    r = cfg.rollout
    cmd = [python or sys.executable, "-m", "rollout_server.server", "--model-path", str(model_path),
           "--host", r.host, "--port", str(int(port)), "--weight-version", str(weight_version),
           "--max-running-requests", str(r.engine_max_batch_size), "--random-seed", str(cfg.run.seed)]
    cmd += limit_flags(r)  # rollout.engine_* limits (docs/rollout.md#limits)
    if cfg.resolved_lora_mode() == "by_name":  # the worker keeps max_staleness + 1, one more while it swaps
        cmd += ["--max-loaded-loras", str(by_name_lora_slots(cfg))]
    if r.incremental_streaming:
        cmd.append("--incremental-streaming-output")
    if r.engine_threads:
        cmd += ["--engine-threads", str(r.engine_threads)]
    if r.engine_scheduler_delay_factor:
        cmd += ["--scheduler-delay-factor", str(r.engine_scheduler_delay_factor)]
    if cfg.model.max_context_len is not None:
        cmd += ["--context-length", str(cfg.model.max_context_len)]
    if cfg.resources.rollout_gpus:  # the embedded engine on the (first visible) GPU
        cmd += ["--device", "cuda"]
    # the API key is never on the command line (visible in `ps`): launch_servers passes it in the
    # environment (ENGINE_API_KEY_ENV), which rollout_server.server reads
    return cmd


async def launch_servers(cfg: "AsyncRLConfig", model_path: str | None = None, weight_version: str | int = 0,
                         log_dir: Path | None = None, ready_timeout_seconds: float = 600.0,
                         env: dict[str, str] | None = None) -> list[ServerHandle]:
    """Launch ``rollout.num_servers`` engines (or attach to ``rollout.server_urls``) and wait until ready.

    Raises:
        RuntimeError: ``rollout.engine`` is ``sglang`` but SGLang is not installed.
        EngineUnavailable: a server exited or was not ready in time (the others are stopped).
    """
    from rollout_server.sglang import sglang_available, sglang_command

    r = cfg.rollout
    from asyncrl.core.secret_values import ENGINE_API_KEY_ENV, reveal

    api_key = reveal(cfg.security.api_key) if r.api_key_required else None
    if r.server_urls:
        handles = [ServerHandle(u.rstrip("/")) for u in r.server_urls]
    else:
        if r.engine == "sglang" and not sglang_available():
            raise RuntimeError("rollout.engine=sglang but SGLang is not installed: pip install 'asyncrl[sglang]' "
                               "(GPU machines) or set rollout.engine=torch, or attach with rollout.server_urls")
        if model_path is None:
            from asyncrl.models import resolve_model_path

            model_path = str(resolve_model_path(cfg.model.path))
        build = sglang_command if r.engine == "sglang" else engine_command
        handles = []
        for i in range(r.num_servers):
            port = free_port(r.host) if r.base_port == 0 else r.base_port + i
            log_path = Path(log_dir) / f"rollout_server_{i}.log" if log_dir else None
            out: Any = subprocess.DEVNULL
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                out = open(log_path, "ab")
            child_env = dict(os.environ, **(env or {}))
            child_env.pop(ENGINE_API_KEY_ENV, None)
            if api_key and build is engine_command:
                child_env[ENGINE_API_KEY_ENV] = api_key
            # PR_SET_PDEATHSIG: an engine never outlives the process that launched it (asyncrl.core.process_guard)
            proc = subprocess.Popen(build(cfg, model_path, port, weight_version), stdout=out, stderr=subprocess.STDOUT,
                                    env=child_env, preexec_fn=pdeathsig_preexec())
            handles.append(ServerHandle(f"http://{r.host}:{port}", proc, log_path))
    try:
        async def ready(h: ServerHandle) -> None:
            async with EngineClient(h.url, api_key=api_key) as c:
                await c.wait_ready(ready_timeout_seconds, process=h.process)

        await asyncio.gather(*(ready(h) for h in handles))
    except BaseException:
        stop_servers(handles)
        raise
    return handles


def stop_servers(handles: list[ServerHandle]) -> None:
    """Stop every launched server (attached ones are left alone)."""
    for h in handles:
        h.stop()


__all__ += ["EngineUnavailable"]
