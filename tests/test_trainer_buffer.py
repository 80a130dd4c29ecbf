"""The trainer's adapter to the real Redis replay buffer: batches in, acknowledgements, commit,
dataset cursor and version-clock announcements out (real redis-server)."""

from __future__ import annotations

import threading

from asyncrl.core.config import load_config
from asyncrl.core.types import WorkKind
from buffers import BufferSettings, ReplayBuffer
from trainer.batch import TrainGroup, prepare_batch
from trainer.sources import BufferBatchSource


async def test_buffer_batches_feed_the_trainer_and_acks_commit_announce(redis_url):
    settings = BufferSettings(rollout_batch_size=2, train_batch_groups=2, n_samples_per_prompt=2, max_budget=8,
                              max_response_len=16, max_staleness=0, stale_policy="restart", lease_seconds=30.0)
    buf = await ReplayBuffer.open(redis_url, "tr", settings)
    await buf.feed([buf.make_group(g, [1, 2, 3], {"answer": g}) for g in ("a", "b")], 0)
    while items := await buf.claim("w", 16):
        for it in items:
            if it.kind == WorkKind.GENERATE:
                await buf.end_segment(it, "stop", [10 + it.index, 11], [-0.5, -0.25], [0, 0])
            await buf.score(it, reward=float(it.index))
    stop = threading.Event()
    source = BufferBatchSource(buf, stop)
    batch = await source.next_batch(1)
    assert batch.group_ids == ["a", "b"]
    groups = [TrainGroup.from_record(g) for g in batch.groups]
    assert [g.prompt_ids for g in groups] == [[1, 2, 3], [1, 2, 3]]
    assert [[s.response_ids for s in g.samples] for g in groups] == [[[10, 11], [11, 11]]] * 2
    cfg = load_config([], environ={}, overrides={"trainer": {"advantage": "dr_grpo"}, "rollout": {"n_samples_per_prompt": 2}})
    prepared = prepare_batch(batch.groups, cfg, policy_version=0)
    assert [s.advantages.tolist() for s in prepared.samples] == [[-0.5, -0.5], [0.5, 0.5]] * 2
    assert prepared.samples[0].behaviour_logprobs.tolist() == [-0.5, -0.25]

    await source.acknowledge(1)
    assert await buf.acknowledge(batch, 1) is False  # already acknowledged by the adapter
    await source.commit(1)
    assert await source.state_dict() == {"dataset_cursor": 2}
    await source.announce(1, "/weights/v000001", "ab" * 32)
    assert await buf.clock.version() == 1
    stop.set()
    assert await source.next_batch(2) is None  # nothing READY and asked to stop: returns instead of waiting
    await source.close()
