"""``asyncrl env-server --config F [flags]``: the environment-server role as its own process.

Serves the tools (:mod:`asyncrl.env_server.server`) on ``agent.env_server.host`` and
``agent.env_server.port`` (0: a free port, printed) with ``/health`` and ``/metrics`` on the
same port, until SIGTERM or SIGINT (explicit handlers, so it works as PID 1 in a container).
Then it drains: new calls get 503, the calls in flight are answered, and it exits 0 after
printing ``drained: N calls answered``.

Exit status: 0 after a drain, 1 when the drain timed out or the server failed (a port taken),
2 for a bad command line or config — the controller does not restart a role that exits 2.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

__all__ = ["main", "run_env_server"]


def _print(msg: str) -> None:
    print(f"asyncrl env-server: {msg}", flush=True)


async def run_env_server(cfg: Any, stop: asyncio.Event | None = None, ready: asyncio.Event | None = None) -> int:
    """Serve the tools until ``stop`` (or SIGTERM/SIGINT), then drain; returns the exit code.

    ``ready`` (optional) is set once the server accepts calls; the bound URL is printed.

    Raises:
        OSError: the port cannot be bound.
    """
    from aiohttp import web

    from asyncrl.core.net import SERVER_KWARGS, free_port
    from asyncrl.env_server.server import EnvServer, EnvServerOptions
    from asyncrl.metrics import role_registry

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    opts = EnvServerOptions.from_config(cfg)
    if opts.port == 0:
        opts.port = free_port(opts.host)
    registry, metrics = role_registry("env_server")
    server = EnvServer(opts, metrics=metrics, registry=registry)
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False, **SERVER_KWARGS)
    await runner.setup()
    try:
        await web.TCPSite(runner, opts.host, opts.port).start()
        _print(f"serving {', '.join(sorted(server.tools))} on http://{opts.host}:{opts.port} (POST /tools/<name>, "
               f"/health, /metrics); deadline {opts.deadline_seconds:g} s per call, {opts.max_concurrent_calls} calls "
               f"at once, latency: {opts.latency.describe()}")
        if ready is not None:
            ready.set()
        await stop.wait()
        answered_before = server.answered
        drained = await server.drain()
        _print(f"drained: {server.answered - answered_before} calls answered after the stop signal"
               + ("" if drained else f"; {server.in_flight} calls left after agent.env_server.drain_timeout_seconds="
                  f"{opts.drain_timeout_seconds:g}"))
        return 0 if drained else 1
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl env-server``; returns the exit code."""
    from asyncrl.core.config import ConfigError
    from asyncrl.core.config_cli import config_from_argv

    cfg = config_from_argv(list(argv), "env-server")
    if isinstance(cfg, int):
        return cfg
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run_env_server(cfg))
    except (ConfigError, ValueError) as exc:
        print(f"asyncrl env-server: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the port is taken, ...
        print(f"asyncrl env-server: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
