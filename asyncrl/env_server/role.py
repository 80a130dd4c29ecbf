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
import sys
from typing import Any

__all__ = ["main", "run_env_server"]


async def run_env_server(cfg: Any, stop: asyncio.Event | None = None, ready: asyncio.Event | None = None) -> int:
    """Serve the tools until ``stop`` (or SIGTERM/SIGINT), then drain; returns the exit code.

    ``ready`` (optional) is set once the server accepts calls; the bound URL is printed.

    Raises:
        OSError: the port cannot be bound.
    """
    from asyncrl.core.net import SERVER_KWARGS, free_port
    from asyncrl.core.serving import serve_until_stopped, stop_on_signals
    from asyncrl.env_server.server import EnvServer, EnvServerOptions
    from asyncrl.metrics import role_registry

    stop = stop_on_signals(stop)
    opts = EnvServerOptions.from_config(cfg)
    if opts.port == 0:
        opts.port = free_port(opts.host)
    registry, metrics = role_registry("env_server")
    server = EnvServer(opts, metrics=metrics, registry=registry)
    return await serve_until_stopped(
        "env-server", server, server.app(), opts.host, opts.port, stop=stop, ready=ready, what="calls",
        banner=f"serving {', '.join(sorted(server.tools))} on http://{opts.host}:{opts.port} (POST /tools/<name>, "
               f"/health, /metrics); deadline {opts.deadline_seconds:g} s per call, {opts.max_concurrent_calls} calls "
               f"at once, latency: {opts.latency.describe()}",
        left=lambda: f"{server.in_flight} calls left after agent.env_server.drain_timeout_seconds="
                     f"{opts.drain_timeout_seconds:g}",
        runner_kwargs=SERVER_KWARGS)


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl env-server``; returns the exit code."""
    from asyncrl.core.serving import role_main

    return role_main(argv, "env-server", run_env_server)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
