"""Replay buffer: every transition and error path, against a real redis-server (tests/conftest.py).

Each test opens a fresh run on a fresh server. Tokens come from a deterministic fake
generator (the engine is tested elsewhere); the buffer only sees ids, logprobs and versions.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import redis.asyncio as aioredis

from asyncrl.core.types import GroupState, PromptGroup, SampleStatus, WorkKind
from buffers import (
    BadOffset,
    BadRequest,
    BufferSettings,
    CursorMismatch,
    DuplicateItem,
    InvalidTransition,
    LeaseLost,
    MalformedData,
    ReplayBuffer,
    SchemaMismatch,
    SettingsMismatch,
    UnknownItem,
    VersionAhead,
    VersionConflict,
)
from buffers.cli import main as cli_main


def settings(**kw) -> BufferSettings:
    base = dict(rollout_batch_size=2, train_batch_groups=2, n_samples_per_prompt=2, max_budget=8,
                max_response_len=16, max_staleness=1, stale_policy="restart", lease_seconds=30.0)
    base.update(kw)
    return BufferSettings(**base)


async def open_buf(url: str, run: str = "t", **kw) -> ReplayBuffer:
    return await ReplayBuffer.open(url, run, settings(**kw))


async def feed(buf: ReplayBuffer, n: int, prefix: str = "g") -> list[str]:
    cur = await buf.dataset_cursor()
    gids = [f"{prefix}{cur + i}" for i in range(n)]
    await buf.feed([buf.make_group(g, [1, 2, 3], {"answer": g}) for g in gids], cur)
    return gids


async def gen(buf: ReplayBuffer, item, n_tokens: int, version: int, finish: str | None = None):
    """Append ``n_tokens`` deterministic tokens under ``version``; end the segment with ``finish``."""
    base = item.length_tokens
    ids = [(base + j) % 50 + 10 for j in range(n_tokens)]
    lps = [-0.01 * (base + j) for j in range(n_tokens)]
    vers = [version] * n_tokens
    if finish is None:
        return await buf.append(item, ids, lps, vers)
    return await buf.end_segment(item, finish, ids, lps, vers)


async def finish_all(buf, version: int = 0, reward: float = 1.0):
    """Claim everything claimable, finish it with `stop` and score it."""
    while True:
        items = await buf.claim("w", 16)
        if not items:
            return
        for it in items:
            if it.kind == WorkKind.GENERATE:
                await gen(buf, it, 2, version, "stop")
            await buf.score(it, reward=reward)


# ---------------------------------------------------------------------------------- open / schema


async def test_open_creates_schema_and_rejects_other_settings(redis_url):
    buf = await open_buf(redis_url)
    assert await buf.redis.get(buf.prefix + "schema") == b"asyncrl-buffer/1"
    with pytest.raises(SettingsMismatch):
        await open_buf(redis_url, rollout_batch_size=3, train_batch_groups=3)
    ro = await ReplayBuffer.open(redis_url, "t")  # settings None: the stored ones
    assert ro.settings == buf.settings
    with pytest.raises(UnknownItem):
        await ReplayBuffer.open(redis_url, "nosuchrun")
    with pytest.raises(ValueError):
        await ReplayBuffer.open(redis_url, "bad{name}", settings())
    decoding = aioredis.Redis.from_url(redis_url, decode_responses=True)
    with pytest.raises(BadRequest, match="decode_responses"):
        await ReplayBuffer.open(decoding, "t")
    await decoding.aclose()
    await ro.close()
    await buf.close()


async def test_incompatible_schema_and_foreign_keys_change_nothing(redis_url):
    buf = await open_buf(redis_url)
    await feed(buf, 1)
    r = aioredis.Redis.from_url(redis_url)
    await r.set(buf.prefix + "schema", "asyncrl-buffer/999")
    before = sorted(await r.keys(buf.prefix.replace("{", "\\{").replace("}", "\\}") + "*"))
    with pytest.raises(SchemaMismatch, match="999"):
        await open_buf(redis_url)
    with pytest.raises(SchemaMismatch):  # a client opened earlier: every script checks the schema
        await buf.claim("w")
    with pytest.raises(SchemaMismatch):
        await buf.clock.publish(1, "u", "c")
    assert sorted(await r.keys(buf.prefix.replace("{", "\\{").replace("}", "\\}") + "*")) == before
    assert await r.get(buf.prefix + "version") is None
    await r.set("asyncrl:{foreign}:something", "x")
    with pytest.raises(SchemaMismatch, match="foreign"):
        await open_buf(redis_url, run="foreign")
    assert await r.get("asyncrl:{foreign}:schema") is None
    await r.aclose()
    await buf.close()


async def test_settings_validation_and_from_config():
    with pytest.raises(BadRequest, match="train_batch_groups"):
        BufferSettings(rollout_batch_size=2, train_batch_groups=3)
    with pytest.raises(BadRequest, match="stale_policy"):
        BufferSettings(stale_policy="ignore")
    from asyncrl.core.config import AsyncRLConfig

    cfg = AsyncRLConfig.model_validate({
        "rollout": {"rollout_batch_size": 8, "partial_percent": 0.5, "max_budget": 64, "max_response_len": 256,
                    "n_samples_per_prompt": 4},
        "buffer": {"max_staleness": 2, "stale_policy": "drop", "lease_seconds": 5},
        "weight_sync": {"interval": 2},
    })
    s = BufferSettings.from_config(cfg)
    assert (s.rollout_batch_size, s.train_batch_groups, s.max_budget, s.max_response_len) == (8, 4, 64, 256)
    assert (s.n_samples_per_prompt, s.max_staleness, s.stale_policy, s.lease_seconds, s.batches_per_version) == (4, 2, "drop", 5.0, 2)
    assert BufferSettings.from_partial_percent(16, 0.7).train_batch_groups == 12
    with pytest.raises(BadRequest):
        BufferSettings.from_partial_percent(16, 0.0)


# ---------------------------------------------------------------------------------- feed / admission


async def test_feed_cursor_compare_and_set(redis_url):
    buf = await open_buf(redis_url)
    assert await buf.dataset_cursor() == 0
    assert await buf.feed([buf.make_group("a", [1]), buf.make_group("b", [2])], 0) == 2
    with pytest.raises(CursorMismatch):
        await buf.feed([buf.make_group("c", [1])], 0)  # a retry after a lost reply: nothing repeated
    with pytest.raises(DuplicateItem):
        await buf.feed([buf.make_group("x", [1]), buf.make_group("a", [1])], 2)
    assert await buf.dataset_cursor() == 2
    assert not await buf.redis.exists(buf.prefix + "group:x")  # nothing half-applied
    with pytest.raises(BadRequest):
        await buf.feed([buf.make_group("bad,id", [1])], 2)
    with pytest.raises(BadRequest):
        await buf.feed([buf.make_group("e", [])], 2)
    with pytest.raises(BadRequest):
        await buf.feed([buf.make_group("d", [1]), buf.make_group("d", [1])], 2)
    group, samples = await buf.get_group("a")
    assert group.feed_index == 0 and group.state == GroupState.GENERATING and len(samples) == 2
    await buf.close()


async def test_admission_R_cap_and_areal_bound(redis_url):
    # R = 4, B = 2, eta = 0: admitted < (0 + v + 1) * 2 -> 2 groups at v = 0
    buf = await open_buf(redis_url, rollout_batch_size=4, train_batch_groups=2, max_staleness=0)
    await feed(buf, 6)
    assert (await buf.stats())["admitted_groups"] == 2
    assert await buf.pending_groups() == 4
    await buf.clock.publish(1, "file:///w/1", "c1")
    await buf.claim("w", 1)  # admission runs inside claim
    assert (await buf.stats())["admitted_groups"] == 4  # (0 + 1 + 1) * 2
    await buf.clock.publish(2, "file:///w/2", "c2")
    await buf.claim("w", 1)
    assert (await buf.stats())["admitted_groups"] == 4  # R = 4 groups in flight caps it
    await buf.close()


async def test_ready_groups_do_not_hold_a_rollout_slot(redis_url):
    """R caps the groups being generated (AReaL counts running rollouts only): a group that
    becomes READY frees its slot at once, and the staleness bound alone caps how many READY
    groups wait for the trainer."""
    # R = 2, B = 1, eta = 2: the AReaL bound admits (2 + 0 + 1) * 1 = 3 groups at v = 0
    buf = await open_buf(redis_url, rollout_batch_size=2, train_batch_groups=1, n_samples_per_prompt=1,
                         max_staleness=2)
    await feed(buf, 6)
    st = await buf.stats()
    assert st["admitted_groups"] == 2 and st["groups_by_state"]["generating"] == 2
    it0, it1 = await buf.claim("w", 2)
    await gen(buf, it0, 2, 0, "stop")
    assert await buf.score(it0, reward=1.0) == GroupState.READY
    st = await buf.stats()  # scoring g0 admitted g2 in the same script: 2 generating + 1 READY
    assert st["admitted_groups"] == 3 and st["groups_by_state"] == {"generating": 2, "ready": 1, "pending": 3}
    for it in [it1, *await buf.claim("w", 4)]:
        await gen(buf, it, 2, 0, "stop")
        await buf.score(it, reward=0.0)
    st = await buf.stats()  # three READY groups, none generating: the staleness bound holds the rest
    assert st["admitted_groups"] == 3 and st["groups_by_state"] == {"ready": 3, "pending": 3}
    assert await buf.claim("w", 4) == []
    b = await buf.next_batch(1)  # the trainer takes one and publishes v1: one more admission
    await buf.acknowledge(b, 1)
    await buf.clock.publish(1, "file:///w/1", "c1")
    await buf.claim("w", 1)
    assert (await buf.stats())["admitted_groups"] == 4
    await buf.close()


async def test_synchronous_settings_still_admit_one_rollout_batch_per_version(redis_url):
    """p = 1, eta = 0: READY groups no longer hold slots, yet the staleness bound admits exactly
    R groups per version, so the next rollout batch starts only after the trainer's update."""
    buf = await open_buf(redis_url, rollout_batch_size=2, train_batch_groups=2, n_samples_per_prompt=1,
                         max_staleness=0)
    await feed(buf, 5)
    for it in await buf.claim("w", 4):
        await gen(buf, it, 2, 0, "stop")
        await buf.score(it, reward=1.0)
    st = await buf.stats()
    assert st["admitted_groups"] == 2 and st["groups_by_state"] == {"ready": 2, "pending": 3}
    assert await buf.claim("w", 4) == []
    b = await buf.next_batch(1)
    assert b.group_ids == ["g0", "g1"]
    await buf.acknowledge(b, 1)
    assert (await buf.stats())["admitted_groups"] == 2  # still version 0: nothing more
    await buf.clock.publish(1, "file:///w/1", "c1")
    assert len(await buf.claim("w", 4)) == 2 and (await buf.stats())["admitted_groups"] == 4
    await buf.close()


