"""Waiting out a dependency's outage: Redis restarting is not a crash of the role that uses it.

When the buffer's Redis dies and comes back (the controller restarts the embedded server on its
AOF; a Kubernetes StatefulSet restarts its pod), every role loses its connections at once. A role
that crashed on that would be restarted by its supervisor — a trainer from its last checkpoint,
redoing the steps since — and every outage would use up restarts meant for the role's own
crashes. Instead, a role runs its buffer calls through :class:`OutageGuard`: a connection error
(or Redis still loading its AOF) is retried with exponential backoff (0.1 s doubling to 5 s, as
redis-py's ``ExponentialBackoff``), one WARNING line is printed when the outage begins and one
line when it ends, and only when the outage lasts longer than the deadline does the call fail,
loudly, with :class:`DependencyOutage` naming the role and what it waited for.

Only calls that are safe to repeat go through the guard: reads, and buffer transitions that are
idempotent or compare-and-set (a feed whose reply was lost fails its cursor check on the retry
and changes nothing; acknowledging a step twice is harmless; a batch not acknowledged is handed
out again). docs/architecture.md#operations describes the policy.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["DependencyOutage", "OutageGuard", "outage_errors"]

T = TypeVar("T")


class DependencyOutage(RuntimeError):
    """A dependency stayed unreachable past the deadline; the message names the role and the wait."""


def outage_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "Redis is down or restarting", not "the request is wrong":
    redis-py's ``ConnectionError`` (refused, reset, closed), ``TimeoutError`` and
    ``BusyLoadingError`` (a restarted server replaying its AOF). Not ``OSError``: a missing file
    is not an outage."""
    from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

    return (ConnectionError, TimeoutError, BusyLoadingError)


class OutageGuard:
    """Retry buffer calls through an outage of Redis, with a deadline.

    Args:
        role: the role's name for messages (``trainer``, ``feeder``, ``rollout-0``).
        deadline_seconds: how long one outage may last before :class:`DependencyOutage`.
        dependency: what is waited for, in messages.
        first_backoff_seconds, max_backoff_seconds: exponential backoff bounds.
        out: where the WARNING and recovery lines go (default: stderr).

    One guard is shared by all the calls of a process: concurrent calls during one outage print
    one WARNING line together (:attr:`outages` counts the outages seen).
    """

    def __init__(self, role: str, deadline_seconds: float, dependency: str = "Redis", *,
                 first_backoff_seconds: float = 0.1, max_backoff_seconds: float = 5.0, out=None) -> None:
        if deadline_seconds <= 0:
            raise ValueError(f"deadline_seconds must be > 0, got {deadline_seconds}")
        self.role = role
        self.dependency = dependency
        self.deadline_seconds = float(deadline_seconds)
        self.first_backoff = first_backoff_seconds
        self.max_backoff = max_backoff_seconds
        self.out = out
        self.outages = 0
        self._down_since: float | None = None

    def _print(self, line: str) -> None:
        print(line, file=self.out or sys.stderr, flush=True)

    @property
    def down(self) -> bool:
        """True while an outage is being waited out."""
        return self._down_since is not None

    async def call(self, fn: Callable[[], Awaitable[T]], what: str,
                   give_up: Callable[[], bool] | None = None) -> T:
        """``await fn()``, retried while the dependency is unreachable.

        Args:
            fn: makes a fresh awaitable per attempt (a coroutine cannot be awaited twice).
            what: what the role is doing, for messages ("waiting for the batch of step 7").
            give_up: checked between attempts; when it returns True (the role is stopping) the
                wait ends at once with :class:`DependencyOutage`.

        Raises:
            DependencyOutage: still unreachable ``deadline_seconds`` after the outage began.
            Any other exception of ``fn`` unchanged.
        """
        errors = outage_errors()
        backoff = self.first_backoff
        while True:
            try:
                result = await fn()
            except errors as exc:
                now = time.monotonic()
                if self._down_since is None:
                    self._down_since = now
                    self.outages += 1
                    self._print(f"WARNING asyncrl {self.role}: {self.dependency} unreachable while {what} "
                                f"({type(exc).__name__}: {exc}); waiting up to {self.deadline_seconds:.0f} s "
                                "for it to come back (an outage is not a crash)")
                waited = now - self._down_since
                if give_up is not None and give_up():
                    raise DependencyOutage(f"asyncrl {self.role}: stopped while {self.dependency} was unreachable "
                                           f"({what})") from exc
                if waited >= self.deadline_seconds:
                    raise DependencyOutage(
                        f"asyncrl {self.role}: {self.dependency} has been unreachable for {waited:.0f} s "
                        f"(deadline {self.deadline_seconds:.0f} s, buffer.outage_seconds) while {what}; "
                        f"last error {type(exc).__name__}: {exc}") from exc
                pause = min(backoff, max(0.0, self.deadline_seconds - waited))
                if give_up is None:
                    await asyncio.sleep(pause)
                else:  # a stop is noticed within 0.25 s, not after a backoff of up to 5 s
                    end = time.monotonic() + pause
                    while (left := end - time.monotonic()) > 0 and not give_up():
                        await asyncio.sleep(min(left, 0.25))
                backoff = min(backoff * 2, self.max_backoff)
                continue
            if self._down_since is not None:
                self._print(f"asyncrl {self.role}: {self.dependency} is back after "
                            f"{time.monotonic() - self._down_since:.1f} s")
                self._down_since = None
            return result
