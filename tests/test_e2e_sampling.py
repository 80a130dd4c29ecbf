"""End to end with every sampling feature on: ``asyncrl train`` on configs/tiny.yaml through the real CLI.

Real processes (controller, feeder, an embedded-engine rollout server, the DeepSpeed trainer)
against the real redis-server of the fixture, with best-of-n (6 generated, the best 4 trained),
DAPO dynamic sampling, AReaL's pass-rate dataset filter over a 6-prompt dataset (so it runs at
several epoch starts) and DAPO's soft overlong penalty. The reward is the deterministic
``rollout_worker_rewards:length_reward`` (the random tiny model would get 0 everywhere, and
dynamic sampling would then drop every group). At the end: the run finished, the controller's
reconciliation and ``buf.books()`` balance with every reason counted, and the zero-variance
share is in the controller's step records.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.core.net import free_port
from asyncrl.metrics.tracking import read_metrics

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def _books(url: str) -> tuple[dict, dict]:
    from buffers import ReplayBuffer

    buf = await ReplayBuffer.open(url, run="tiny")
    try:
        return await buf.books(), await buf.stats()
    finally:
        await buf.close()


def test_tiny_run_with_best_of_n_dynamic_sampling_filter_and_overlong_penalty(tmp_path, tiny_model_dir, redis_url):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]))
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "--config", str(REPO / "configs" / "tiny.yaml"),
           "--output_dir", str(tmp_path), "--model_path", str(tiny_model_dir), "--redis_url", redis_url,
           "--rollout.base_port", str(free_port()), "--monitoring.progress", "false",
           "--monitoring.controller_metrics_port", "0", "--monitoring.trainer_metrics_port", "0",
           "--data.reward", "rollout_worker_rewards:length_reward", "--data.num_train_prompts", "6",
           "--rollout.generation_size", "6", "--rollout.dynamic_sampling", "true",
           "--data.dataset_filter_threshold", "0.2", "--data.dataset_max_filter_percentage", "0.5",
           "--trainer.loss.overlong_buffer_len", "16"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    run_dir = tmp_path / "tiny"
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stderr[-4000:] + logs
    assert "groups reconcile: fed" in proc.stderr, proc.stderr[-3000:]

    books, st = asyncio.run(_books(redis_url))
    assert books["balanced"], books
    assert books["discarded_best_of_n"] >= 2 * books["committed_groups"] > 0, books  # 6 generated, 4 trained
    assert books["finished_groups"] >= books["committed_groups"] + books["dropped_by_reason"].get("zero_variance", 0)
    assert st["counters"].get("filtered_prompts:pass_rate", 0) > 0, st["counters"]  # the filter ran
    assert books["skipped_by_reason"].get("pass_rate_filter", 0) > 0, books
    recs = [r for r in read_metrics(run_dir) if r["role"] == "controller"]
    shares = [r["buffer/zero_variance_share"] for r in recs if "buffer/zero_variance_share" in r]
    assert shares and all(0.0 <= s <= 1.0 for s in shares)
    assert recs[-1]["buffer/finished_groups"] > 0 and "buffer/discarded_best_of_n" in recs[-1]