# ---------------------------------------------------------------------------------- claim / append / segments


async def test_claim_returns_what_the_engine_needs(redis_url):
    buf = await open_buf(redis_url, n_samples_per_prompt=1)
    await feed(buf, 1)
    [it] = await buf.claim("w1", 4)
    assert it.kind == WorkKind.GENERATE and it.prompt_ids == [1, 2, 3] and it.response_ids == []
    assert it.max_new_tokens == 8 and it.produced_under_version_tokens == 0 and it.metadata == {"answer": "g0"}
    assert await gen(buf, it, 5, 0) == 5
    assert await buf.claim("w2", 4) == []
    assert await gen(buf, it, 3, 0, "length") == SampleStatus.PARTIAL  # budget M = 8 reached
    s = await buf.get_sample(it.sample_id)
    assert s.finish_reason == "budget" and len(s.response_ids) == 8 and s.segments[0].end == 8
    await buf.close()


async def test_append_exactly_once_and_errors(redis_url):
    buf = await open_buf(redis_url, n_samples_per_prompt=1)
    await feed(buf, 1)
    [it] = await buf.claim("w", 1)
    await buf.append(it, [11, 12], [-0.1, -0.2], [0, 0])
    it.length_tokens = 0  # the reply was lost: the client retries the same chunk
    assert await buf.append(it, [11, 12], [-0.1, -0.2], [0, 0]) == 2
    assert (await buf.get_sample(it.sample_id)).response_ids == [11, 12]
    it.length_tokens = 1
    with pytest.raises(BadOffset):
        await buf.append(it, [13], [-0.1], [0])
    it.length_tokens = 2
    with pytest.raises(BadRequest, match="differ"):
        await buf.append(it, [13, 14], [-0.1], [0, 0])
    with pytest.raises(BadRequest, match="int32"):
        await buf.append(it, [2**31], [-0.1], [0])
    with pytest.raises(BadRequest, match="NaN"):
        await buf.append(it, [1], [float("nan")], [0])
    with pytest.raises(VersionAhead):
        await buf.append(it, [13], [-0.1], [5])
    with pytest.raises(BadRequest, match="max_response_len"):
        await buf.append(it, [1] * 15, [0.0] * 15, [0] * 15)
    with pytest.raises(BadRequest, match="finish_reason"):
        await buf.end_segment(it, "eos")
    with pytest.raises(BadRequest, match="negative"):
        await buf.append(it, [1], [0.0], [-1])
    bad = type(it)(**{**it.__dict__, "sample_id": "nope/0"})
    with pytest.raises(UnknownItem):
        await buf.append(bad, [1], [0.0], [0])
    forged = type(it)(**{**it.__dict__, "claim_token": "999"})
    with pytest.raises(LeaseLost):
        await buf.append(forged, [1], [0.0], [0])
    s = await buf.get_sample(it.sample_id)
    assert s.response_ids == [11, 12] and s.versions == [0, 0] and s.status == SampleStatus.RUNNING
    await buf.close()


