"""Shared pieces of the crash-test processes: settings, the deterministic fake generator,
crash points (a real SIGKILL of the process itself) and retries while Redis restarts.

The fake generator stands in for the engine: sample ``sid`` has the response
``expected_tokens(sid)`` (length 1..MAX_LEN) whatever happens, so the reconciliation can
check that no chunk was lost or duplicated; ``reward_fails(sid)`` makes some reward
functions fail, so groups are also dropped (reason ``reward_error``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import zlib
from pathlib import Path

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from buffers import BufferSettings  # noqa: E402

MAX_LEN = 20
#: ASYNCRL_TEST_SAMPLING=1 (set by the test): best-of-n (3 generated, best 2 trained) and dynamic sampling on
SAMPLING = os.environ.get("ASYNCRL_TEST_SAMPLING") == "1"
SETTINGS = BufferSettings(
    rollout_batch_size=4, train_batch_groups=2, n_samples_per_prompt=2, max_budget=6,
    max_response_len=MAX_LEN, max_staleness=1, stale_policy="restart", lease_seconds=0.5, flush_tokens=4,
    generation_size=3 if SAMPLING else 0, dynamic_sampling=SAMPLING,
)
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def h(sid: str) -> int:
    return zlib.crc32(sid.encode())


def expected_len(sid: str) -> int:
    return 1 + h(sid) % MAX_LEN


def expected_tokens(sid: str) -> list[int]:
    return [(h(sid) + 7 * t) % 1000 for t in range(expected_len(sid))]


def reward_fails(sid: str) -> bool:
    return h(sid) % 13 == 0


def group_ids(total: int) -> list[str]:
    return [f"q{i:04d}" for i in range(total)]


class Crasher:
    """Kills this process with SIGKILL at the ``at``-th occurrence of crash point ``kind``."""

    def __init__(self, kind: str, at: int) -> None:
        self.kind, self.at, self.seen = kind, at, 0

    def point(self, kind: str) -> None:
        if kind == self.kind:
            self.seen += 1
            if self.seen == self.at:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)


async def retry(fn, *args, attempts: int = 400, **kw):
    """Call ``await fn(*args)`` until Redis answers (it may be restarting from its AOF)."""
    for i in range(attempts):
        try:
            return await fn(*args, **kw)
        except TRANSIENT:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"redis unreachable for {attempts} attempts")


async def open_buffer(url: str, run: str):
    from buffers import ReplayBuffer

    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, decode_responses=False, socket_timeout=5)
    return await retry(ReplayBuffer.open, client, run, SETTINGS)


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
