"""Cancellation-safe waits (asyncrl.core.aio): the fix for a worker that never finished shutting down.

The race is deterministic: an event set in the same loop tick as the waiting task is
cancelled. On Python < 3.12, ``asyncio.wait_for`` loses that cancellation (the first test
documents it where it still happens); :func:`asyncrl.core.aio.wait_event` never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest

from asyncrl.core.aio import cancel_and_wait, wait_event


def _poller(event: asyncio.Event, wait) -> asyncio.Task:
    """A version-watcher-shaped loop: wait for ``event`` with a 0.1 s timeout, clear it, repeat."""

    async def loop() -> None:
        while True:
            await wait(event)
            event.clear()

    return asyncio.create_task(loop(), name="poller")


async def _wait_for(event: asyncio.Event) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), 0.1)


async def _set_and_cancel_in_one_tick(task: asyncio.Task, event: asyncio.Event) -> bool:
    """Set ``event`` and cancel ``task`` in the same tick; True if the task ended within 1 s."""
    await asyncio.sleep(0.02)  # the poller is inside its wait
    event.set()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    return bool(done)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython >= 3.12 fixed wait_for (gh-86296)")
async def test_wait_for_loses_a_cancellation_on_this_python():
    """The bug being guarded against, reproduced (so the next test is known to cover it)."""
    event = asyncio.Event()
    task = _poller(event, _wait_for)
    assert not await _set_and_cancel_in_one_tick(task, event)  # the cancellation was swallowed
    assert await cancel_and_wait([task]) == set()  # and cancel_and_wait still ends it


async def test_wait_event_propagates_a_cancellation_in_the_same_tick():
    event = asyncio.Event()
    task = _poller(event, lambda e: wait_event(e, 0.1))
    assert await _set_and_cancel_in_one_tick(task, event)
    assert task.cancelled()


async def test_wait_event_returns_whether_the_event_was_set():
    event = asyncio.Event()
    assert await wait_event(event, 0.05) is False
    assert await wait_event(event, 0) is False
    asyncio.get_running_loop().call_later(0.02, event.set)
    assert await wait_event(event, 5.0) is True
    assert await wait_event(event, None) is True  # already set: at once
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]  # no waiter left behind


async def test_cancel_and_wait_recancels_a_task_that_swallows_cancellations():
    swallowed = []

    async def stubborn() -> None:
        for _ in range(3):  # ignores two cancellations, like a library that loses them
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed.append(1)
        await asyncio.sleep(10)

    async def failing() -> None:
        raise ValueError("boom")

    t1 = asyncio.create_task(stubborn(), name="stubborn")
    t2 = asyncio.create_task(failing(), name="failing")
    await asyncio.sleep(0.01)
    assert await cancel_and_wait([t1, t2], timeout_seconds=5.0, recancel_seconds=0.05) == set()
    assert len(swallowed) == 3 and t1.cancelled() and isinstance(t2.exception(), ValueError)


async def test_cancel_and_wait_gives_up_after_its_timeout_and_names_the_task(caplog):
    alive = [True]

    async def immortal() -> None:
        while alive[0]:
            with contextlib.suppress(asyncio.CancelledError):  # ignores every cancellation while alive
                await asyncio.sleep(10)

    t = asyncio.create_task(immortal(), name="immortal")
    await asyncio.sleep(0.01)
    with caplog.at_level("WARNING", logger="asyncrl.core.aio"):
        left = await cancel_and_wait([t], timeout_seconds=0.2, recancel_seconds=0.05)
    assert left == {t} and "immortal" in caplog.text
    alive[0] = False
    t.cancel()
    await asyncio.wait({t}, timeout=1.0)
    assert t.done()