async def test_end_segment_rules(redis_url):
    buf = await open_buf(redis_url, rollout_batch_size=3, train_batch_groups=3, n_samples_per_prompt=1,
                         max_budget=4, max_response_len=6)
    await feed(buf, 3)
    a, b, c = await buf.claim("w", 3)
    assert await gen(buf, a, 2, 0, "stop") == SampleStatus.COMPLETE
    assert await gen(buf, b, 3, 0, "abort") == SampleStatus.PARTIAL
    assert await gen(buf, c, 0, 0, "abort") == SampleStatus.PENDING  # nothing generated: fresh again
    sb = await buf.get_sample(b.sample_id)
    assert sb.finish_reason == "abort" and [(x.start, x.end, x.finish_reason) for x in sb.segments] == [(0, 3, "abort")]
    # abort -> resumable now, before fresh work; budget left under version 0 is 4 - 3 = 1
    [rb, rc] = await buf.claim("w", 2)
    assert rb.sample_id == b.sample_id and rb.response_ids == sb.response_ids and rb.num_resumes == 1
    assert rb.produced_under_version_tokens == 3 and rb.max_new_tokens == 1
    assert rc.sample_id == c.sample_id and rc.max_new_tokens == 4
    assert await gen(buf, rb, 1, 0, "length") == SampleStatus.PARTIAL  # budget: parked
    assert (await buf.get_sample(b.sample_id)).finish_reason == "budget"
    # a newer version makes it resumable with a fresh budget; max_response_len caps it: 6 - 4 = 2
    await buf.clock.publish(1, "file:///w/1", "c1")
    assert await gen(buf, rc, 4, 0, "length") == SampleStatus.PARTIAL
    items = await buf.claim("w", 3)
    assert [i.sample_id for i in items] == [b.sample_id, c.sample_id]
    assert items[0].max_new_tokens == 2 and items[0].produced_under_version_tokens == 0
    assert await gen(buf, items[0], 2, 1, "length") == SampleStatus.COMPLETE  # at max_response_len
    s = await buf.get_sample(b.sample_id)
    assert s.finish_reason == "length" and s.versions == [0, 0, 0, 0, 1, 1] and s.num_resumes == 2
    await buf.close()


