"""Best-of-n and DAPO dynamic sampling in the buffer (real redis-server), and their books.

Best-of-n (``generation_size`` G > n): a group generates G samples; when the last one is scored
the score script keeps the n with the highest reward (ties: longer response, then lower index)
and marks the others DISCARDED, counted ``discarded_best_of_n``. Dynamic sampling: a finished
group whose kept rewards are all equal is dropped with reason ``zero_variance`` in that same
script, and admission control backfills its slot. ``buf.books()`` must balance with either on.
"""

from __future__ import annotations

import random

import pytest

from asyncrl.core.config import load_config
from asyncrl.core.types import GroupState, SampleStatus, WorkKind
from buffers import BadRequest, BufferSettings, ReplayBuffer

pytestmark = pytest.mark.integration


def _settings(**kw) -> BufferSettings:
    base = dict(rollout_batch_size=4, train_batch_groups=1, n_samples_per_prompt=3, max_budget=64,
                max_response_len=64, max_staleness=0, stale_policy="restart", lease_seconds=30.0)
    return BufferSettings(**{**base, **kw})


async def _finish(buf: ReplayBuffer, reward_of, length_of=lambda it: 2) -> dict[str, GroupState]:
    """Generate and score every claimable sample: ``length_of(item)`` tokens, ``reward_of(item)``
    (a float, or an Exception to fail it). Returns the last state of each group."""
    states: dict[str, GroupState] = {}
    while True:
        items = await buf.claim("w", max_items=64)
        if not items:
            return states
        for it in items:
            assert it.kind is WorkKind.GENERATE
            n = length_of(it)
            status = await buf.end_segment(it, "stop", [7] * n, [-0.5] * n, [it.clock_version] * n)
            assert status is SampleStatus.COMPLETE
            r = reward_of(it)
            if isinstance(r, Exception):
                states[it.group_id] = await buf.score(it, error=str(r))
            else:
                states[it.group_id] = await buf.score(it, reward=r)


async def _train_all(buf: ReplayBuffer, step: int = 1) -> list:
    """Form batches until none is left (smaller last batch allowed), acknowledge and commit each."""
    batches = []
    while True:
        batch = await buf.next_batch(step, min_groups=1)
        if batch is None:
            return batches
        batches.append(batch)
        assert await buf.acknowledge(batch, step)
        await buf.commit(step)
        step += 1


async def test_best_of_n_keeps_the_best_by_reward_then_length_then_index(redis_url):
    rewards = {0: 0.5, 1: 1.0, 2: 1.0, 3: 0.0, 4: 0.5}
    lengths = {0: 3, 1: 2, 2: 4, 3: 5, 4: 3}  # 2 before 1 (longer), 0 before 4 (same length: lower index)
    async with await ReplayBuffer.open(redis_url, "bon", _settings(generation_size=5)) as buf:
        group = buf.make_group("g0", [1, 2, 3])
        assert group.n_samples == 5
        await buf.feed([group], 0)
        states = await _finish(buf, lambda it: rewards[it.index], lambda it: lengths[it.index])
        assert states == {"g0": GroupState.READY}
        _, samples = await buf.get_group("g0")
        assert [s.status for s in samples] == [SampleStatus.SCORED, SampleStatus.SCORED, SampleStatus.SCORED,
                                               SampleStatus.DISCARDED, SampleStatus.DISCARDED]
        assert samples[3].reward == 0.0 and len(samples[3].response_ids) == 5  # kept for inspection
        st = await buf.stats()
        assert st["counters"]["discarded_best_of_n"] == 2 and st["samples_by_state"]["discarded"] == 2
        assert st["sampling"]["discarded_best_of_n"] == 2
        (batch,) = await _train_all(buf)
        (bg,) = batch.groups
        assert [s.index for s in bg.samples] == [0, 1, 2] and bg.n_failed == 0
        books = await buf.books()
        assert books["balanced"], books
        assert books["fed"] == books["committed_groups"] == 1 and books["discarded_best_of_n"] == 2


