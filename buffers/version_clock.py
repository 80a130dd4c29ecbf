"""The policy-version clock, lineage and weight announcements, kept in Redis.

The clock is the newest *published* policy version (docs/architecture.md#vocabulary). It moves forward only
through a compare-and-set script (:meth:`VersionClock.publish`), which also writes
``weights:latest`` (version, uri, checksum, lineage) and publishes the same JSON on the run's
``weights`` channel. The one exception is a recovery rewind (``ReplayBuffer.recover``), which
increases the lineage counter. Pub/sub messages can be missed (a worker that is reconnecting
sees nothing), so workers both subscribe and poll :meth:`VersionClock.latest`.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from asyncrl.core.types import WeightAnnouncement
from buffers.errors import BadRequest
from buffers.keys import SCHEMA_VERSION, key_prefix
from buffers.scripts import Scripts

__all__ = ["VersionClock"]


class VersionClock:
    """Clock, lineage and announcements of one run.

    Args:
        redis: a ``redis.asyncio.Redis`` (``decode_responses=False``), shared with the buffer.
        run: run name (key prefix ``asyncrl:{<run>}:``).
        scripts: registered scripts (the buffer passes its own; None registers them).
        origin: ``role@host`` of this process, recorded with each publish in the run's timeline
            (docs/buffer.md#timeline); empty records nothing.
    """

    def __init__(self, redis: Any, run: str, scripts: Scripts | None = None, origin: str = "") -> None:
        self.redis = redis
        self.origin = origin  # 'role@host' recorded with each publish in the run's timeline ('' = none)
        self.run = run
        self.prefix = key_prefix(run)
        self.channel = self.prefix + "weights"
        self._scripts = scripts or Scripts(redis)

    async def version(self) -> int:
        """The clock: newest published policy version (0 before any publish)."""
        raw = await self.redis.get(self.prefix + "version")
        return int(raw or 0)

    async def lineage(self) -> int:
        """Lineage counter: increases with every recovery rewind (0 at the start)."""
        raw = await self.redis.get(self.prefix + "lineage")
        return int(raw or 0)

    async def publish(
        self, version: int, uri: str, checksum: str, expected_version: int | None = None
    ) -> WeightAnnouncement:
        """Move the clock to ``version`` and announce the weights (one script).

        Args:
            version: the new policy version; must be newer than the clock.
            uri: where the weights are (directory, ``http://`` URL, ``nccl://``).
            checksum: checksum of the weight files (e.g. ``sha256:<hex>``).
            expected_version: when given, the clock must equal it (compare-and-set).

        Raises:
            VersionConflict: not newer than the clock, or the clock differs from ``expected_version``.
            BadRequest: ``version`` is negative or ``uri`` is empty.
            SchemaMismatch: the run keyspace is not open (no schema key) or incompatible.
        """
        if int(version) < 0 or not uri:
            raise BadRequest(f"publish needs a version >= 0 and a uri (got {version!r}, {uri!r})")
        res = await self._scripts.run(
            "publish",
            [self.prefix + "stats"],
            [self.prefix, SCHEMA_VERSION, int(version), uri, checksum,
             "" if expected_version is None else int(expected_version), self.channel, self.origin],
        )
        return WeightAnnouncement(int(res[0]), uri, checksum, int(res[1]), int(res[2]))

    async def latest(self) -> WeightAnnouncement | None:
        """The newest announcement (poll), or None before any publish."""
        raw = await self.redis.hgetall(self.prefix + "weights:latest")
        if not raw:
            return None
        return _announcement({k.decode(): v.decode() for k, v in raw.items()})

    async def subscribe(self) -> AsyncIterator[WeightAnnouncement]:
        """Async iterator of announcements from the ``weights`` channel (pub/sub).

        Messages published while not connected are lost: poll :meth:`latest` as well.
        """
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(self.channel)
        try:
            async for msg in pubsub.listen():
                if msg.get("type") == "message":
                    yield _announcement(json.loads(msg["data"]))
        finally:
            await pubsub.unsubscribe(self.channel)
            await pubsub.aclose()

    async def wait_for(self, version: int, timeout_seconds: float | None = None, poll_seconds: float = 0.05) -> int:
        """Wait until the clock is at least ``version``; returns the clock.

        Raises:
            TimeoutError: not reached within ``timeout_seconds``.
        """
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        while True:
            v = await self.version()
            if v >= version:
                return v
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"policy version {version} not published within {timeout_seconds}s (clock {v})")
            await asyncio.sleep(poll_seconds)


def _announcement(d: dict[str, Any]) -> WeightAnnouncement:
    return WeightAnnouncement(
        version=int(d["version"]), uri=str(d["uri"]), checksum=str(d["checksum"]),
        lineage=int(d.get("lineage", 0)), published_ms=int(d.get("published_ms", 0)),
    )