async def test_budget_parked_resumes_under_same_version_when_idle(redis_url):
    # p = 1, one group, M < max_response_len: without idle resume this would deadlock
    buf = await open_buf(redis_url, rollout_batch_size=1, train_batch_groups=1, n_samples_per_prompt=2,
                         max_budget=3, max_response_len=10, max_staleness=0)
    await feed(buf, 2)
    items = await buf.claim("w", 4)
    assert len(items) == 2
    assert await gen(buf, items[0], 3, 0, "length") == SampleStatus.PARTIAL
    # another sample is still running, and no other group is admissible (R = 1): idle resume
    [again] = await buf.claim("w", 4)
    assert again.sample_id == items[0].sample_id and again.max_new_tokens == 3
    assert again.produced_under_version_tokens == 0
    assert (await buf.stats())["counters"]["idle_resumes"] == 1
    await buf.close()


async def test_lease_expiry_reclaims_with_tokens_and_fences_old_worker(redis_url):
    buf = await open_buf(redis_url, n_samples_per_prompt=1, lease_seconds=0.2)
    await feed(buf, 1)
    [it] = await buf.claim("dead", 1)
    await gen(buf, it, 3, 0)
    assert await buf.renew([it]) == 1
    await asyncio.sleep(0.3)
    [re] = await buf.claim("alive", 1)
    assert re.sample_id == it.sample_id and re.response_ids == (await buf.get_sample(it.sample_id)).response_ids
    with pytest.raises(LeaseLost):
        await gen(buf, it, 1, 0)
    assert await buf.renew([it]) == 0
    assert (await buf.stats())["counters"]["reclaimed_leases"] == 1
    await gen(buf, re, 1, 0, "stop")
    # the worker dies between COMPLETE and score: the sample comes back as a SCORE item
    await asyncio.sleep(0.3)
    [sc] = await buf.claim("alive", 1)
    assert sc.kind == WorkKind.SCORE and sc.response_ids == (await buf.get_sample(it.sample_id)).response_ids
    with pytest.raises(LeaseLost):
        await buf.score(re, reward=1.0)
    assert await buf.score(sc, reward=0.5) == GroupState.READY
    await buf.close()


# ---------------------------------------------------------------------------------- score / ready


async def test_score_rules_and_failed_samples(redis_url):
    buf = await open_buf(redis_url, n_samples_per_prompt=3, rollout_batch_size=2, train_batch_groups=1)
    await feed(buf, 2)
    items = await buf.claim("w", 6)
    for it in items:
        await gen(buf, it, 2, 0, "stop") if it.index != 2 else await gen(buf, it, 1, 0)
    running = [i for i in items if i.index == 2]
    with pytest.raises(InvalidTransition, match="running"):
        await buf.score(running[0], reward=1.0)
    with pytest.raises(BadRequest):
        await buf.score(items[0], reward=1.0, error="x")
    with pytest.raises(BadRequest):
        await buf.score(items[0], reward=float("inf"))
    with pytest.raises(BadRequest, match="per-token"):
        await buf.score(items[0], reward=1.0, advantages=[0.1])
    g0 = [i for i in items if i.group_id == "g0"]
    g1 = [i for i in items if i.group_id == "g1"]
    assert await buf.score(g0[0], reward=1.0, advantages=0.25) == GroupState.GENERATING
    assert await buf.score(g0[1], reward=0.0, advantages=[0.5, -0.5]) == GroupState.GENERATING
    with pytest.raises(LeaseLost):
        await buf.score(g0[0], reward=1.0)  # scoring releases the claim
    await gen(buf, g0[2], 1, 0, "stop")
    assert await buf.score(g0[2], error="verifier timeout") == GroupState.READY  # 2 of 3 scored
    s = await buf.get_group("g0")
    assert [x.status for x in s[1]] == [SampleStatus.SCORED, SampleStatus.SCORED, SampleStatus.FAILED]
    assert s[1][0].advantages == 0.25 and s[1][1].advantages == [0.5, -0.5] and s[1][2].error == "verifier timeout"
    # group g1: two failures -> dropped with reason reward_error
    await gen(buf, g1[2], 1, 0, "stop")
    await buf.score(g1[0], error="boom")
    await buf.score(g1[1], error="boom")
    assert await buf.score(g1[2], reward=1.0) == GroupState.DROPPED
    assert await buf.dropped_groups() == {"g1": "reward_error"}
    with pytest.raises(UnknownItem):
        await buf.get_group("g1")
    b = await buf.next_batch(1)
    assert b.group_ids == ["g0"] and len(b.groups[0].samples) == 2 and b.groups[0].n_failed == 1
    await buf.close()


