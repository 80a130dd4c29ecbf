"""Selective rollout (GRESO, arXiv:2506.02177): the rule's maths, the buffer-side history, the books, resume.

Real redis-server (killed with SIGKILL and restarted from its AOF for the resume), the tiny model's
tokenizer, the real :class:`asyncrl.feeder.feeder.Feeder` and :class:`asyncrl.tasks.tasks.TrainPromptStream`;
samples are generated and scored through the buffer API with rewards chosen per train problem:
EASY problems are always solved (all-correct groups), HARD never (all-wrong), the rest half.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.core.config import load_config
from asyncrl.core.config_sections import SelectiveRolloutConfig
from asyncrl.feeder.feeder import Feeder, group_id_for
from asyncrl.feeder.prompt_filter import PassRateFilter
from asyncrl.feeder.selective_rollout import SelectiveRollout, explore_draw, skip_probability
from asyncrl.tasks.tasks import TrainPromptStream
from buffers import BufferSettings, ReplayBuffer
from buffers.errors import BadRequest
from buffers.pass_rates import PromptHistory

N = 20  # train prompts per epoch
EASY = {0, 3, 4, 7, 9, 12, 15}
HARD = {1, 5, 10, 13, 18}
SEED = 0  # the prompt stream's seed (data.seed)


# ---------------------------------------------------------------------------------------------- the rule


def test_skip_probability_is_greso_with_a_floor():
    assert skip_probability(0, 0.5, 0.05) == 0.0  # no zero-variance history: always fed
    assert skip_probability(1, 0.5, 0.05) == 0.5
    assert skip_probability(3, 0.5, 0.05) == 1 - 0.5 ** 3
    assert skip_probability(5, 0.5, 0.05) == pytest.approx(0.95)  # 0.5**5 < floor: capped at 1 - p_min
    assert skip_probability(1000, 0.9, 0.01) == pytest.approx(0.99)
    assert skip_probability(7, 1.0, 0.05) == 0.0  # p = 1: that kind is never skipped
    assert skip_probability(7, 0.5, 1.0) == 0.0  # floor 1: the rule never skips
    for p, floor in ((0.0, 0.05), (0.5, 0.0), (1.5, 0.05), (0.5, 1.01)):
        with pytest.raises(ValueError, match="must be in"):
            skip_probability(1, p, floor)


def test_explore_draw_is_a_deterministic_uniform_per_visit():
    assert explore_draw(3, 17, 2) == explore_draw(3, 17, 2)
    assert len({explore_draw(0, 17, c) for c in range(50)}) == 50  # a new draw at every visit (dataset position)
    assert explore_draw(0, 17, 2) != explore_draw(1, 17, 2)  # and per data seed
    draws = [explore_draw(0, p, e) for p in range(100) for e in range(100)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    assert abs(sum(u < 0.3 for u in draws) / len(draws) - 0.3) < 0.01


class _Stream:
    seed = 0

    def __len__(self) -> int:
        return N


def _rule(**kw) -> SelectiveRollout:
    return SelectiveRollout(None, _Stream(), SelectiveRolloutConfig(enabled=True, **kw))


def test_decide_uses_the_kind_the_streak_and_the_draw():
    rule = _rule(p_easy=0.5, p_hard=0.9, explore_floor=0.05, max_consecutive_skips=3)
    assert rule.decide(0, 4, PromptHistory(0, None, 0)) is None  # mixed / no history
    visits = [(c, p) for c in range(0, 40 * N, N) for p in range(N)]
    for streak, reward, p, kind in ((1, 1.0, 0.5, "easy"), (2, 0.0, 0.9, "hard"), (4, 0.5, 0.5, "easy")):
        got = [rule.decide(c, prob, PromptHistory(streak, reward, 0)) for c, prob in visits]
        expected = [kind if explore_draw(0, prob, c) < skip_probability(streak, p, 0.05) else None
                    for c, prob in visits]
        assert got == expected and kind in got and None in got
    # skipped max_consecutive_skips visits in a row: fed whatever the draw
    assert all(rule.decide(c, prob, PromptHistory(50, 1.0, 3)) is None for c, prob in visits)
    assert any(rule.decide(c, prob, PromptHistory(50, 1.0, 2)) for c, prob in visits)


def test_no_prompt_is_skipped_forever():
    """Simulated visits of prompts that stay all-correct: the floor and the cap bound every skip run."""
    longest = {}
    for cap, floor in ((5, 0.05), (100_000, 0.05), (100_000, 0.2)):
        rule = _rule(p_easy=0.5, explore_floor=floor, max_consecutive_skips=cap)
        runs, fed = [], 0
        for prob in range(N):
            skips = 0
            for epoch in range(400):
                if rule.decide(epoch * N, prob, PromptHistory(30, 1.0, skips)):
                    skips += 1  # feed.lua: prompt_skips += 1
                else:
                    runs.append(skips)
                    skips, fed = 0, fed + 1  # its group finishes: score.lua clears prompt_skips
            runs.append(skips)
        assert max(runs) <= cap
        assert all(r < 400 for r in runs)  # every prompt was fed at some point
        share = fed / (N * 400)
        assert share >= floor * 0.8, (cap, floor, share)  # fed at least about p_min of its visits
        longest[cap, floor] = max(runs)
    assert longest[100_000, 0.05] > 5  # without the cap the floor alone allows longer runs: the cap binds


def test_config_bounds_and_the_n_check(tiny_model_dir):
    for bad in ({"p_easy": 0.0}, {"p_hard": 1.5}, {"explore_floor": 0.0}, {"explore_floor": 2.0},
                {"max_consecutive_skips": 0}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            SelectiveRolloutConfig(**bad)
    with pytest.raises(ValueError, match="selective_rollout"):
        load_config(["--n_samples_per_prompt", "1", "--trainer.advantage", "reinforce_pp",
                     "--data.selective_rollout.enabled", "true"])
    cfg = load_config(["--data.selective_rollout.enabled", "true", "--data.selective_rollout.p_easy", "0.3"])
    assert BufferSettings.from_config(cfg).record_prompt_history and cfg.data.selective_rollout.p_easy == 0.3
    assert not BufferSettings.from_config(load_config([])).record_prompt_history


# ---------------------------------------------------------------------------------------------- the buffer


def _cfg(tiny_model_dir, run: str, *extra: str):
    return load_config(["--model_path", str(tiny_model_dir), "--rollout_batch_size", str(N), "--n_samples_per_prompt",
                        "2", "--run_name", run, "--data.num_train_prompts", str(N), "--max_response_len", "8",
                        "--max_budget", "8", "--max_staleness", "9", "--data.selective_rollout.enabled", "true",
                        *extra])


@pytest.fixture
def tokenizer(tiny_model_dir):
    from asyncrl.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def _feeder(buf, cfg, tokenizer, target_pending: int = 100) -> tuple[Feeder, TrainPromptStream]:
    stream = TrainPromptStream(cfg.data, tokenizer, seed=SEED)
    pf = PassRateFilter(buf, stream, cfg.data.dataset_filter_threshold, cfg.data.dataset_max_filter_percentage)
    sel = SelectiveRollout(buf, stream, cfg.data.selective_rollout)
    return Feeder(buf, stream, buf.settings.samples_generated, target_pending, prompt_filter=pf, selective=sel), stream


def _reward(problem: int, index: int) -> float:
    return 1.0 if problem in EASY else 0.0 if problem in HARD else float(index % 2)


async def _score_everything(buf, stream) -> int:
    scored = 0
    while items := await buf.claim("w", max_items=64):
        for it in items:
            await buf.end_segment(it, "stop", [5, 6], [-1.0, -1.0], [it.clock_version] * 2)
            assert it.metadata["problem_index"] == stream.problem_index(it.metadata["cursor"])
            assert it.metadata["problem_key"] == stream.problem_key(it.metadata["cursor"])
            await buf.score(it, reward=_reward(it.metadata["problem_index"], it.index))
            scored += 1
    return scored


async def _histories(buf, stream) -> dict:
    """Train problem index -> its :class:`PromptHistory` (the buffer keys histories by problem key)."""
    keys = [stream.key_of_problem(p) for p in range(N)]
    assert len(set(keys)) == N  # the N problems are distinct, so index and key name the same problem
    hist = await buf.prompt_histories(keys)
    return {p: hist[k] for p, k in enumerate(keys)}


def _draw_at_visit(stream, problem: int, epoch: int) -> float:
    """The selective rule's draw for train problem ``problem``'s visit in ``epoch``."""
    c = next(c for c in range(epoch * N, (epoch + 1) * N) if stream.problem_index(c) == problem)
    return explore_draw(SEED, stream.key_of_problem(problem), c)


async def _feed_until(feeder, buf, cursor: int) -> None:
    while await buf.dataset_cursor() < cursor:
        assert await feeder.feed_once() > 0


async def _fed_positions(buf, start: int, stop: int) -> list[int]:
    return [c for c in range(start, stop) if await buf.redis.exists(buf.prefix + f"group:{group_id_for(c)}")]


@pytest.mark.integration
async def test_history_is_recorded_when_groups_finish_and_skips_are_counted(tiny_model_dir, tokenizer, redis_url):
    cfg = _cfg(tiny_model_dir, "selective")
    async with await ReplayBuffer.open(redis_url, cfg.run.name, BufferSettings.from_config(cfg)) as buf:
        feeder, stream = _feeder(buf, cfg, tokenizer)
        await _feed_until(feeder, buf, N)  # epoch 0: no history, nothing skipped
        assert feeder.skipped_prompts == 0 and await _score_everything(buf, stream) == 2 * N
        hist = await _histories(buf, stream)
        assert {p for p, h in hist.items() if h.streak} == EASY | HARD
        assert all(hist[p] == PromptHistory(1, 1.0, 0) for p in EASY)
        assert all(hist[p] == PromptHistory(1, 0.0, 0) for p in HARD)

        # epoch 1: streak 1, p = 0.5: a prompt is skipped when its draw is below 0.5
        await _feed_until(feeder, buf, 2 * N)
        expected = {p for p in EASY | HARD if _draw_at_visit(stream, p, 1) < 0.5}
        assert expected and expected != EASY | HARD  # the data exercise both outcomes
        fed = await _fed_positions(buf, N, 2 * N)
        assert {stream.problem_index(c) for c in fed} == set(range(N)) - expected
        books = await buf.books()
        assert books["balanced"], books
        assert books["skipped_by_reason"] == {"zero_variance_predicted": len(expected)}
        assert books["cursor"] == 2 * N and books["fed"] == N + len(fed)
        s = (await buf.stats())["sampling"]
        assert s["skipped_zero_variance_predicted"] == len(expected) == feeder.predicted_skips
        assert s["predicted_skips_easy"] == len(expected & EASY) and s["predicted_skips_hard"] == len(expected & HARD)
        assert s["predicted_skip_share"] == len(expected) / (N + len(fed) + len(expected))  # of all visits
        hist = await _histories(buf, stream)
        assert {p for p, h in hist.items() if h.skips} == expected and all(hist[p].skips == 1 for p in expected)

        # the fed visits finish: their streaks grow, their skip counts clear; a mixed one stays 0
        await _score_everything(buf, stream)
        hist = await _histories(buf, stream)
        for p in EASY | HARD:
            assert hist[p] == (PromptHistory(1, hist[p].reward, 1) if p in expected else
                               PromptHistory(2, 1.0 if p in EASY else 0.0, 0))
        assert all(hist[p].streak == 0 for p in set(range(N)) - EASY - HARD)

        # a position that is neither fed nor counted unbalances the books (the check can fail)
        await buf.redis.incr(buf.prefix + "cursor")
        assert not (await buf.books())["balanced"]


@pytest.mark.integration
async def test_history_follows_a_problem_that_recurs_within_an_epoch(tiny_model_dir, tokenizer, redis_url):
    """The main job's case: a generated task draws its ~90 distinct problems (one-digit sums) at
    the positions of one 100,000-prompt epoch, so problems recur long before the epoch ends. The
    history is keyed by the problem (a hash of its text), so the rule acts at a problem's next visit
    within the epoch; keyed by position in the epoch (``problem_index``) it never would."""
    cfg = load_config(["--model_path", str(tiny_model_dir), "--rollout_batch_size", "40", "--n_samples_per_prompt",
                       "2", "--run_name", "recurring", "--data.num_train_prompts", "100000",
                       "--data.arithmetic.digits", "1", "--data.arithmetic.operators", "+", "--max_response_len", "8",
                       "--max_budget", "8", "--max_staleness", "9", "--data.selective_rollout.enabled", "true"])
    first = 60
    async with await ReplayBuffer.open(redis_url, cfg.run.name, BufferSettings.from_config(cfg)) as buf:
        feeder, stream = _feeder(buf, cfg, tokenizer, target_pending=first)
        keys = [stream.problem_key(c) for c in range(first)]
        assert len({stream.problem_index(c) for c in range(first)}) == first  # no position index repeats,
        assert len(set(keys)) < first  # but problems do
        await _feed_until(feeder, buf, first)
        assert feeder.predicted_skips == 0  # no history yet
        while items := await buf.claim("w", max_items=64):  # every group all-correct
            for it in items:
                await buf.end_segment(it, "stop", [5, 6], [-1.0, -1.0], [it.clock_version] * 2)
                await buf.score(it, reward=1.0)
        hist = await buf.prompt_histories(sorted(set(keys)))
        assert all(1 <= hist[k].streak <= keys.count(k) and hist[k].reward == 1.0 for k in set(keys))

        feeder.target_pending = 100
        await _feed_until(feeder, buf, first + 100)
        end = await buf.dataset_cursor()
        expected_fed, skips = [], {k: 0 for k in hist}
        for c in range(first, end):  # the rule, replayed on the history the buffer holds
            k, h = stream.problem_key(c), None
            h = hist.get(k)
            if h is not None and skips[k] < cfg.data.selective_rollout.max_consecutive_skips and \
                    explore_draw(SEED, k, c) < skip_probability(h.streak, 0.5, cfg.data.selective_rollout.explore_floor):
                skips[k] += 1
            else:
                expected_fed.append(c)
        assert await _fed_positions(buf, first, end) == expected_fed
        skipped = sorted(set(range(first, end)) - set(expected_fed))
        assert skipped and all(stream.problem_key(c) in hist for c in skipped)  # only problems seen before
        books = await buf.books()
        assert books["balanced"] and books["skipped_by_reason"] == {"zero_variance_predicted": len(skipped)}
        assert (await buf.stats())["sampling"]["predicted_skips_easy"] == len(skipped)


@pytest.mark.integration
async def test_history_rules_for_late_and_repeated_finishes(redis_url):
    """An older visit finishing after a newer one changes nothing; a visit finishing again (a
    restarted group) replaces its own outcome instead of extending the streak."""
    settings = BufferSettings(rollout_batch_size=4, train_batch_groups=1, n_samples_per_prompt=2, max_staleness=9,
                              record_prompt_history=True)
    async with await ReplayBuffer.open(redis_url, "history", settings) as buf:
        await buf.feed([buf.make_group(f"g{c}", [1], {"problem_key": 7}) for c in range(3)], 0)
        rewards = {"g0": (1.0, 0.0), "g1": (1.0, 1.0), "g2": (1.0, 1.0)}
        items = {}
        while claimed := await buf.claim("w", max_items=8):
            for it in claimed:
                await buf.end_segment(it, "stop", [5], [-1.0], [0])
                items[it.sample_id] = it
        for sid in ("g1/0", "g1/1", "g2/0", "g2/1"):  # visits 1 and 2 finish first: streak 2
            await buf.score(items[sid], reward=rewards[sid[:2]][int(sid[-1])])
        assert (await buf.prompt_histories([7]))[7] == PromptHistory(2, 1.0, 0)
        for sid in ("g0/0", "g0/1"):  # visit 0 (mixed) finishes last: older, ignored
            await buf.score(items[sid], reward=rewards["g0"][int(sid[-1])])
        assert (await buf.prompt_histories([7]))[7] == PromptHistory(2, 1.0, 0)
        raw = await buf.redis.hget(buf.prefix + "prompt_history", "7")
        assert raw.decode() == "2 1 2 1 1"  # z r cursor base_z base_r
        # the same visit (cursor 2) finishing again, all-wrong this time: base (1, 1) + hard -> streak 1
        await buf.redis.hset(buf.prefix + "prompt_skips", "7", 4)
        await buf.feed([buf.make_group("again", [1], {"problem_key": 7})], 3)
        await buf.redis.hset(buf.prefix + "group:again", "feed_index", 2)
        for it in await buf.claim("w", max_items=8):
            await buf.end_segment(it, "stop", [5], [-1.0], [0])
            await buf.score(it, reward=0.0)
        assert (await buf.prompt_histories([7]))[7] == PromptHistory(1, 0.0, 0)
        # a group without a problem index (not made by the feeder) records nothing; damaged entries read as none
        await buf.redis.hset(buf.prefix + "prompt_history", "8", "garbage")
        assert (await buf.prompt_histories([8, 9])) == {8: PromptHistory(0, None, 0), 9: PromptHistory(0, None, 0)}


@pytest.mark.integration
async def test_bad_predicted_skips_change_nothing(redis_url):
    settings = BufferSettings(rollout_batch_size=4, train_batch_groups=1, n_samples_per_prompt=2)
    async with await ReplayBuffer.open(redis_url, "badpred", settings) as buf:
        for bad in ([(3, "medium")], [(-1, "easy")], [("3", "easy")]):
            with pytest.raises(BadRequest, match="predicted skip"):
                await buf.feed([buf.make_group("g0", [1])], 0, predicted=bad)
        assert await buf.dataset_cursor() == 0 and (await buf.books())["fed"] == 0
        # the script checks too (a client that skipped the Python validation)
        with pytest.raises(BadRequest, match="predicted skip"):
            await buf._run("feed", 0, 0, 0, 1, "3", "medium")
        assert await buf.dataset_cursor() == 0 and await buf.redis.hgetall(buf.prefix + "prompt_skips") == {}
        assert await buf.feed([buf.make_group("g0", [1])], 0, skip=1, predicted=[(3, "easy"), (4, "hard")]) == 1
        books = await buf.books()
        assert books["cursor"] == 4 and books["balanced"]
        assert books["skipped_by_reason"] == {"pass_rate_filter": 1, "zero_variance_predicted": 2}


async def _run_epochs(redis_server, cfg, tokenizer, epochs: int, kill_at: int | None = None) -> dict:
    """Epoch 0, then feed ``epochs`` more in small steps, scoring everything between feeds; with
    ``kill_at``, Redis is SIGKILLed (and restarted from its AOF) and a new feeder takes over once the
    cursor has passed ``kill_at``. Returns what the run fed and skipped."""
    settings = BufferSettings.from_config(cfg)
    buf = await ReplayBuffer.open(redis_server.url, cfg.run.name, settings)
    feeder, stream = _feeder(buf, cfg, tokenizer, target_pending=3)
    killed_at = None
    try:
        while (cursor := await buf.dataset_cursor()) < (epochs + 1) * N:
            if kill_at is not None and killed_at is None and cursor >= kill_at:
                killed_at = cursor
                await buf.close()
                redis_server.kill()
                redis_server.start()
                buf = await ReplayBuffer.open(redis_server.url, cfg.run.name, settings)
                feeder, stream = _feeder(buf, cfg, tokenizer, target_pending=3)  # nothing in memory
            assert await feeder.feed_once() > 0
            await _score_everything(buf, stream)
        end = await buf.dataset_cursor()
        return {"end": end, "killed_at": killed_at, "fed": await _fed_positions(buf, 0, end),
                "books": await buf.books(), "history": await _histories(buf, stream)}
    finally:
        await buf.close()


@pytest.mark.integration
async def test_a_resumed_feeder_neither_repeats_nor_loses_a_prompt(tiny_model_dir, tokenizer, redis_server):
    """The same run killed mid-epoch (feeder and Redis) and resumed feeds and skips exactly what
    an uninterrupted run does."""
    straight = await _run_epochs(redis_server, _cfg(tiny_model_dir, "straight"), tokenizer, epochs=3)
    resumed = await _run_epochs(redis_server, _cfg(tiny_model_dir, "resumed"), tokenizer, epochs=3,
                                kill_at=2 * N + N // 2)
    assert resumed["killed_at"] is not None and resumed["killed_at"] % N != 0  # mid-epoch
    for run in (straight, resumed):
        books = run["books"]
        assert books["balanced"], books
        assert books["cursor"] == run["end"] and books["fed"] == len(run["fed"])
        assert books["skipped_by_reason"]["zero_variance_predicted"] == run["end"] - len(run["fed"]) > 0
    assert resumed["fed"] == straight["fed"]  # the same positions fed, hence the same ones skipped
    assert resumed["end"] == straight["end"] and resumed["history"] == straight["history"]
    for key in ("predicted_skips_easy", "predicted_skips_hard"):
        assert resumed["books"][key] == straight["books"][key]


@pytest.mark.integration
async def test_selective_rollout_composes_with_the_pass_rate_filter(tiny_model_dir, tokenizer, redis_url):
    cfg = _cfg(tiny_model_dir, "both", "--data.dataset_filter_threshold", "0.9",
               "--data.dataset_max_filter_percentage", "0.2")
    async with await ReplayBuffer.open(redis_url, cfg.run.name, BufferSettings.from_config(cfg)) as buf:
        feeder, stream = _feeder(buf, cfg, tokenizer)
        await _feed_until(feeder, buf, N)
        await _score_everything(buf, stream)
        await _feed_until(feeder, buf, 2 * N)
        removed = set(sorted(EASY)[:4])  # floor(20 * 0.2) = 4 all-correct prompts, lowest index first
        assert set(await buf.filtered_prompts()) == removed
        predicted = {p for p in (EASY | HARD) - removed if _draw_at_visit(stream, p, 1) < 0.5}
        assert predicted & EASY and predicted & HARD
        fed = {stream.problem_index(c) for c in await _fed_positions(buf, N, 2 * N)}
        assert fed == set(range(N)) - removed - predicted  # each position has exactly one fate
        books = await buf.books()
        assert books["balanced"], books
        assert books["skipped_by_reason"] == {"pass_rate_filter": len(removed), "zero_variance_predicted": len(predicted)}
        hist = await _histories(buf, stream)
        assert {p for p, h in hist.items() if h.skips} == predicted  # filtered prompts are not predicted skips


@pytest.mark.integration
async def test_skips_reach_the_step_records_and_the_reconciliation(redis_url):
    """The controller's BufferWatcher writes the skip counts and share; its reconciliation line names both reasons."""
    from asyncrl.controller.run_watch import BufferWatcher, reconcile_groups

    settings = BufferSettings(rollout_batch_size=4, train_batch_groups=1, n_samples_per_prompt=2)
    async with await ReplayBuffer.open(redis_url, "skipmetrics", settings) as buf:
        await buf.feed([buf.make_group(f"p{c:09d}", [1]) for c in range(3)], 0, skip=1,
                       predicted=[(4, "easy"), (5, "easy"), (6, "hard")])
        m = await BufferWatcher(buf).poll(1.0)
        assert m["buffer/skipped_zero_variance_predicted"] == 3 and m["buffer/skipped_prompts"] == 4
        assert m["buffer/predicted_skips_easy"] == 2 and m["buffer/predicted_skips_hard"] == 1
        assert m["buffer/predicted_skip_share"] == 0.5  # 3 skipped of 3 fed + 3 skipped
        ok, text = reconcile_groups(await buf.stats())
    assert ok, text
    assert text.endswith("dataset cursor 7 = fed 3 + prompts skipped by the pass-rate filter 1 + by selective "
                         "rollout (predicted zero variance) 3"), text


def test_buffer_stats_cli_shows_the_skips(redis_url, capsys):
    import asyncio

    from buffers.cli import main as cli_main

    async def setup():
        settings = BufferSettings(rollout_batch_size=4, train_batch_groups=1, n_samples_per_prompt=2)
        async with await ReplayBuffer.open(redis_url, "clistats", settings) as buf:
            await buf.feed([buf.make_group("p000000000", [1])], 0, skip=2, predicted=[(3, "hard")])

    asyncio.run(setup())
    assert cli_main(["stats", "--redis_url", redis_url, "--run", "clistats"]) == 0
    out = capsys.readouterr().out
    assert "predicted zero-variance skips 1 (easy 0, hard 1; share of visits 0.500)" in out, out
    assert "prompts skipped by reason: pass_rate_filter 2, zero_variance_predicted 1" in out, out
