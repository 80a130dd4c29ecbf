"""Loads the Lua scripts of ``buffers/lua`` and runs them with errors mapped to :mod:`buffers.errors`.

Each script is ``prelude.lua`` (schema check, server time, helpers) + for buffer scripts
``settings.lua`` (settings and shared transitions) + its body. redis-py's ``register_script``
sends ``EVALSHA`` and reloads the script on ``NOSCRIPT`` (e.g. after a Redis restart).
"""

from __future__ import annotations

import asyncio
from functools import lru_cache
from pathlib import Path
from typing import Any

from redis.exceptions import ResponseError

from buffers.errors import error_for, from_response

LUA_DIR = Path(__file__).with_name("lua")
BUFFER_SCRIPTS = ("feed", "claim", "append", "score", "renew", "next_batch", "ack", "commit", "recover")
CLOCK_SCRIPTS = ("publish",)


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """Full Lua source of script ``name`` (prelude + settings for buffer scripts + body)."""
    parts = [(LUA_DIR / "prelude.lua").read_text()]
    if name in BUFFER_SCRIPTS:
        parts.append((LUA_DIR / "settings.lua").read_text())
    parts.append((LUA_DIR / f"{name}.lua").read_text())
    return "\n".join(parts)


class Scripts:
    """The registered scripts of one client; ``await scripts.run(name, keys, args)``."""

    def __init__(self, redis: Any) -> None:
        self._scripts = {n: redis.register_script(source(n)) for n in BUFFER_SCRIPTS + CLOCK_SCRIPTS}

    async def run(self, name: str, keys: list[Any], args: list[Any]) -> Any:
        """Run script ``name``; raises the :mod:`buffers.errors` class of its error reply."""
        try:
            return await self._scripts[name](keys=keys, args=args)
        except ResponseError as exc:
            raise from_response(exc) from None


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


class Coalescer:
    """Coalesces concurrent per-item calls of one multi-item script into one ``EVALSHA``.

    The rollout worker's tasks each append their own chunk; calls made while a flush is in
    flight are queued and sent together in the next one (at most ``max_items`` per call), so
    64 streams cost one round trip per round instead of 64 (redis-py has no auto-pipelining).
    Items stay independent: each is validated before it writes and gets its own result or
    :mod:`buffers.errors` exception; a transport error fails every item of that call.

    Args:
        call: ``await call(n_items, *flat_args)`` runs the script and returns one reply per item.
        decode: turns one item's reply into its result, or returns the exception to raise.
        max_items: most items per script call (bounds the time Redis spends in one script).
    """

    def __init__(self, call: Any, decode: Any, max_items: int = 128) -> None:
        self._call = call
        self._decode = decode
        self._max = max_items
        self._queue: list[tuple[list[Any], asyncio.Future]] = []
        self._task: asyncio.Task | None = None

    async def submit(self, args: list[Any]) -> Any:
        """Queue one item; returns its decoded result or raises its error."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((args, fut))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        while True:
            await asyncio.sleep(0)  # let the ready tasks (e.g. those woken by the last reply) queue items
            if not self._queue:
                return
            batch, self._queue = self._queue[: self._max], self._queue[self._max:]
            flat = [a for args, _ in batch for a in args]
            try:
                replies = await self._call(len(batch), *flat)
            except BaseException as exc:  # noqa: BLE001 - delivered to every caller of this batch
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for (_, fut), reply in zip(batch, replies):
                if fut.done():
                    continue
                try:
                    res = self._decode(reply)
                except Exception as exc:  # noqa: BLE001 - a decoding failure belongs to its caller
                    res = exc
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)


def decode_error(reply: bytes) -> Exception:
    """The exception of a per-item error reply ``b'<CODE> <message>'``."""
    code, _, msg = _s(reply).partition(" ")
    return error_for(code, msg)