# ---------------------------------------------------------------------------------- batches / ack / commit


async def test_batches_oldest_first_redelivery_ack_commit(redis_url):
    buf = await open_buf(redis_url, rollout_batch_size=4, train_batch_groups=2, n_samples_per_prompt=1)
    await feed(buf, 4)
    items = await buf.claim("w", 4)
    assert await buf.next_batch(1) is None
    for it in reversed(items):  # complete newest first: the batch is still oldest first
        await gen(buf, it, 1, 0, "stop")
        await buf.score(it, reward=1.0)
    b1 = await buf.next_batch(1)
    assert b1.group_ids == ["g0", "g1"] and not b1.redelivered
    again = await buf.next_batch(1)  # not acknowledged (the trainer restarted): same batch again
    assert again.batch_id == b1.batch_id and again.group_ids == b1.group_ids and again.redelivered
    assert await buf.acknowledge(b1, 1) is True
    assert await buf.acknowledge(b1, 1) is False  # twice is harmless
    with pytest.raises(InvalidTransition):
        await buf.acknowledge(b1, 2)
    b2 = await buf.next_batch(2)
    assert b2.group_ids == ["g2", "g3"]
    with pytest.raises(InvalidTransition, match="not after"):
        await buf.acknowledge(b2, 1)
    with pytest.raises(UnknownItem):
        await buf.acknowledge("b999", 5)
    await buf.acknowledge(b2, 2)
    assert await buf.commit(1) == 1 * 2
    with pytest.raises(UnknownItem):
        await buf.get_group("g0")
    assert (await buf.get_group("g2"))[0].state == GroupState.ACKED  # acknowledged, not committed: kept
    assert await buf.acknowledge(b1, 1) is False  # ack after commit: still harmless
    assert await buf.commit(1) == 0
    assert await buf.commit(2) == 2
    with pytest.raises(BadRequest, match="committed"):
        await buf.recover(1, 0)
    await buf.close()


@pytest.mark.parametrize("policy", ["restart", "drop", "keep"])
async def test_stale_policy_at_batch_formation(redis_url, policy):
    buf = await open_buf(redis_url, rollout_batch_size=2, train_batch_groups=1, n_samples_per_prompt=1,
                         max_staleness=0, stale_policy=policy)
    await feed(buf, 2)
    await finish_all(buf, version=0)
    # eta = 0, B = 1: only g0 is admitted at version 0
    await buf.clock.publish(1, "file:///w/1", "c1")  # the READY group is now 1 version old > eta
    b = await buf.next_batch(1)
    st = await buf.stats()
    if policy == "keep":
        assert b.group_ids == ["g0"] and b.groups[0].staleness == 1
    elif policy == "drop":
        assert b is None and st["dropped_by_reason"] == {"stale_batch": 1}
        assert await buf.dropped_groups() == {"g0": "stale_batch"}
        assert (await buf.get_group("g1"))[0].state == GroupState.GENERATING  # the freed slot admitted g1
    else:
        assert b is None and st["restarted_by_reason"] == {"groups:stale_batch": 1, "samples:stale_batch": 1}
        assert st["counters"]["restart_discarded_tokens"] == 2  # the 2 tokens finish_all generated
        g, [s] = await buf.get_group("g0")
        assert g.state == GroupState.GENERATING and s.status == SampleStatus.PENDING and s.response_ids == []
        assert s.num_restarts == 1
        await finish_all(buf, version=1)
        b = await buf.next_batch(1)
        assert b.group_ids == ["g0"] and b.groups[0].staleness == 0
    await buf.close()


@pytest.mark.parametrize("policy", ["restart", "drop", "keep"])
async def test_stale_policy_at_resume(redis_url, policy):
    buf = await open_buf(redis_url, rollout_batch_size=1, train_batch_groups=1, n_samples_per_prompt=1,
                         max_staleness=1, stale_policy=policy)
    await feed(buf, 2)
    [it] = await buf.claim("w", 1)
    await gen(buf, it, 3, 0, "abort")
    await buf.clock.publish(2, "file:///w/2", "c2")  # staleness 2 > 1
    items = await buf.claim("w", 1)
    if policy == "keep":
        assert items[0].sample_id == it.sample_id and len(items[0].response_ids) == 3
    elif policy == "restart":
        assert items[0].sample_id == it.sample_id and items[0].response_ids == []
        st = await buf.stats()
        assert st["restarted_by_reason"] == {"samples:stale_resume": 1}
        assert st["counters"]["restart_discarded_tokens"] == 3 == st["counters"]["appended_tokens"]
    else:
        assert await buf.dropped_groups() == {"g0": "stale_resume"}
        assert [i.group_id for i in items] == ["g1"]  # the freed slot admitted the next group
    await buf.close()