@pytest.mark.parametrize("seed", [0, 1])
async def test_best_of_n_matches_a_reference_selection(redis_url, seed):
    rng = random.Random(seed)
    G, n, groups = 6, 3, 5
    rewards = {(g, i): rng.choice([0.0, 0.5, 1.0]) for g in range(groups) for i in range(G)}
    lengths = {(g, i): rng.randint(1, 3) for g in range(groups) for i in range(G)}
    settings = _settings(rollout_batch_size=groups, train_batch_groups=groups, n_samples_per_prompt=n,
                         generation_size=G)
    async with await ReplayBuffer.open(redis_url, f"ref{seed}", settings) as buf:
        await buf.feed([buf.make_group(f"g{g}", [1, 2]) for g in range(groups)], 0)
        key = lambda it: (int(it.group_id[1:]), it.index)  # noqa: E731
        await _finish(buf, lambda it: rewards[key(it)], lambda it: lengths[key(it)])
        batch = await buf.next_batch(1)
        for bg in batch.groups:
            g = int(bg.group.group_id[1:])
            expect = sorted(range(G), key=lambda i: (-rewards[g, i], -lengths[g, i], i))[:n]
            assert sorted(s.index for s in bg.samples) == sorted(expect), (g, rewards, lengths)
        assert (await buf.stats())["counters"]["discarded_best_of_n"] == groups * (G - n)


async def test_best_of_n_with_a_failed_sample_keeps_the_best_of_the_scored(redis_url):
    rewards = {0: RuntimeError("verifier crashed"), 1: 0.0, 2: 1.0, 3: 0.5}
    async with await ReplayBuffer.open(redis_url, "bonfail", _settings(n_samples_per_prompt=2, generation_size=4)) as buf:
        await buf.feed([buf.make_group("g0", [1])], 0)
        assert await _finish(buf, lambda it: rewards[it.index]) == {"g0": GroupState.READY}
        (batch,) = await _train_all(buf)
        (bg,) = batch.groups
        assert [s.index for s in bg.samples] == [2, 3] and bg.n_failed == 1
        st = await buf.stats()
        assert st["counters"]["discarded_best_of_n"] == 1 and st["counters"]["failed_samples:reward_error"] == 1
        assert (await buf.books())["balanced"]


async def test_a_restarted_best_of_n_group_regenerates_every_sample(redis_url):
    """A stale READY group sent back whole (stale_batch, restart) loses its DISCARDED marks too."""
    async with await ReplayBuffer.open(redis_url, "bonrestart", _settings(generation_size=4)) as buf:
        await buf.feed([buf.make_group("g0", [1])], 0)
        await _finish(buf, lambda it: float(it.index))
        await buf.clock.publish(1, "file:///w1", "c1")
        assert await buf.next_batch(1) is None  # staleness 1 > eta 0: restarted whole
        group, samples = await buf.get_group("g0")
        assert group.state is GroupState.GENERATING
        assert [s.status for s in samples] == [SampleStatus.PENDING] * 4
        assert (await buf.redis.hget(buf.prefix + "group:g0", "n_discarded")) == b"0"
        assert await _finish(buf, lambda it: float(-it.index)) == {"g0": GroupState.READY}
        (batch,) = await _train_all(buf)
        assert [s.index for s in batch.groups[0].samples] == [0, 1, 2]  # now the lowest indices are best
        st = await buf.stats()
        assert st["counters"]["discarded_best_of_n"] == 2 and st["counters"]["restarted_groups:stale_batch"] == 1
        assert (await buf.books())["balanced"]


