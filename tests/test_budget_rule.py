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
                              max_budget=M, max_response_len=L, max_staleness=2)
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


# ------------------------------------------------------------------------------------------------
# one name: ``max_budget`` from the flag to BufferSettings; runs keep storing ``max_budget_tokens``

#: The settings JSON the release before the rename (64edcbf) stored for these settings, byte for byte.
STORED_BEFORE_RENAME = (
    '{"batches_per_version": 1, "dynamic_sampling": false, "flush_tokens": 16, "generation_size": 0, '
    '"lease_seconds": 30.0, "max_budget_tokens": 3, "max_response_len": 16, "max_staleness": 1, '
    '"n_samples_per_prompt": 2, "record_pass_rates": false, "record_prompt_history": false, '
    '"rollout_batch_size": 2, "stale_policy": "restart", "train_batch_groups": 2}')


def _renamed_settings() -> BufferSettings:
    return BufferSettings(rollout_batch_size=2, train_batch_groups=2, n_samples_per_prompt=2, max_budget=3,
                          max_response_len=16, max_staleness=1)


def test_stored_settings_are_unchanged_by_the_rename():
    """New runs store what old releases read, and old runs read back as the same settings."""
    s = _renamed_settings()
    assert s.to_json() == STORED_BEFORE_RENAME
    assert BufferSettings.from_stored(STORED_BEFORE_RENAME) == s
    assert s.to_stored()["max_budget_tokens"] == 3 and "max_budget" not in s.to_stored()
    assert BufferSettings.from_stored({**s.to_stored()}) == s
    both = {**s.to_stored(), "max_budget": 3}
    with pytest.raises(ValueError, match="twice"):
        BufferSettings.from_stored(both)
    with pytest.raises(TypeError):
        BufferSettings.from_stored({**s.to_stored(), "max_budget_token": 3})


async def test_a_run_stored_before_the_rename_resumes(redis_url):
    """A keyspace as the release before the rename left it (a budget-parked sample, the old settings
    JSON) is opened by this release's roles, resumed under the next version, and stays readable by
    the old one (its stored settings are untouched)."""
    import redis.asyncio as aioredis

    from buffers.keys import SCHEMA_VERSION, key_prefix

    raw = aioredis.Redis.from_url(redis_url)
    prefix = key_prefix("old")
    await raw.set(prefix + "schema", SCHEMA_VERSION)
    await raw.set(prefix + "settings", STORED_BEFORE_RENAME)
    async with await ReplayBuffer.open(redis_url, "old", _renamed_settings()) as buf:
        await buf.feed([buf.make_group("g0", [1, 2, 3])], 0)
        a, b = await buf.claim("w", 2)
        assert a.max_new_tokens == 3
        assert await buf.end_segment(a, "length", [11, 12, 13], [-0.1] * 3, [0] * 3) == SampleStatus.PARTIAL
    # a restarted role, and a read-only tool, open the same run
    async with await ReplayBuffer.open(redis_url, "old") as tool:
        assert tool.settings == _renamed_settings()
        assert (await tool.stats())["settings"]["max_budget_tokens"] == 3  # `asyncrl buffer stats` as before
    async with await ReplayBuffer.open(redis_url, "old", _renamed_settings()) as buf:
        await buf.clock.publish(1, "file:///w/1", "c1")
        [again] = await buf.claim("w", 1)
        assert again.sample_id == a.sample_id and again.response_ids == [11, 12, 13]
        assert again.max_new_tokens == 3 and again.produced_under_version_tokens == 0
    assert (await raw.get(prefix + "settings")).decode() == STORED_BEFORE_RENAME
    await raw.aclose()