async def test_restart_discarded_tokens_count_model_tokens_only(redis_url):
    """An episode restarted after a turn and an observation loses its model tokens, not the environment's."""
    buf = await open_buf(redis_url, rollout_batch_size=1, train_batch_groups=1, n_samples_per_prompt=1,
                         max_budget=16)
    await feed(buf, 1)
    [it] = await buf.claim("w", 1)
    await gen(buf, it, 3, 0, "turn")
    await buf.append_observation(it, [7, 7, 7, 7], 0)
    await gen(buf, it, 2, 0)  # an open model call of the second turn
    await buf.restart_episode(it)
    counters = (await buf.stats())["counters"]
    assert counters["restart_discarded_tokens"] == 5 == counters["appended_tokens"]
    assert counters["observation_tokens"] == 4
    assert counters["restarted_samples:nondeterministic"] == 1
    [again] = await buf.claim("w", 1)
    assert again.sample_id == it.sample_id and again.response_ids == []
    await buf.restart_episode(again)  # nothing held: nothing more discarded
    assert (await buf.stats())["counters"]["restart_discarded_tokens"] == 5
    await buf.close()


# ---------------------------------------------------------------------------------- recovery


async def test_recover_rehands_in_order_rewinds_and_applies_stale_policy(redis_url):
    buf = await open_buf(redis_url, rollout_batch_size=4, train_batch_groups=1, n_samples_per_prompt=1,
                         max_staleness=3)
    await feed(buf, 5)
    await finish_all(buf, version=0)  # g0..g3 READY at version 0
    order = []
    for step in (1, 2, 3):
        b = await buf.next_batch(step)
        order += b.group_ids
        await buf.acknowledge(b, step)
        await buf.clock.publish(step, f"file:///w/{step}", f"c{step}")
    await buf.commit(1)
    # g4 admitted at version 3: generate under the (soon abandoned) version 3
    [it] = await buf.claim("w", 1)
    await gen(buf, it, 2, 3)
    open_b = await buf.next_batch(4)  # g3, handed out, never acknowledged
    assert open_b.group_ids == ["g3"]
    with pytest.raises(BadRequest, match="ahead"):
        await buf.recover(1, 7)
    await buf.redis.hdel(buf.prefix + "weights:history", 1)  # as if version 1 had never been published
    with pytest.raises(BadRequest, match="uri"):
        await buf.recover(1, 1)
    await buf.clock.redis.hset(buf.prefix + "weights:history", 1, json.dumps({"uri": "file:///w/1", "checksum": "c1"}))
    rep = await buf.recover(1, 1)  # the uri recorded when version 1 was published
    assert rep["replayed_groups"] == 3 and rep["lineage"] == 1 and rep["revoked_leases"] == 1
    assert await buf.clock.version() == 1 and await buf.clock.lineage() == 1
    latest = await buf.clock.latest()
    assert (latest.version, latest.uri, latest.lineage) == (1, "file:///w/1", 1)
    with pytest.raises(LeaseLost):  # the old lineage's claim is fenced
        await gen(buf, it, 1, 3)
    # g4 carried tokens of abandoned version 3: restarted from its prompt
    s = await buf.get_sample(it.sample_id)
    assert s.response_ids == [] and s.status == SampleStatus.PENDING
    with pytest.raises(UnknownItem):
        await buf.acknowledge(open_b, 4)  # reverted by recover
    redo = []
    for step in (2, 3, 4):
        b = await buf.next_batch(step)
        redo += b.group_ids
        await buf.acknowledge(b, step)
    assert redo == ["g1", "g2", "g3"] == order[1:] + ["g3"]
    # a worker still holding abandoned weights (version 3 > clock 1) is refused
    [it2] = await buf.claim("w", 1)
    with pytest.raises(VersionAhead):
        await gen(buf, it2, 1, 3)
    await buf.close()


async def test_recover_drop_policy_for_abandoned_versions(redis_url):
    buf = await open_buf(redis_url, rollout_batch_size=2, train_batch_groups=1, n_samples_per_prompt=1,
                         max_staleness=2, stale_policy="drop")
    await feed(buf, 2)
    await buf.clock.publish(1, "file:///w/1", "c1")
    await buf.clock.publish(2, "file:///w/2", "c2")
    await finish_all(buf, version=2)
    rep = await buf.recover(0, 0)  # version 0 = the initial model: empty uri
    assert rep["dropped_groups"] == 2
    assert (await buf.clock.latest()).uri == "" and await buf.redis.hkeys(buf.prefix + "weights:history") == []
    assert await buf.dropped_groups() == {"g0": "abandoned_version", "g1": "abandoned_version"}
    await buf.close()


# ---------------------------------------------------------------------------------- version clock


async def test_version_clock_cas_subscribe_poll(redis_url):
    buf = await open_buf(redis_url)
    clock = buf.clock
    assert await clock.version() == 0 and await clock.latest() is None
    received = []

    async def listen():
        async for ann in clock.subscribe():
            received.append(ann)
            return

    task = asyncio.create_task(listen())
    await asyncio.sleep(0.2)
    ann = await clock.publish(1, "file:///w/1", "sha256:aa", expected_version=0)
    await asyncio.wait_for(task, 5)
    assert received == [ann] and ann.version == 1 and ann.lineage == 0
    with pytest.raises(VersionConflict):
        await clock.publish(1, "file:///w/1b", "x")
    with pytest.raises(VersionConflict):
        await clock.publish(3, "file:///w/3", "x", expected_version=0)
    with pytest.raises(BadRequest):
        await clock.publish(4, "", "x")
    assert (await clock.latest()).uri == "file:///w/1"
    assert await clock.wait_for(1, 1.0) == 1
    with pytest.raises(TimeoutError):
        await clock.wait_for(2, 0.1)
    await buf.close()


