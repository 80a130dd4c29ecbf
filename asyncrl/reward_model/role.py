"""``asyncrl reward-model --config F [flags]``: the reward-model role as its own process.

Serves ``reward.model.path`` (:mod:`asyncrl.reward_model.server`) on ``reward.model.host`` and
``reward.model.port`` (0: a free port, printed) with ``/metrics`` on the same port, until
SIGTERM or SIGINT (explicit handlers, so it works as PID 1 in a container). Then it drains:
new requests get 503, the texts already queued are scored and answered, and it exits 0 after
printing ``drained: N requests answered``.

Exit status: 0 after a drain, 1 when the drain timed out or the server failed, 2 for a bad
command line or config (``reward.model.path`` unset, a model that does not load as a
sequence-classification model, a label index the model does not have) — the controller does
not restart a role that exits 2.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

__all__ = ["main", "run_reward_model_server"]


def _print(msg: str) -> None:
    print(f"asyncrl reward-model: {msg}", flush=True)


async def run_reward_model_server(cfg: Any, stop: asyncio.Event | None = None,
                                  ready: asyncio.Event | None = None) -> int:
    """Serve the reward model until ``stop`` (or SIGTERM/SIGINT), then drain; returns the exit code.

    ``ready`` (optional) is set once the server accepts requests; the bound port is printed.

    Raises:
        ValueError: ``reward.model.path`` unset, the model does not load as a
            sequence-classification model, or ``label_index`` is out of range.
        asyncrl.models.ModelNotFoundError: ``reward.model.path`` cannot be resolved.
    """
    rm = cfg.reward.model
    if rm.path is None:
        raise ValueError("reward.model.path is not set: give the reward model's directory "
                         "(--reward.model.path DIR, an AutoModelForSequenceClassification checkpoint)")
    from aiohttp import web

    from asyncrl.metrics import role_registry
    from asyncrl.models import resolve_model_path
    from asyncrl.core.net import free_port
    from asyncrl.reward_model.server import RewardModelOptions, RewardModelServer

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    path = str(resolve_model_path(rm.path))
    opts = RewardModelOptions.from_config(cfg, path)
    if opts.port == 0:
        opts.port = free_port(opts.host)
    registry, metrics = role_registry("reward_model")
    server = RewardModelServer(opts, metrics=metrics, registry=registry)
    await loop.run_in_executor(None, server.load)
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, opts.host, opts.port).start()
        _print(f"serving {path} ({server.device}) on http://{opts.host}:{opts.port} (POST /score, /health, /metrics; "
               f"batches of <= {opts.max_batch_size} texts, {opts.batch_wait_ms:g} ms wait)")
        if ready is not None:
            ready.set()
        await stop.wait()
        answered_before = server.answered
        drained = await server.drain()
        _print(f"drained: {server.answered - answered_before} requests answered after the stop signal"
               + ("" if drained else f"; {server.batcher.pending if server.batcher else 0} texts left after "
                  f"reward.model.drain_timeout_seconds={opts.drain_timeout_seconds:g}"))
        return 0 if drained else 1
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl reward-model``; returns the exit code."""
    from asyncrl.core.config import ConfigError
    from asyncrl.core.config_cli import config_from_argv
    from asyncrl.models import ModelNotFoundError

    cfg = config_from_argv(list(argv), "reward-model")
    if isinstance(cfg, int):
        return cfg
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run_reward_model_server(cfg))
    except (ConfigError, ValueError, FileNotFoundError, ModelNotFoundError) as exc:
        print(f"asyncrl reward-model: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the port is taken, ...
        print(f"asyncrl reward-model: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
