"""Free TCP ports: the one helper every role uses to pick a port nobody holds.

:func:`free_port` binds port 0 and releases it (the embedded Redis, test servers, the rendezvous
of the ``nccl`` weight transport, rollout servers with ``rollout.base_port`` 0);
:func:`ports_free` / :func:`free_port_range` find ``n`` consecutive free ports for the rollout
servers of ``asyncrl train``. A port found free can be taken by someone else before it is bound
again; callers that can retry do.
"""

from __future__ import annotations

import socket

__all__ = ["free_port", "ports_free", "free_port_range"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (bind to port 0 and release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ports_free(host: str, first: int, n: int) -> bool:
    """True when ports ``first .. first + n - 1`` can be bound on ``host`` now by a server.

    Binds with ``SO_REUSEADDR``, as aiohttp's and asyncio's servers do on Unix: connections of
    an earlier server lingering in TIME_WAIT do not make a port busy for them (without the
    option, a resumed run found its own previous rollout port "busy" for a minute).
    """
    for port in range(first, first + n):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_port_range(host: str, n: int) -> int:
    """First port of ``n`` consecutive free ports on ``host``.

    Raises:
        ControllerError: none found after a few tries.
    """
    for _ in range(50):
        first = free_port(host)
        if first + n <= 65535 and ports_free(host, first, n):
            return first
    from asyncrl.controller import ControllerError  # the rollout ports of ``asyncrl train``

    raise ControllerError(f"no {n} consecutive free ports on {host}: set --rollout.base_port")
