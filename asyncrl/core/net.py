"""Free TCP ports: the one helper every role uses to pick a port nobody holds.

:func:`free_port` binds port 0 and releases it (the embedded Redis, test servers, the rendezvous
of the ``nccl`` weight transport, rollout servers with ``rollout.base_port`` 0);
:func:`ports_free` / :func:`free_port_range` find ``n`` consecutive free ports for the rollout
servers of ``asyncrl train``. A port found free can be taken by someone else before it is bound
again; callers that can retry do.

The HTTP servers of asyncrl that take request bodies (the rollout server, the agent sessions
app, the env server, the reward-model server) share three guards (issue #31 items 2 and 3): :data:`SERVER_KWARGS` (aiohttp never inflates
a compressed body and never lingers to read the rest of a body its handler refused),
:func:`content_encoding_refusal` (any ``Content-Encoding`` but ``identity`` is a 415 before auth
and before a byte of the body is read) and :func:`header_bytes` (a credential header with
characters no client sends is told apart from a wrong key, never a 500).
"""

from __future__ import annotations

import hmac
import socket
from collections.abc import Mapping

__all__ = ["SERVER_KWARGS", "PortRangeError", "content_encoding_refusal", "free_port", "free_port_range",
           "header_bytes", "ports_free"]

#: keyword arguments of ``web.AppRunner`` / ``web.run_app`` for every asyncrl server that takes
#: bodies: ``auto_decompress=False`` (a deflate bomb is never inflated: the parser would inflate
#: it as it arrives, before any handler could refuse it) and ``lingering_time=0`` (a body left
#: unread by a refusal closes the connection instead of being read for up to 10 s)
SERVER_KWARGS = {"auto_decompress": False, "lingering_time": 0.0}


def content_encoding_refusal(headers: Mapping[str, str]) -> str | None:
    """Why a request with these headers is refused for its ``Content-Encoding`` (None: it is not).

    No body encoding is accepted (send it uncompressed): an absent header or ``identity`` passes.
    The answer is a 415 given before auth and before the body is read (issue #31 item 2).
    """
    enc = headers.get("Content-Encoding", "")
    if enc.strip().lower() in ("", "identity"):
        return None
    shown = enc[:40].encode("ascii", "backslashreplace").decode()
    return (f"Content-Encoding {shown!r} is not accepted: send the request body uncompressed "
            "(no Content-Encoding header)")


def header_bytes(value: str) -> bytes | None:
    """A credential header's value as bytes, or None when it holds a non-ASCII character.

    aiohttp decodes header bytes as UTF-8 with ``surrogateescape``, so ``\\xff`` arrives as a lone
    surrogate that ``str.encode()`` cannot encode; keys are ASCII, so such a value is malformed.
    """
    try:
        return value.encode("ascii")
    except UnicodeEncodeError:
        return None


def presented_key(headers: Mapping[str, str]) -> tuple[str, bytes | None]:
    """The API key a request presents: ``Authorization: Bearer <key>``, else the ``x-api-key`` header.

    Returns:
        ``(header, key)``: the header's name (for an error message) and the key as bytes, ``b""``
        when none is given, None when it holds a non-ASCII character (:func:`header_bytes`).
    """
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return "Authorization", header_bytes(token.strip())
    return "x-api-key", header_bytes(headers.get("x-api-key", ""))


def key_matches(given: bytes | None, key: str) -> bool:
    """True when ``given`` (from :func:`presented_key`) is non-empty and equals ``key`` (constant time)."""
    return bool(given) and hmac.compare_digest(given, key.encode())


class PortRangeError(RuntimeError):
    """No ``n`` consecutive free ports were found (:func:`free_port_range`)."""


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
        PortRangeError: none found after a few tries.
    """
    for _ in range(50):
        first = free_port(host)
        if first + n <= 65535 and ports_free(host, first, n):
            return first
    raise PortRangeError(f"no {n} consecutive free ports on {host}: set --rollout.base_port")
