"""The per-version budget rule in one place: the buffer's scripts decide it, buffers/budget.py mirrors it.

Every case is run through the real scripts (a real redis-server) and, token for token, through
:class:`buffers.budget.VersionBudget`, the copy an episode's model calls use between two appends
(rollout_server/episodes.py). After every write the stored window (``bver``, ``bused``) must be the
Python one, a claim must hand out what the Python window allows, and a segment ended with
``abort`` must be parked at the budget exactly when the Python window says it is spent.
"""

from __future__ import annotations

import pytest

from asyncrl.core.types import SampleStatus
from buffers import BufferSettings, ReplayBuffer
from buffers.budget import VersionBudget

M, L = 4, 32

# (event, argument): "append" versions (chunk, the segment goes on), "turn" versions (an episode's
# model call ends), "abort" / "length" versions (the segment ends: resumable / parked), "obs" k
# (k environment tokens), "publish" v (the clock moves to v), "claim" (the sample is claimed again)
CASES = {
    "one window fills up": [("append", [0, 0]), ("turn", [0]), ("abort", [0])],
    "observations are not counted": [("turn", [0, 0]), ("obs", 3), ("turn", [0]), ("obs", 2), ("abort", [0])],
    "a newer version opens a new window mid-claim": [
        ("turn", [0, 0, 0]), ("publish", 1), ("turn", [1]), ("abort", [1, 1])],
    "one chunk across two versions": [("append", [0, 0, 0]), ("publish", 1), ("turn", [0, 1, 1]), ("abort", [1, 1])],
    "old-version tokens after the window moved are not counted": [
        ("append", [0]), ("publish", 1), ("append", [1]), ("turn", [0, 0]), ("abort", [1, 1])],
    "resume under the same version keeps the window": [
        ("abort", [0, 0]), ("claim", None), ("turn", [0]), ("abort", [0])],
    "resume after a newer version starts a fresh window": [
        ("length", [0, 0, 0, 0]), ("publish", 1), ("claim", None), ("turn", [1]), ("abort", [1, 1, 1])],
    "an idle resume restarts the window under the same version": [
        ("length", [0, 0, 0, 0]), ("claim", None), ("turn", [0, 0]), ("abort", [0])],
}


async def _window(buf: ReplayBuffer, sid: str) -> tuple[int, int]:
    """The buffer's stored budget window of ``sid``: ``(bver, bused)``."""
    bver, bused = await buf.redis.hmget(buf.prefix + f"sample:{sid}", "bver", "bused")
    return int(bver), int(bused)


async def _check_window(buf: ReplayBuffer, sid: str, py: VersionBudget, clock_at_claim: int) -> None:
    bver, bused = await _window(buf, sid)
    if bver == py.version:
        assert bused == py.used, (bver, bused, py)
    else:  # a claim found a window older than the clock: kept by the buffer until the next token
        assert bver < clock_at_claim == py.version and py.used == 0, (bver, bused, py)


@pytest.mark.parametrize("case", list(CASES))
async def test_python_window_is_the_buffers(case, redis_url):
    settings = BufferSettings(rollout_batch_size=1, train_batch_groups=1, n_samples_per_prompt=1,
                              max_budget_tokens=M, max_response_len=L, max_staleness=2)
    async with await ReplayBuffer.open(redis_url, "budget", settings) as buf:
        await buf.feed([buf.make_group("g0", [1, 2, 3])], 0)
        [item] = await buf.claim("w", 1)
        py, clock_at_claim = VersionBudget.from_claim(item), item.clock_version
        assert item.max_new_tokens == min(py.left(M), L) == M
        clock, ended = 0, []
        for event, arg in CASES[case]:
            if event == "publish":
                await buf.clock.publish(arg, f"file:///w/{arg}", f"c{arg}")
                clock = arg
                continue
            if event == "claim":
                [item] = await buf.claim("w", 1)
                assert item.clock_version == clock
                py, clock_at_claim = VersionBudget.from_claim(item), item.clock_version
                assert item.max_new_tokens == min(py.left(M), L - item.length_tokens), (item, py)
                await _check_window(buf, item.sample_id, py, clock_at_claim)
                continue
            if event == "obs":
                await buf.append_observation(item, [7] * arg, clock)
                await _check_window(buf, item.sample_id, py, clock_at_claim)
                continue
            versions = list(arg)
            ids, lps = [5] * len(versions), [-0.5] * len(versions)
            if event == "append":
                await buf.append(item, ids, lps, versions)
            else:
                status = await buf.end_segment(item, event, ids, lps, versions)
            py.count(versions)
            await _check_window(buf, item.sample_id, py, clock_at_claim)
            if event == "abort":
                # the buffer parks an aborted segment at the budget exactly when the Python window is spent
                sample = await buf.get_sample(item.sample_id)
                assert status == SampleStatus.PARTIAL
                assert sample.finish_reason == ("budget" if py.left(M) == 0 else "abort"), (sample.finish_reason, py)
                ended.append(sample.finish_reason)
            elif event == "length":
                assert status == SampleStatus.PARTIAL and py.left(M) == 0
        assert ended, "every case ends a segment with abort"


def test_counting_rule_by_hand():
    """The rule on its own: a newer version opens a window, older tokens are not counted."""
    b = VersionBudget(version=2, used=1)
    b.count([2, 2, 1, 3, 2, 3])
    assert (b.version, b.used, b.left(4)) == (3, 2, 2)
    b.count([3, 3, 3])
    assert b.left(4) == 0 and b.used == 5  # spent: the buffer parks it at the budget
