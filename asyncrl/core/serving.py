"""How an HTTP role serves until it is told to stop, then drains: one way for every such role.

The environment server (``asyncrl env-server``) and the reward model (``asyncrl reward-model``) run
the same life: SIGTERM or SIGINT set a stop event (explicit loop handlers, so the role also works
as PID 1 in a container); the app is served on its host and port and a banner printed; on the stop
the server drains (new requests get 503, the ones in flight are answered) and the role exits 0, or
1 when the drain timed out, after printing ``drained: N <what> answered after the stop signal``.
Its command line is a config (:func:`asyncrl.core.config_cli.config_from_argv`), and a bad one exits 2
so that the controller does not restart the role (docs/architecture.md#operations).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any, Awaitable, Callable, Protocol

__all__ = ["Drainable", "role_main", "say", "serve_until_stopped", "stop_on_signals"]


class Drainable(Protocol):
    """A server that counts the requests it answered and can drain (stop taking new ones, finish the rest)."""

    answered: int

    async def drain(self) -> bool:
        """Refuse new requests and wait for the ones in flight; False when its drain deadline passed first."""


def say(command: str, msg: str) -> None:
    """Print ``asyncrl <command>: <msg>`` on stdout, flushed (the controller forwards role logs line by line)."""
    print(f"asyncrl {command}: {msg}", flush=True)


def stop_on_signals(stop: asyncio.Event | None = None) -> asyncio.Event:
    """``stop`` (a new event when None), set by SIGTERM and SIGINT from now on in the running loop."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_until_stopped(command: str, server: Drainable, app: Any, host: str, port: int, *, banner: str,
                              stop: asyncio.Event, ready: asyncio.Event | None, what: str,
                              left: Callable[[], str], runner_kwargs: dict[str, Any] | None = None) -> int:
    """Serve ``app`` on ``host:port`` until ``stop``, then drain ``server``; returns the exit code (0 drained, 1 not).

    Args:
        command: the role's subcommand (``env-server``), the prefix of what it prints.
        server: the server behind ``app``, drained on the stop.
        banner: printed once the port is bound; ``ready`` (optional) is set then.
        what: what ``server.answered`` counts (``calls``, ``requests``), for the drain line.
        left: what was left when the drain timed out (called only then), appended to the drain line.
        runner_kwargs: extra keyword arguments of ``web.AppRunner`` (e.g. :data:`asyncrl.core.net.SERVER_KWARGS`).

    Raises:
        OSError: the port cannot be bound.
    """
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None, handle_signals=False, **(runner_kwargs or {}))
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        say(command, banner)
        if ready is not None:
            ready.set()
        await stop.wait()
        answered_before = server.answered
        drained = await server.drain()
        say(command, f"drained: {server.answered - answered_before} {what} answered after the stop signal"
            + ("" if drained else f"; {left()}"))
        return 0 if drained else 1
    finally:
        await runner.cleanup()


def role_main(argv: list[str], command: str, run: Callable[[Any], Awaitable[int]],
              config_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Entry point of a config-driven role: resolve the config from ``argv``, log at INFO, ``asyncio.run(run(cfg))``.

    Returns:
        what ``run`` returns; 0 after ``--help``; 2 for a bad command line or config (a
        :class:`~asyncrl.core.config.ConfigError`, a ``ValueError`` or one of ``config_errors``, printed
        with the command's name); 1 for any other ``OSError`` (a port taken, ...).
    """
    from asyncrl.core.config import ConfigError
    from asyncrl.core.config_cli import config_from_argv

    cfg = config_from_argv(list(argv), command)
    if isinstance(cfg, int):
        return cfg
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run(cfg))
    except (ConfigError, ValueError, *config_errors) as exc:
        print(f"asyncrl {command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the server could not bind or serve (e.g. its port is taken): exit 1
        print(f"asyncrl {command}: {exc}", file=sys.stderr)
        return 1
