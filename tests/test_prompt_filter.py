"""AReaL's pass-rate dataset filter: the rule, and the feeder keeping solved prompts out across a resume.

Real redis-server (killed with SIGKILL and restarted from its AOF for the resume), the tiny
model's tokenizer, the real :class:`asyncrl.feeder.feeder.Feeder` and :class:`asyncrl.tasks.tasks.TrainPromptStream`;
samples are generated and scored through the buffer API with rewards chosen per train problem.
"""

from __future__ import annotations

import pytest

from asyncrl.core.config import load_config
from asyncrl.feeder.feeder import Feeder, group_id_for
from asyncrl.feeder.prompt_filter import PassRateFilter, select_filtered
from asyncrl.tasks.tasks import TrainPromptStream
from buffers import BufferSettings, ReplayBuffer

N = 6  # train prompts per epoch
SOLVED = {0, 2, 3, 5}  # train problem indices whose groups are all correct (pass rate 1)


def test_select_filtered_follows_areals_rule():
    rates = {0: 1.0, 1: 0.95, 2: 0.9, 3: 1.0, 4: 0.2, 5: 0.99}
    # strictly above the threshold, highest first, ties by lower index, floor(active * pct) of them
    assert select_filtered(rates, set(), 0.9, 0.5, 6) == {0: 1.0, 3: 1.0, 5: 0.99}
    assert select_filtered(rates, set(), 0.9, 0.34, 6) == {0: 1.0, 3: 1.0}
    # already removed prompts are not candidates and do not count as active
    assert select_filtered(rates, {0, 3}, 0.9, 0.5, 6) == {5: 0.99, 1: 0.95}
    assert select_filtered(rates, set(), 0.9, 0.0, 6) == {}
    assert select_filtered(rates, set(), 0.9, 0.1, 6) == {}  # floor(0.6) = 0
    # never every prompt: at least one stays
    assert select_filtered({0: 1.0, 1: 1.0}, set(), 0.5, 1.0, 2) == {0: 1.0}
    assert select_filtered({0: 1.0, 1: 1.0}, {1}, 0.5, 1.0, 2) == {}


@pytest.fixture
def cfg(tiny_model_dir):
    return load_config(["--model_path", str(tiny_model_dir), "--rollout_batch_size", str(N), "--n_samples_per_prompt",
                        "2", "--run_name", "passrate", "--data.num_train_prompts", str(N), "--max_response_len", "8",
                        "--max_budget", "8", "--max_staleness", "3", "--data.dataset_filter_threshold", "0.9",
                        "--data.dataset_max_filter_percentage", "0.5"])


@pytest.fixture
def tokenizer(tiny_model_dir):
    from asyncrl.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def _feeder(buf, cfg, tokenizer) -> tuple[Feeder, TrainPromptStream]:
    stream = TrainPromptStream(cfg.data, tokenizer, seed=cfg.run.seed)
    pf = PassRateFilter(buf, stream, cfg.data.dataset_filter_threshold, cfg.data.dataset_max_filter_percentage)
    return Feeder(buf, stream, buf.settings.samples_generated, target_pending=100, prompt_filter=pf), stream


async def _score_everything(buf, stream) -> int:
    """Generate and score every claimable sample; reward 1 for SOLVED problems, else 0/1 by index."""
    scored = 0
    while items := await buf.claim("w", max_items=64):
        for it in items:
            await buf.end_segment(it, "stop", [5, 6], [-1.0, -1.0], [it.clock_version] * 2)
            solved = stream.problem_index(it.metadata["cursor"]) in SOLVED
            await buf.score(it, reward=1.0 if solved else float(it.index % 2))
            scored += 1
    return scored


async def _feed_until(feeder, buf, cursor: int) -> None:
    while await buf.dataset_cursor() < cursor:
        assert await feeder.feed_once() > 0