@pytest.mark.parametrize("dynamic", [True, False])
async def test_dynamic_sampling_drops_zero_variance_groups_and_backfills(redis_url, dynamic):
    rewards = {"g0": (1.0, 1.0), "g1": (0.0, 1.0), "g2": (0.0, 0.0), "g3": (1.0, 0.0)}
    # eta 1: the staleness bound admits 4 groups at version 0 even when none is dropped
    settings = _settings(rollout_batch_size=2, train_batch_groups=2, n_samples_per_prompt=2, max_staleness=1,
                         dynamic_sampling=dynamic)
    async with await ReplayBuffer.open(redis_url, f"dyn{dynamic}", settings) as buf:
        await buf.feed([buf.make_group(g, [1]) for g in rewards], 0)
        assert await buf.pending_groups() == 2  # R = 2 in flight
        states = await _finish(buf, lambda it: rewards[it.group_id][it.index])
        st = await buf.stats()
        assert st["sampling"]["finished_groups"] == 4 and st["sampling"]["zero_variance_groups"] == 2
        assert st["sampling"]["zero_variance_share"] == 0.5
        if dynamic:
            # the dropped groups' slots were refilled at once (the feeder keeps R in flight)
            assert states == {"g0": GroupState.DROPPED, "g1": GroupState.READY,
                              "g2": GroupState.DROPPED, "g3": GroupState.READY}
            assert await buf.dropped_groups() == {"g0": "zero_variance", "g2": "zero_variance"}
            assert st["dropped_by_reason"] == {"zero_variance": 2}
            # the zero-variance group of the first pair did not hold up the batch: it holds g1 and g3
            assert [bg.group.group_id for bg in (await buf.next_batch(1)).groups] == ["g1", "g3"]
        else:
            assert set(states.values()) == {GroupState.READY} and not await buf.dropped_groups()
        await _train_all(buf)
        books = await buf.books()
        assert books["balanced"], books
        assert books["dropped_by_reason"] == ({"zero_variance": 2} if dynamic else {})
        assert books["committed_groups"] == (2 if dynamic else 4) and books["live_groups"] == 0


async def test_dynamic_sampling_judges_the_kept_samples_of_best_of_n(redis_url):
    rewards = {"g0": (1.0, 1.0, 0.0, 0.0), "g1": (1.0, 0.0, 0.0, 0.0)}
    settings = _settings(rollout_batch_size=2, n_samples_per_prompt=2, generation_size=4, dynamic_sampling=True)
    async with await ReplayBuffer.open(redis_url, "dynbon", settings) as buf:
        await buf.feed([buf.make_group(g, [1]) for g in rewards], 0)
        states = await _finish(buf, lambda it: rewards[it.group_id][it.index])
        # g0: its best two are both 1.0 -> no signal, dropped whole (its discards are not counted)
        assert states == {"g0": GroupState.DROPPED, "g1": GroupState.READY}
        st = await buf.stats()
        assert st["counters"]["discarded_best_of_n"] == 2 and st["dropped_by_reason"] == {"zero_variance": 1}
        await _train_all(buf)
        assert (await buf.books())["balanced"]


async def test_books_detect_a_group_that_went_missing(redis_url):
    """The reconciliation can fail: a group deleted behind the buffer's back unbalances it."""
    async with await ReplayBuffer.open(redis_url, "lost", _settings()) as buf:
        await buf.feed([buf.make_group("g0", [1]), buf.make_group("g1", [1])], 0)
        assert (await buf.books())["balanced"]
        await buf.redis.zrem(buf.prefix + "groups", "g0")  # admitted (g1 waits in pending)
        assert not (await buf.books())["balanced"]


