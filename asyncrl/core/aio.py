"""Cancellation-safe asyncio waits used by every long-lived asyncrl task.

Python 3.10 and 3.11's :func:`asyncio.wait_for` can swallow a cancellation: when the awaited
thing completes in the same event-loop tick as the task running ``wait_for`` is cancelled,
``wait_for`` returns the result and the ``CancelledError`` is lost (CPython gh-86296, fixed in
3.12 by rewriting ``wait_for`` on top of ``asyncio.timeout``). A polling loop such as the rollout
worker's version watcher (``while True: wait_for(event.wait(), 0.1)``) then never ends, and
whoever cancelled it and awaits it — a worker shutting down — hangs forever. This happened to
``tests/test_rollout_worker.py::test_weight_update_mid_stream`` about once in twenty runs.

asyncrl supports Python >= 3.10, so it never relies on ``wait_for`` for long-lived loops:

* :func:`wait_event` waits for an :class:`asyncio.Event` with a timeout via
  :func:`asyncio.wait`, which never swallows a cancellation;
* :func:`cancel_and_wait` cancels tasks and keeps cancelling until they end (a task may
  swallow one cancellation through third-party code), with a bound, so shutdown always returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass; True if it is set.

    Unlike ``asyncio.wait_for(event.wait(), timeout)`` on Python < 3.12, a cancellation of the
    calling task always propagates (``CancelledError``), even when the event is set in the same
    event-loop tick.

    Args:
        event: the event to wait for.
        timeout: seconds (``None``: no limit; ``<= 0``: just check).
    """
    if event.is_set():
        return True
    if timeout is not None and timeout <= 0:
        return False
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        if not waiter.done():
            waiter.cancel()
    return event.is_set()


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout_seconds: float = 10.0,
                          recancel_seconds: float = 0.5) -> set[asyncio.Task]:
    """Cancel ``tasks`` and wait until all of them have ended, cancelling again if one goes on.

    A task that swallowed a cancellation (see the module docstring) is cancelled again every
    ``recancel_seconds``. Exceptions of the tasks are retrieved (so asyncio does not log them as
    never retrieved) and not raised.

    Returns:
        the tasks still running after ``timeout_seconds`` (logged; empty when all ended).
    """
    pending = {t for t in tasks if not t.done()}
    deadline = time.monotonic() + timeout_seconds
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("%d task(s) ignored cancellation for %.0f s: %s", len(pending), timeout_seconds,
                        ", ".join(sorted(t.get_name() for t in pending)))
            break
        _, pending = await asyncio.wait(pending, timeout=min(recancel_seconds, left))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()
    return pending
