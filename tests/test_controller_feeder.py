"""The prompt feeder against a real redis-server and the tiny model's tokenizer."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.core.config import load_config
from asyncrl.feeder.feeder import Feeder, FeederError, group_id_for
from asyncrl.tasks.tasks import TrainPromptStream
from buffers import BufferSettings, ReplayBuffer

pytestmark = pytest.mark.integration


@pytest.fixture
def cfg(tiny_model_dir):
    return load_config(["--model_path", str(tiny_model_dir), "--rollout_batch_size", "3",
                        "--n_samples_per_prompt", "2", "--run_name", "feedtest",
                        "--data.num_train_prompts", "50", "--max_response_len", "64", "--max_budget", "64"])


@pytest.fixture
def tokenizer(tiny_model_dir):
    from asyncrl.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


async def _open(cfg, url):
    return await ReplayBuffer.open(url, run=cfg.run.name, settings=BufferSettings.from_config(cfg))


async def test_feeds_up_to_r_pending_and_resumes_without_skip_or_repeat(cfg, tokenizer, redis_url):
    stream = TrainPromptStream(cfg.data, tokenizer, seed=cfg.run.seed)
    buf = await _open(cfg, redis_url)
    try:
        feeder = Feeder(buf, stream, n_samples=2, target_pending=3)
        assert await feeder.feed_once() == 3  # admitted at once (R = 3 may be in flight)
        assert await buf.pending_groups() == 0
        assert await feeder.feed_once() == 3  # these wait for admission
        assert await buf.pending_groups() == 3
        assert await feeder.feed_once() == 0  # topped up already
        cursor = await buf.dataset_cursor()
        assert cursor == feeder.fed_groups == 6
        # a new feeder process (restart) continues from the stored cursor
        again = Feeder(buf, TrainPromptStream(cfg.data, tokenizer, seed=cfg.run.seed), 2, target_pending=5)
        assert await again.feed_once() == 2
        assert await buf.dataset_cursor() == cursor + 2
        for c in range(cursor + 2):
            group, samples = await buf.get_group(group_id_for(c))
            assert group.feed_index == c
            assert group.prompt_ids == stream.get(c).prompt_ids  # exactly the prompt at that cursor
            assert group.metadata["cursor"] == c and group.n_samples == 2
            assert len(samples) == (0 if group.state.value == "pending" else 2)
    finally:
        await buf.close()


async def test_concurrent_feed_loses_cleanly(cfg, tokenizer, redis_url):
    stream = TrainPromptStream(cfg.data, tokenizer, seed=cfg.run.seed)
    buf = await _open(cfg, redis_url)
    try:
        a = Feeder(buf, stream, 2, target_pending=3)
        b = Feeder(buf, stream, 2, target_pending=3)
        fed = await asyncio.gather(a.feed_once(), b.feed_once())
        assert sorted(fed)[0] == 0 or sum(fed) == await buf.dataset_cursor()
        assert await buf.dataset_cursor() == sum(fed)
    finally:
        await buf.close()


async def test_too_long_prompt_is_an_error_and_nothing_is_fed(cfg, tokenizer, redis_url):
    stream = TrainPromptStream(cfg.data, tokenizer, seed=cfg.run.seed)
    buf = await _open(cfg, redis_url)
    try:
        feeder = Feeder(buf, stream, 2, target_pending=3, max_prompt_tokens=3)
        with pytest.raises(FeederError, match="lower --max_response_len"):
            await feeder.feed_once()
        assert await buf.dataset_cursor() == 0 and await buf.pending_groups() == 0
    finally:
        await buf.close()


@pytest.mark.slow
def test_feeder_process_feeds_and_stops_on_sigterm(cfg, tiny_model_dir, redis_url, tmp_path):
    env = {**os.environ, "ASYNCRL_BUFFER__REDIS_URL": redis_url}
    args = [sys.executable, "-m", "asyncrl.feeder", "--model_path", str(tiny_model_dir), "--rollout_batch_size", "3",
            "--n_samples_per_prompt", "2", "--run_name", "feedtest", "--data.num_train_prompts", "50",
            "--max_response_len", "64", "--max_budget", "64"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    async def cursor():
        buf = await _open(cfg, redis_url)
        try:
            return await buf.dataset_cursor()
        finally:
            await buf.close()

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and asyncio.run(cursor()) < 6:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        time.sleep(0.5)
        assert asyncio.run(cursor()) == 6  # R in flight + R pending, then it waits
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "stopped after feeding 6 groups and skipping 0 prompts (0 predicted zero-variance); cursor 6" in out
    finally:
        proc.kill()


def test_feeder_without_redis_url_is_an_error(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_")}
    proc = subprocess.run([sys.executable, "-m", "asyncrl.feeder", "--model_path", str(tiny_model_dir)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "buffer.redis_url is not set" in proc.stderr


@pytest.mark.slow
def test_feeder_reports_buffer_errors_without_traceback(cfg, tiny_model_dir, redis_url):
    async def open_with_other_settings():
        import dataclasses

        other = dataclasses.replace(BufferSettings.from_config(cfg), max_staleness=3)
        buf = await ReplayBuffer.open(redis_url, run=cfg.run.name, settings=other)
        await buf.close()

    asyncio.run(open_with_other_settings())
    env = {**os.environ, "ASYNCRL_BUFFER__REDIS_URL": redis_url}
    proc = subprocess.run([sys.executable, "-m", "asyncrl.feeder", "--model_path", str(tiny_model_dir),
                           "--rollout_batch_size", "3", "--n_samples_per_prompt", "2", "--run_name", "feedtest",
                           "--max_response_len", "64", "--max_budget", "64"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "asyncrl feeder: SettingsMismatch" in proc.stderr and "Traceback" not in proc.stderr