# ---------------------------------------------------------------------------------- malformed data


async def test_malformed_sample_is_rejected_and_nothing_changes(redis_url):
    buf = await open_buf(redis_url, n_samples_per_prompt=1)
    await feed(buf, 1)
    [it] = await buf.claim("w", 1)
    await gen(buf, it, 2, 0)
    key = buf.prefix + f"sample:{it.sample_id}"
    await buf.redis.hset(key, "ids", b"\x01\x02\x03")  # 3 bytes: not int32
    before = await buf.redis.hgetall(key)
    with pytest.raises(MalformedData):
        await buf.get_sample(it.sample_id)
    with pytest.raises(MalformedData):
        await gen(buf, it, 1, 0)
    assert await buf.redis.hgetall(key) == before
    await buf.redis.hset(buf.prefix + "group:g0", "n", "x")
    with pytest.raises(MalformedData):
        await buf.get_group("g0")
    await buf.redis.set(buf.prefix + "settings", "{not json")
    with pytest.raises(MalformedData):
        await ReplayBuffer.open(buf.redis, "t")
    await buf.close()


# ---------------------------------------------------------------------------------- synchronous case


async def test_synchronous_case_matches_plain_loop(redis_url):
    """p = 1, M >= max_response_len, eta = 0: batch k is exactly prompts k*R .. k*R + R - 1 in order."""
    R, n, steps = 3, 2, 4
    buf = await open_buf(redis_url, rollout_batch_size=R, train_batch_groups=R, n_samples_per_prompt=n,
                         max_budget=16, max_response_len=16, max_staleness=0)
    dataset = [f"p{i:03d}" for i in range(R * steps + 2)]
    await buf.feed([buf.make_group(g, [i + 1]) for i, g in enumerate(dataset)], 0)
    got = []
    for step in range(1, steps + 1):
        # workers finish in a scrambled order, with varying lengths, across two claims
        items = await buf.claim("w", 100)
        for it in sorted(items, key=lambda i: hash(i.sample_id) % 7):
            await gen(buf, it, 1 + (it.index * 5 + len(it.group_id)) % 7, step - 1, "stop")
            await buf.score(it, reward=float(it.index))
        assert await buf.claim("w", 100) == []  # nothing beyond the rollout batch is admitted
        b = await buf.next_batch(step)
        assert all(g.staleness == 0 for g in b.groups)
        got.append(b.group_ids)
        await buf.acknowledge(b, step)
        await buf.clock.publish(step, f"file:///w/{step}", f"c{step}")
    plain = [dataset[k * R:(k + 1) * R] for k in range(steps)]
    assert got == plain
    await buf.close()


# ---------------------------------------------------------------------------------- CLI


