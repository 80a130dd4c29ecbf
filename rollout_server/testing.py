"""Helpers for tests and benchmarks of rollout servers: real server processes, test models.

* :func:`start_embedded_server` runs ``python -m rollout_server.server`` as a child process
  on a free loopback port and waits until it is ready (a real process, real HTTP).
* :func:`make_random_model` writes a copy of an HF model directory whose matrices are redrawn
  with a larger scale. The tiny test model's greedy output repeats one token; redrawn at
  std 0.2 it produces long non-repeating greedy continuations with clear top-1 margins, which
  token-identity tests need. A different seed gives the "perturbed weights" of a weight update.
* :func:`greedy_reference` / :func:`recompute_logprobs` are the trainer-style references: one
  full forward pass per step (no KV cache), ``log_softmax(logits / T)`` in fp32.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.core.net import free_port
from rollout_server.client import EngineClient

__all__ = ["ServerProcess", "serve_app", "start_embedded_server", "make_random_model", "greedy_reference", "recompute_logprobs"]


@dataclass
class ServerProcess:
    """A running embedded server child process."""

    url: str
    process: subprocess.Popen
    api_key: str | None = None

    def client(self, **kw: Any) -> EngineClient:
        return EngineClient(self.url, api_key=kw.pop("api_key", self.api_key), **kw)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_embedded_server(model_dir: str | Path, *extra_args: str, api_key: str | None = None,
                          threads: int = 1, ready_timeout_seconds: float = 120.0, log_path: Path | None = None) -> ServerProcess:
    """Start ``python -m rollout_server.server`` on a free port and wait until it is ready.

    Raises:
        ConnectionError: the process exited or did not become ready (its log tail is in the message).
    """
    port = free_port()
    cmd = [sys.executable, "-m", "rollout_server.server", "--model-path", str(model_dir), "--port", str(port),
           "--engine-threads", str(threads), *extra_args]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    srv = ServerProcess(f"http://127.0.0.1:{port}", proc, api_key)

    async def wait() -> None:
        async with srv.client() as c:
            await c.wait_ready(ready_timeout_seconds, poll_seconds=0.2, process=proc)

    try:
        asyncio.run(wait())
    except BaseException as exc:
        srv.stop()
        tail = Path(log_path).read_text()[-2000:] if log_path and Path(log_path).exists() else ""
        raise ConnectionError(f"embedded server did not start: {exc}\n{tail}") from exc
    return srv


def make_random_model(src: str | Path, dst: str | Path, seed: int, std: float = 0.2) -> Path:
    """Copy the HF model directory ``src`` to ``dst`` with every matrix redrawn ~ N(0, std²)."""
    import torch
    from transformers import AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    if (dst / "model.safetensors").exists():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    for f in tmp.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(tmp)
    os.replace(tmp, dst) if not dst.exists() else shutil.rmtree(tmp)
    return dst


def greedy_reference(model: Any, prompt_ids: list[int], n_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by full recomputation (no cache): ``(token ids, log_softmax(logits)[token])``."""
    import torch

    ids, out, lps = list(prompt_ids), [], []
    with torch.no_grad():
        for _ in range(n_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            t = int(logits.argmax())
            out.append(t)
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
    return out, lps


def recompute_logprobs(model: Any, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
    """Trainer-style recomputation: one forward over prompt + response, ``log_softmax(logits / T)`` in fp32."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    P = len(prompt_ids)
    lsm = torch.log_softmax(logits[P - 1 : P - 1 + len(response_ids)] / temperature, dim=-1)
    return lsm.gather(1, torch.tensor(response_ids)[:, None]).squeeze(1).tolist()


@contextlib.asynccontextmanager
async def serve_app(app: Any, host: str = "127.0.0.1"):
    """Serve an ``aiohttp.web.Application`` on a free loopback port for the duration of the block.

    Yields:
        the port (int). The server is cleaned up on exit, also when the block raises.
    """
    from aiohttp import web

    from asyncrl.core.net import SERVER_KWARGS

    runner = web.AppRunner(app, **SERVER_KWARGS)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]
    finally:
        await runner.cleanup()