def test_settings_and_config_reject_inconsistent_sampling_options(tmp_path):
    with pytest.raises(BadRequest, match="generation_size"):
        _settings(n_samples_per_prompt=4, generation_size=3)
    with pytest.raises(BadRequest, match="dynamic_sampling"):
        _settings(n_samples_per_prompt=1, dynamic_sampling=True)
    assert _settings(generation_size=0).samples_generated == 3 and _settings(generation_size=7).samples_generated == 7
    with pytest.raises(ValueError, match="generation_size"):
        load_config(["--n_samples_per_prompt", "4", "--rollout.generation_size", "2"])
    with pytest.raises(ValueError, match="dynamic_sampling"):
        load_config(["--n_samples_per_prompt", "1", "--rollout.dynamic_sampling", "true",
                     "--trainer.advantage", "reinforce_pp"])
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        load_config(["--max_response_len", "64", "--trainer.loss.overlong_buffer_len", "64"])
    cfg = load_config(["--n_samples_per_prompt", "4", "--rollout.generation_size", "8", "--rollout.dynamic_sampling",
                       "true", "--data.dataset_max_filter_percentage", "0.1"])
    s = BufferSettings.from_config(cfg)
    assert (s.generation_size, s.dynamic_sampling, s.record_pass_rates) == (8, True, True)
    plain = BufferSettings.from_config(load_config([]))
    assert (plain.generation_size, plain.dynamic_sampling, plain.record_pass_rates) == (0, False, False)


async def test_zero_variance_share_reaches_the_step_records_and_prometheus(redis_url):
    """The controller's BufferWatcher (JSONL step records) and PrometheusExport report the share."""
    from asyncrl.metrics import exposition, stop_metrics_server
    from asyncrl.controller.run_watch import BufferWatcher, PrometheusExport

    rewards = {"g0": (1.0, 1.0, 0.0), "g1": (0.0, 1.0, 0.0), "g2": (0.0, 0.0, 1.0), "g3": (1.0, 0.0, 0.0)}
    settings = _settings(rollout_batch_size=4, n_samples_per_prompt=2, generation_size=3, max_staleness=3,
                         dynamic_sampling=True)
    async with await ReplayBuffer.open(redis_url, "share", settings) as buf:
        await buf.feed([buf.make_group(g, [1]) for g in rewards], 0)
        await _finish(buf, lambda it: rewards[it.group_id][it.index])
        m = await BufferWatcher(buf).poll(1.0)
        # best two of three: g0 (1, 1) has no signal and is dropped; g1, g2, g3 keep (1, 0), one discarded each
        assert m["buffer/finished_groups"] == 4 and m["buffer/zero_variance_groups"] == 1
        assert m["buffer/zero_variance_share"] == 0.25 and m["buffer/drops_zero_variance"] == 1
        assert m["buffer/discarded_best_of_n"] == 3
        stats = await buf.stats()
    cfg = load_config([], overrides={"monitoring": {"controller_metrics_port": 0}})
    export = PrometheusExport(cfg)
    try:
        export.update(stats, trainer_step=0, running=[])
        text = exposition(export.registry)[0].decode()
        values = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
        assert values["asyncrl_buffer_groups_finished_total"] == 4
        assert values["asyncrl_buffer_groups_zero_variance_total"] == 1
        assert values['asyncrl_buffer_groups_dropped_total{reason="zero_variance"}'] == 1
        assert values['asyncrl_buffer_samples_dropped_total{reason="best_of_n"}'] == 3
    finally:
        stop_metrics_server(export.port)


def test_controller_reconciliation_counts_skipped_prompts_and_discards():
    from asyncrl.controller.run_watch import reconcile_groups

    stats = {"dataset_cursor": 20, "counters": {"committed_groups": 9, "skipped_prompts:pass_rate_filter": 4,
                                                "discarded_best_of_n": 18},
             "groups_by_state": {"ready": 1}, "dropped_by_reason": {"zero_variance": 6}}
    ok, text = reconcile_groups(stats)
    assert ok and text.startswith("fed 16 = trained and committed 9 + in the buffer 1"), text
    assert "prompts skipped by the pass-rate filter 4" in text and "best-of-n discarded 18 samples" in text
    ok, text = reconcile_groups({**stats, "dataset_cursor": 21})  # a position neither fed nor skipped
    assert not ok and text.startswith("fed 17 != ")