def test_cli_stats_inspect_drain(redis_url, monkeypatch, capsys):
    async def setup():
        buf = await open_buf(redis_url, n_samples_per_prompt=1)
        await feed(buf, 2)
        [it] = await buf.claim("w", 1)
        await gen(buf, it, 3, 0, "abort")
        await buf.close()

    asyncio.run(setup())
    assert cli_main(["stats", "--redis_url", redis_url, "--run", "t", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["samples_by_state"]["partial"] == 1 and s["lineage"] == 0 and s["partial_ratio"] == 0.5
    assert cli_main(["stats", "--redis_url", redis_url, "--run", "t"]) == 0
    assert "partial ratio 0.500" in capsys.readouterr().out
    assert cli_main(["inspect", "g0/0", "--redis_url", redis_url, "--run", "t", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["response_ids"] == [10, 11, 12] and d["status"] == "partial" and d["versions"] == [0, 0, 0]
    assert cli_main(["inspect", "zz/0", "--redis_url", redis_url, "--run", "t"]) == 1
    assert cli_main(["stats", "--redis_url", redis_url, "--run", "other"]) == 1
    assert cli_main(["stats"]) == 2
    monkeypatch.setattr("builtins.input", lambda _prompt: "no")
    assert cli_main(["drain", "--redis_url", redis_url, "--run", "t"]) == 1
    monkeypatch.setattr("builtins.input", lambda _prompt: "t")
    assert cli_main(["drain", "--redis_url", redis_url, "--run", "t"]) == 0
    assert "keys deleted" in capsys.readouterr().out
    assert cli_main(["stats", "--redis_url", redis_url, "--run", "t"]) == 1
    assert cli_main(["drain", "--redis_url", "redis://127.0.0.1:1/0", "--run", "t", "--yes"]) == 1


def test_cli_is_registered(redis_url):
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "buffer", "stats", "--redis_url", redis_url,
                          "--run", "none"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no buffer yet" in out.stderr


async def test_smaller_last_batch_at_end_of_dataset(redis_url):
    buf = await open_buf(redis_url, rollout_batch_size=2, train_batch_groups=2, n_samples_per_prompt=1)
    await feed(buf, 1)
    assert not await buf.only_ready_left()  # g0 is generating
    await finish_all(buf)
    assert await buf.only_ready_left()
    assert await buf.next_batch(1) is None
    with pytest.raises(BadRequest):
        await buf.next_batch(1, min_groups=3)
    b = await buf.next_batch(1, min_groups=1)
    assert b.group_ids == ["g0"]
    await buf.close()


async def test_concurrent_appends_are_coalesced_with_independent_errors(redis_url, redis_server):
    buf = await open_buf(redis_url, rollout_batch_size=8, train_batch_groups=8, n_samples_per_prompt=4)
    await feed(buf, 8)
    claims = await asyncio.gather(*(buf.claim(f"w{i}", 10) for i in range(4)))  # coalesced into one call
    items = [it for c in claims for it in c]
    assert [len(c) for c in claims] == [10, 10, 10, 2]
    assert len({it.sample_id for it in items}) == 32 and len({it.claim_token for it in items}) == 32
    calls = []
    orig = buf._scripts.run

    async def counting(name, keys, args):
        calls.append(name)
        return await orig(name, keys, args)

    buf._scripts.run = counting
    forged = type(items[5])(**{**items[5].__dict__, "claim_token": "nope"})
    results = await asyncio.gather(
        *(gen(buf, it, 4, 0) for it in items if it is not items[5]), gen(buf, forged, 4, 0), return_exceptions=True
    )
    assert results[:-1] == [4] * 31 and isinstance(results[-1], LeaseLost)
    assert calls.count("append") < 8  # 32 appends in a few script calls, not 32
    assert (await buf.get_sample(items[5].sample_id)).response_ids == []
    # a transport failure reaches every caller of the failed call
    redis_server.kill()
    results = await asyncio.gather(*(gen(buf, it, 1, 0) for it in items[:4]), return_exceptions=True)
    assert all(isinstance(r, Exception) and not isinstance(r, LeaseLost) for r in results)
    redis_server.start()
    await buf.close()


def test_cli_inspect_decodes_text_with_tokenizer(redis_url, tiny_model_dir, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("12 + 30 = 42")

    async def setup():
        buf = await open_buf(redis_url, n_samples_per_prompt=1)
        await feed(buf, 1)
        [it] = await buf.claim("w", 1)
        await buf.end_segment(it, "stop", ids, [-0.5] * len(ids), [0] * len(ids))
        await buf.close()

    asyncio.run(setup())
    assert cli_main(["inspect", "g0/0", "--redis_url", redis_url, "--run", "t", "--json",
                     "--tokenizer", str(tiny_model_dir)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["text"] == tok.decode(ids) and d["status"] == "complete" and d["finish_reason"] == "stop"


async def test_more_error_paths_change_nothing(redis_url):
    buf = await open_buf(redis_url, n_samples_per_prompt=2, rollout_batch_size=2, train_batch_groups=1)
    with pytest.raises(BadRequest, match="n_samples"):
        await buf.feed([PromptGroup("x", [1], {}, n_samples=0)], 0)
    await feed(buf, 2)
    with pytest.raises(BadRequest, match="max_items"):
        await buf.claim("w", 0)
    assert await buf.renew([]) == 0
    with pytest.raises(TimeoutError):
        await buf.wait_batch(1, timeout_seconds=0.1)
    # a damaged fresh sample: claim reports it and leases nothing of it
    key = buf.prefix + "sample:g0/0"
    await buf.redis.hset(key, "ids", b"\x00")
    with pytest.raises(MalformedData):
        await buf.claim("w", 1)
    assert (await buf.redis.hget(key, "status")) == b"pending"
    await buf.redis.hset(key, "ids", b"")
    items = await buf.claim("w", 4)
    a = next(i for i in items if i.sample_id == "g0/0")
    await gen(buf, a, 2, 0, "stop")
    # a damaged group: score refuses and the sample stays COMPLETE
    await buf.redis.hset(buf.prefix + "group:g0", "n_scored", "x")
    with pytest.raises(MalformedData):
        await buf.score(a, reward=1.0)
    assert (await buf.get_sample("g0/0")).status == SampleStatus.COMPLETE
    with pytest.raises(BadRequest):
        await buf.score(a, reward=1.0, advantages=float("nan"))
    with pytest.raises(BadRequest):
        await buf.score(a, reward=1.0, advantages=[float("nan"), 0.0])
    ghost = type(a)(**{**a.__dict__, "sample_id": "zz/0"})
    with pytest.raises(UnknownItem):
        await buf.score(ghost, reward=1.0)
    with pytest.raises(BadRequest):
        await buf.clock.publish(-1, "u", "c")
    # the run was drained under an open client: every script says so, nothing is recreated
    await buf.drain()
    with pytest.raises(SchemaMismatch, match="no schema key"):
        await buf.claim("w", 1)
    assert await buf.redis.keys(buf.prefix.replace("{", "\\{").replace("}", "\\}") + "*") == []
    await buf.close()
