"""A user reward function that hangs (issue #18 item 8): a per-call timeout, a failure reason of its own.

``RewardScorer`` runs a user ``module:function`` in a thread of its own and waits at most
``data.reward_timeout_seconds``; a call that has not returned fails its sample with
``RewardTimeout: ...``, which the buffer counts as ``failed_samples:reward_timeout``. The reward
functions here really sleep (no mocks); the worker test runs a real embedded server, a real
redis-server and the real rollout worker.
"""

from __future__ import annotations

import time

import pytest

import asyncrl.tasks.rewards as rewards
from asyncrl.core.config import DataConfig
from asyncrl.tasks.rewards import RewardError, RewardScorer
from asyncrl.core.types import PromptGroup, SampleStatus
from buffers import BufferSettings, ReplayBuffer

META = {"task": "arithmetic", "gold": "7", "problem_hash": "0"}


@pytest.fixture
def sleepy_module(tmp_path, monkeypatch):
    """A user reward module whose function sleeps ``metadata["sleep"]`` seconds, then returns 0.5."""
    name = f"sleepy_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        "import time\n"
        "def sleeps(prompt, response, metadata):\n"
        "    time.sleep(float(metadata.get('sleep', 0)))\n"
        "    return 0.5\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_hung_user_function_times_out_and_the_scorer_goes_on(sleepy_module):
    s = RewardScorer(f"{sleepy_module}:sleeps", timeout_seconds=0.3)
    start = time.monotonic()
    r = s.score("p", "Answer: 7", {**META, "sleep": 30})
    assert time.monotonic() - start < 5, "the caller waited for the hung call"
    assert r.failed and r.reward == 0.0 and r.error.startswith("RewardTimeout: ")
    assert "reward_timeout_seconds=0.3" in r.error and sleepy_module in r.error
    assert s.abandoned_calls == 1
    ok = s.score("p", "Answer: 7", {**META, "sleep": 0})  # the next sample is scored as usual
    assert not ok.failed and ok.reward == 0.5 and ok.format == 1.0


def test_abandoned_calls_are_bounded_and_released(sleepy_module, monkeypatch):
    """While MAX_ABANDONED_CALLS timed-out calls still run, new calls fail at once; when they
    return, calls are made again."""
    monkeypatch.setattr(rewards, "MAX_ABANDONED_CALLS", 2)
    s = RewardScorer(f"{sleepy_module}:sleeps", timeout_seconds=0.2)
    for _ in range(2):
        assert s.score("p", "x", {**META, "sleep": 1.5}).error.startswith("RewardTimeout: ")
    assert s.abandoned_calls == 2
    start = time.monotonic()
    r = s.score("p", "x", {**META, "sleep": 0})
    assert time.monotonic() - start < 0.15 and r.error.startswith("RewardTimeout: ") and "still running" in r.error
    deadline = time.monotonic() + 10
    while s.abandoned_calls:
        assert time.monotonic() < deadline, "the abandoned calls never returned"
        time.sleep(0.05)
    assert s.score("p", "x", {**META, "sleep": 0}).reward == 0.5


def test_errors_of_a_user_function_still_come_back_through_its_thread(sleepy_module, tmp_path):
    (tmp_path / f"{sleepy_module}_boom.py").write_text(
        "def boom(prompt, response, metadata):\n    raise KeyError('no such field')\n")
    r = RewardScorer(f"{sleepy_module}_boom:boom", timeout_seconds=5).score("p", "x", META)
    assert r.failed and r.error == "KeyError: 'no such field'"


def test_timeout_comes_from_the_config(sleepy_module):
    assert DataConfig().reward_timeout_seconds == rewards.DEFAULT_REWARD_TIMEOUT_SECONDS == 60.0
    s = RewardScorer.from_config(DataConfig(reward=f"{sleepy_module}:sleeps", reward_timeout_seconds=2.5))
    assert s.timeout_seconds == 2.5
    with pytest.raises(ValueError):
        DataConfig(reward_timeout_seconds=0)
    with pytest.raises(RewardError, match="reward_timeout_seconds"):
        RewardScorer("format", timeout_seconds=float("nan"))


