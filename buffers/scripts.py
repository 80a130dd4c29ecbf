"""Loads the Lua scripts of ``buffers/lua`` and runs them with errors mapped to :mod:`buffers.errors`.

Each script is ``prelude.lua`` (schema check, server time, helpers) + for buffer scripts
``settings.lua`` (settings and shared transitions) + its body. redis-py's ``register_script``
sends ``EVALSHA`` and reloads the script on ``NOSCRIPT`` (e.g. after a Redis restart).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from redis.exceptions import ResponseError

from buffers.errors import from_response

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