@pytest.mark.integration
async def test_pass_rate_filter_removes_solved_prompts_and_survives_a_resume(cfg, tokenizer, redis_server):
    settings = BufferSettings.from_config(cfg)
    assert settings.record_pass_rates
    buf = await ReplayBuffer.open(redis_server.url, cfg.run.name, settings)
    try:
        feeder, stream = _feeder(buf, cfg, tokenizer)
        await _feed_until(feeder, buf, N)  # epoch 0: nothing is filtered yet
        assert await buf.dataset_cursor() == N and feeder.skipped_prompts == 0
        assert await _score_everything(buf, stream) == 2 * N
        assert len(await buf.recorded_pass_rates()) == N
        # the first feed of epoch 1 runs the filter: 4 solved, floor(6 * 0.5) = 3 removed, lowest index first
        removed = sorted(SOLVED)[:3]
        await feeder.feed_once()
        assert await buf.filter_epoch() == 1
        assert await buf.filtered_prompts() == {p: 1.0 for p in removed}
        assert await buf.recorded_pass_rates() == {}  # folded into prompt_pass_rate
        assert (await buf.prompt_pass_rates())[sorted(SOLVED)[3]] == 1.0
        await _feed_until(feeder, buf, 2 * N - 1)
        # (the last positions of epoch 1 may be removed ones: skipped with the run before them)
    finally:
        await buf.close()

    redis_server.kill()  # SIGKILL; the resumed run restarts Redis on the same AOF
    redis_server.start()
    buf = await ReplayBuffer.open(redis_server.url, cfg.run.name, settings)
    try:
        feeder, stream = _feeder(buf, cfg, tokenizer)  # a new feeder process: nothing in memory
        await _feed_until(feeder, buf, 2 * N)
        assert await buf.filtered_prompts() == {p: 1.0 for p in removed}
        fed_epoch1 = [c for c in range(N, 2 * N) if await buf.redis.exists(buf.prefix + f"group:{group_id_for(c)}")]
        assert sorted(stream.problem_index(c) for c in fed_epoch1) == sorted(set(range(N)) - set(removed))
        # epoch 2: the filter runs once more (the fourth solved prompt: floor(3 * 0.5) = 1) and the
        # prompts removed before the restart stay out
        await _feed_until(feeder, buf, 3 * N)
        assert await buf.filter_epoch() == 2
        assert set(await buf.filtered_prompts()) == SOLVED
        fed_epoch2 = [c for c in range(2 * N, 3 * N)
                      if await buf.redis.exists(buf.prefix + f"group:{group_id_for(c)}")]
        assert sorted(stream.problem_index(c) for c in fed_epoch2) == sorted(set(range(N)) - SOLVED)
        # the books: every cursor position was fed or skipped, by reason
        books = await buf.books()
        assert books["balanced"], books
        assert books["skipped_by_reason"] == {"pass_rate_filter": 3 + 4}
        assert books["fed"] == N + (N - 3) + (N - 4)
        st = await buf.stats()
        assert st["counters"]["filtered_prompts:pass_rate"] == 4 and st["sampling"]["skipped_prompts"] == 7
        # a second filter for an epoch already filtered writes nothing
        assert not await buf.record_filter(2, {1: 0.5})
        assert set(await buf.filtered_prompts()) == SOLVED
    finally:
        await buf.close()


@pytest.mark.integration
async def test_no_filter_records_nothing_and_skips_nothing(tiny_model_dir, tokenizer, redis_url):
    cfg = load_config(["--model_path", str(tiny_model_dir), "--rollout_batch_size", str(N), "--n_samples_per_prompt",
                       "2", "--run_name", "nofilter", "--data.num_train_prompts", str(N), "--max_response_len", "8",
                       "--max_budget", "8", "--max_staleness", "3"])
    settings = BufferSettings.from_config(cfg)
    assert not settings.record_pass_rates
    async with await ReplayBuffer.open(redis_url, cfg.run.name, settings) as buf:
        feeder, stream = _feeder(buf, cfg, tokenizer)
        assert feeder.prompt_filter is None
        await _feed_until(feeder, buf, N)
        await _score_everything(buf, stream)
        await _feed_until(feeder, buf, 2 * N)
        assert await buf.recorded_pass_rates() == {} and await buf.filtered_prompts() == {}
        assert (await buf.books())["skipped_by_reason"] == {}