async def test_buffer_counts_reward_timeouts_on_their_own(redis_url):
    settings = BufferSettings(rollout_batch_size=2, train_batch_groups=1, n_samples_per_prompt=2, max_budget=8,
                              max_response_len=16, max_staleness=1, lease_seconds=30.0)
    async with await ReplayBuffer.open(redis_url, "rto", settings) as buf:
        await buf.feed([buf.make_group(g, [1, 2, 3], {}) for g in ("a", "b")], await buf.dataset_cursor())
        items = await buf.claim("w", 4)
        for it in items:
            await buf.end_segment(it, "stop", [11, 12], [-0.1, -0.2], [0, 0])
        a = [it for it in items if it.group_id == "a"]
        b = [it for it in items if it.group_id == "b"]
        await buf.score(a[0], error="RewardTimeout: reward function 'm:f' did not return within 1 s")
        await buf.score(a[1], error="RewardTimeout: reward function 'm:f' did not return within 1 s")
        await buf.score(b[0], error="ValueError: nope")
        await buf.score(b[1], reward=1.0)
        counters = (await buf.stats())["counters"]
    assert counters["failed_samples"] == 3
    assert counters["failed_samples:reward_timeout"] == 2 and counters["failed_samples:reward_error"] == 1


# ------------------------------------------------------------------------------------------------
# the rollout worker with a sleeping reward function


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from asyncrl.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from rollout_server.testing import make_random_model, start_embedded_server

    srv = start_embedded_server(make_random_model(tiny_model_dir, tmp_path_factory.mktemp("rto") / "m", seed=11),
                                "--weight-version", "0")
    yield srv
    srv.stop()


@pytest.mark.integration
async def test_worker_fails_hung_samples_with_their_own_reason(redis_url, server, tokenizer, sleepy_module):
    """A group whose reward calls hang: its samples fail with RewardTimeout within the limit, the
    group is dropped, the buffer's books count ``failed_samples:reward_timeout``; another group
    is scored and becomes READY meanwhile."""
    import asyncio

    from rollout_server.client import EngineClient
    from rollout_server.worker import RolloutWorker, WorkerOptions

    settings = BufferSettings(rollout_batch_size=4, train_batch_groups=2, n_samples_per_prompt=2, max_budget=6,
                              max_response_len=6, max_staleness=1, lease_seconds=3.0, flush_tokens=3)
    async with await ReplayBuffer.open(redis_url, "rto-worker", settings) as buf:
        prompt = list(tokenizer("two plus two")["input_ids"])
        await buf.feed([PromptGroup("hung", prompt, {"sleep": 20}, 2), PromptGroup("good", prompt, {}, 2)],
                       await buf.dataset_cursor())
        scorer = RewardScorer(f"{sleepy_module}:sleeps", timeout_seconds=0.5)
        worker = RolloutWorker(buf, EngineClient(server.url), scorer, tokenizer,
                               WorkerOptions("w-rto", temperature=0.7, max_inflight_requests=4, version_poll_seconds=0.1))
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        start = time.monotonic()
        try:
            while True:
                st = await buf.stats()
                if st["groups_by_state"].get("ready", 0) == 1 and st["dropped_by_reason"].get("reward_error") == 1:
                    break
                assert not task.done(), task.result()
                assert time.monotonic() - start < 15, f"hung reward calls held up the worker: {st}"
                await asyncio.sleep(0.1)
        finally:
            stop.set()
        stats = await task
        await worker.client.close()
        counters = st["counters"]
        assert counters["failed_samples:reward_timeout"] == 2 and "failed_samples:reward_error" not in counters
        assert stats.reward_errors == 2 and stats.scored == 4
        assert await buf.dropped_groups() == {"hung": "reward_error"}
        _, good = await buf.get_group("good")
        assert [s.status for s in good] == [SampleStatus.SCORED] * 2 and all(s.reward == 0.5 for s in good)
