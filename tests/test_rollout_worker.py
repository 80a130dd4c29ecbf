"""The streaming rollout worker against real servers and a real redis-server (issue 4 item 3).

Real HTTP to embedded engine processes (the tiny random model, fp32), a real redis-server
(fixture ``redis_url``), real weight files written the way the trainer publishes them
(:func:`asyncrl.core.weights.write_weights` + the version clock). Kill -9 and SIGTERM run the
``asyncrl rollout-server`` CLI as separate processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.core.types import PromptGroup, SampleStatus
from buffers import BufferSettings, ReplayBuffer
from rollout_server.client import EngineClient
from rollout_server.testing import make_random_model, recompute_logprobs, start_embedded_server
from rollout_server.worker import RolloutWorker, WorkerError, WorkerOptions

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
REWARD = "rollout_worker_rewards:length_reward"
TEMPERATURE = 0.7


def _settings(**kw) -> BufferSettings:
    base = dict(rollout_batch_size=4, train_batch_groups=2, n_samples_per_prompt=2, max_budget=12,
                max_response_len=12, max_staleness=1, lease_seconds=3.0, flush_tokens=3)
    base.update(kw)
    return BufferSettings(**base)


def _prompt(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


async def _feed(buf: ReplayBuffer, groups: list[PromptGroup]) -> None:
    await buf.feed(groups, await buf.dataset_cursor())


def _worker(buf, url, tokenizer, worker_id, **kw) -> RolloutWorker:
    from asyncrl.tasks.rewards import RewardScorer

    opts = WorkerOptions(worker_id, temperature=TEMPERATURE, max_inflight_requests=kw.pop("inflight", 8),
                         version_poll_seconds=0.1, **kw)
    return RolloutWorker(buf, EngineClient(url), RewardScorer(REWARD), tokenizer, opts)


async def _run_until(worker: RolloutWorker, cond, timeout_seconds: float = 60.0):
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    deadline = time.monotonic() + timeout_seconds
    try:
        while not await cond():
            if task.done():
                task.result()
                raise AssertionError("the worker stopped before the condition was met")
            assert time.monotonic() < deadline, f"condition not met in {timeout_seconds} s: {await worker.buffer.stats()}"
            await asyncio.sleep(0.1)
    finally:
        stop.set()
    return await task


def _ready(buf: ReplayBuffer, n_groups: int):
    async def cond() -> bool:
        return (await buf.stats())["groups_by_state"].get("ready", 0) >= n_groups
    return cond


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from asyncrl.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    """Two well-behaved random models (v0 and the perturbed v1 weights) and their torch modules."""
    from asyncrl.models import load_causal_lm

    root = tmp_path_factory.mktemp("worker_models")
    m0 = make_random_model(tiny_model_dir, root / "m0", seed=11)
    m1 = make_random_model(tiny_model_dir, root / "m1", seed=12)
    return {"dir0": m0, "dir1": m1, "lm0": load_causal_lm(m0), "lm1": load_causal_lm(m1)}


@pytest.fixture(scope="module")
def server_a(models):
    srv = start_embedded_server(models["dir0"], "--weight-version", "0")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server_b(models):
    srv = start_embedded_server(models["dir0"], "--weight-version", "0", "--incremental-streaming-output")
    yield srv
    srv.stop()


def _publish_weights(weights_dir: Path, version: int, model_dir: Path) -> tuple[Path, str]:
    """Write ``model_dir``'s weights as policy ``version`` exactly as the trainer publishes them."""
    from safetensors.torch import load_file
    from asyncrl.core.weights import write_weights

    state = load_file(str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    return write_weights(weights_dir, version, state, config)


async def test_end_to_end_ready_groups_with_versions_and_logprobs(redis_url, server_a, models, tokenizer):
    async with await ReplayBuffer.open(redis_url, "e2e", _settings()) as buf:
        await _feed(buf, [PromptGroup("g0", _prompt(tokenizer, "two plus two"), {}, 2),
                          PromptGroup("g1", _prompt(tokenizer, "the quick brown fox"), {}, 2)])
        w = _worker(buf, server_a.url, tokenizer, "w-e2e")
        stats = await _run_until(w, _ready(buf, 2))
        await w.client.close()
        assert stats.completed == 4 and stats.scored == 4 and stats.reward_errors == 0
        for gid in ("g0", "g1"):
            group, samples = await buf.get_group(gid)
            for s in samples:
                assert s.status == SampleStatus.SCORED
                T = len(s.response_ids)
                assert 1 <= T <= 12 and len(s.behaviour_logprobs) == T and s.versions == [0] * T
                ref = recompute_logprobs(models["lm0"], group.prompt_ids, s.response_ids, TEMPERATURE)
                assert max(abs(a - b) for a, b in zip(ref, s.behaviour_logprobs)) < 1e-4
                text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
                assert s.reward == pytest.approx((len(text) % 7) / 7.0)
                assert s.finish_reason in ("stop", "length")
                # flushed every 3 tokens, one engine call: one segment covering the whole response
                assert [(seg.start, seg.end) for seg in s.segments] == [(0, T)]


async def test_budget_parking_and_resume_across_versions_on_another_server(redis_url, server_a, server_b, models,
                                                                           tokenizer, tmp_path):
    """Budget M=4: two segments under v0 on server A, then v1 is published (perturbed weights)
    and server B loads it and finishes the samples: tokens of two versions, each token's
    logprob equal to that version's recomputation."""
    settings = _settings(n_samples_per_prompt=2, max_budget=4, max_response_len=12, flush_tokens=2)
    async with await ReplayBuffer.open(redis_url, "budget", settings) as buf:
        prompt = _prompt(tokenizer, "count to ten")
        await _feed(buf, [PromptGroup("g0", prompt, {}, 2)])
        wa = _worker(buf, server_a.url, tokenizer, "w-a", extra_sampling_params={"ignore_eos": True})
        items = await buf.claim("w-a", 2)
        assert len(items) == 2 and all(it.max_new_tokens == 4 for it in items)
        statuses = await asyncio.gather(*(wa.process(it) for it in items))
        assert statuses == [SampleStatus.PARTIAL, SampleStatus.PARTIAL]
        assert wa.stats.parked_budget == 2
        await wa.client.close()
        for it in items:
            s = await buf.get_sample(it.sample_id)
            assert s.versions == [0] * 4 and s.status == SampleStatus.PARTIAL

        path, sha = _publish_weights(tmp_path / "weights", 1, models["dir1"])
        await buf.clock.publish(1, str(path), sha)

        wb = _worker(buf, server_b.url, tokenizer, "w-b", extra_sampling_params={"ignore_eos": True})
        try:
            stats = await _run_until(wb, _ready(buf, 1))
            assert stats.weight_updates == 1 and wb.version == 1
            assert await wb.client.weight_version() == "1"
            group, samples = await buf.get_group("g0")
            for s in samples:
                assert s.status == SampleStatus.SCORED and len(s.response_ids) == 12
                assert s.versions == [0] * 4 + [1] * 8, s.versions
                assert s.num_resumes >= 2
                assert [seg.start for seg in s.segments][:3] == [0, 4, 8]
                ref0 = recompute_logprobs(models["lm0"], prompt, s.response_ids, TEMPERATURE)
                ref1 = recompute_logprobs(models["lm1"], prompt, s.response_ids, TEMPERATURE)
                got = s.behaviour_logprobs
                assert max(abs(a - b) for a, b in zip(ref0[:4], got[:4])) < 1e-4
                assert max(abs(a - b) for a, b in zip(ref1[4:], got[4:])) < 1e-4
                assert max(abs(a - b) for a, b in zip(ref0[4:], got[4:])) > 1e-3  # really the new weights
        finally:
            await wb.client.update_weights_from_disk(str(models["dir0"]), weight_version="0")
            await wb.client.close()


def _recompute_across_an_update(lm0, lm1, prompt, response, kept, temperature):
    """Logprobs of ``response[kept + 1:]`` when the keys/values of ``prompt + response[:kept]`` come
    from ``lm0`` and the rest from ``lm1``: a sample parked under v0 whose context the engine kept,
    resumed under v1 (as a request running across an in-place update continues)."""
    import torch

    with torch.no_grad():
        past = lm0(torch.tensor([list(prompt) + list(response[:kept])]), use_cache=True).past_key_values
        logits = lm1(torch.tensor([list(response[kept:])]), past_key_values=past, use_cache=True).logits[0].float()
    lsm = torch.log_softmax(logits[:-1] / temperature, dim=-1)
    return lsm.gather(1, torch.tensor(response[kept + 1:])[:, None]).squeeze(1).tolist()


async def _context_cache_hits(url: str) -> int:
    import re

    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return int(float(re.search(r"^asyncrl_rollout_context_cache_hits_total (\S+)$", text, re.M).group(1)))


@pytest.mark.parametrize("pause_mode", ["abort", "in_place"])
async def test_a_parked_sample_resumes_from_the_context_cache_across_an_unflushed_update(
        redis_url, server_b, models, tokenizer, tmp_path, pause_mode):
    """Budget M=4 on one server: a segment under v0 is parked, v1 is published and the same
    server resumes the sample. ``in_place`` with ``flush_cache_on_update=False`` loads v1 with
    ``flush_cache: false``, so the engine
    extends the parked context's v0 keys/values under v1 (the resumed tokens' logprobs are exactly
    that computation, not v1's recomputation), as it does for a request running across the update;
    ``abort`` flushes, so every resumed token is v1's recomputation. Later segments under v1 come
    from the context cache in both modes."""
    settings = _settings(n_samples_per_prompt=1, train_batch_groups=1, max_budget=4, max_response_len=12,
                         flush_tokens=2)
    async with await ReplayBuffer.open(redis_url, f"ctx-{pause_mode}", settings) as buf:
        # long enough for the context cache (>= 16 shared tokens)
        prompt = _prompt(tokenizer, "count to ten and back down to one, slowly, saying each number out loud twice")
        assert len(prompt) >= 16
        await _feed(buf, [PromptGroup("g0", prompt, {}, 1)])
        w = _worker(buf, server_b.url, tokenizer, f"w-ctx-{pause_mode}", pause_mode=pause_mode,
                    flush_cache_on_update=pause_mode == "abort", extra_sampling_params={"ignore_eos": True})
        try:
            [item] = await buf.claim(w.opts.worker_id, 1)
            assert await w.process(item) == SampleStatus.PARTIAL  # 4 tokens under v0, parked
            hits = await _context_cache_hits(server_b.url)
            path, sha = _publish_weights(tmp_path / "weights", 1, models["dir1"])
            await buf.clock.publish(1, str(path), sha)
            stats = await _run_until(w, _ready(buf, 1))
            assert stats.weight_updates == 1 and w.version == 1
            s = await buf.get_sample("g0/0")
            assert s.versions == [0] * 4 + [1] * 8 and s.num_resumes >= 2
            new_hits = await _context_cache_hits(server_b.url) - hits
            ref0 = recompute_logprobs(models["lm0"], prompt, s.response_ids, TEMPERATURE)
            ref1 = recompute_logprobs(models["lm1"], prompt, s.response_ids, TEMPERATURE)
            got = s.behaviour_logprobs
            assert max(abs(a - b) for a, b in zip(ref0[:4], got[:4])) < 1e-4
            if pause_mode == "in_place":
                # the first resume extended v0's keys/values of prompt + 3 tokens; so did the later ones
                assert new_hits >= 2, new_hits
                mixed = _recompute_across_an_update(models["lm0"], models["lm1"], prompt, s.response_ids, 3,
                                                    TEMPERATURE)
                assert max(abs(a - b) for a, b in zip(mixed, got[4:])) < 1e-4
                assert max(abs(a - b) for a, b in zip(ref1[4:], got[4:])) > 1e-3  # not a recomputation under v1
            else:
                # the first resume was prefilled whole under v1 (the flush emptied the cache); the later ones hit v1 entries
                assert new_hits >= 1, new_hits
                assert max(abs(a - b) for a, b in zip(ref1[4:], got[4:])) < 1e-4
        finally:
            await w.client.update_weights_from_disk(str(models["dir0"]), weight_version="0")
            await w.client.close()


async def test_work_claimed_after_a_publish_the_worker_missed_is_generated_with_the_new_weights(
        redis_url, server_b, models, tokenizer, tmp_path):
    """Synchronous settings (max_staleness 0): v1 is published and the next rollout batch
    admitted before the worker's watcher notices. The claimed item carries the clock (v1), so
    the worker loads v1 before generating; otherwise every token would be v0 and the group
    would be restarted as stale at batch time (seen in benchmark (b) with R = 16)."""
    settings = _settings(n_samples_per_prompt=1, train_batch_groups=1, rollout_batch_size=1, max_staleness=0,
                         max_budget=6, max_response_len=6)
    async with await ReplayBuffer.open(redis_url, "catchup", settings) as buf:
        w = _worker(buf, server_b.url, tokenizer, "w-catchup", extra_sampling_params={"ignore_eos": True})
        try:
            assert await w.sync_weights(initial=True) is False and w.version == 0  # engine at v0, no watcher
            path, sha = _publish_weights(tmp_path / "weights", 1, models["dir1"])
            await buf.clock.publish(1, str(path), sha)
            prompt = _prompt(tokenizer, "the next batch")
            await _feed(buf, [PromptGroup("g0", prompt, {}, 1)])
            [item] = await buf.claim("w-catchup", 1)
            assert item.clock_version == 1 and w.version == 0
            assert await w.process(item) == SampleStatus.COMPLETE  # then scored
            assert w.stats.caught_up == 1 and w.stats.weight_updates == 1 and w.version == 1
            s = await buf.get_sample("g0/0")
            assert s.status == SampleStatus.SCORED and s.versions == [1] * 6
            ref1 = recompute_logprobs(models["lm1"], prompt, s.response_ids, TEMPERATURE)
            assert max(abs(a - b) for a, b in zip(ref1, s.behaviour_logprobs)) < 1e-4
            batch = await buf.next_batch(1)
            assert batch is not None and batch.groups[0].staleness == 0
        finally:
            await w.client.update_weights_from_disk(str(models["dir0"]), weight_version="0")
            await w.client.close()


@pytest.mark.parametrize("pause_mode", ["abort", "in_place"])
async def test_weight_update_mid_stream(redis_url, server_b, models, tokenizer, tmp_path, pause_mode):
    """A version published while a sample streams: ``abort`` ends the segment at the update
    (old-version segment, then a new one); ``in_place`` keeps the request running and the
    engine's per-token versions switch inside one segment."""
    settings = _settings(n_samples_per_prompt=1, train_batch_groups=1, max_budget=900,
                         max_response_len=900, flush_tokens=4)
    async with await ReplayBuffer.open(redis_url, "mid", settings) as buf:
        prompt = _prompt(tokenizer, "tell a long story")
        await _feed(buf, [PromptGroup("g0", prompt, {}, 1)])
        w = _worker(buf, server_b.url, tokenizer, "w-mid", pause_mode=pause_mode,
                    extra_sampling_params={"ignore_eos": True})
        path, sha = _publish_weights(tmp_path / "weights", 1, models["dir1"])

        published = False

        async def cond() -> bool:
            nonlocal published
            s = await buf.get_sample("g0/0")
            if not published and len(s.response_ids) >= 8:
                await buf.clock.publish(1, str(path), sha)
                published = True
            return s.status == SampleStatus.SCORED

        try:
            await _run_until(w, cond, timeout_seconds=90)
            s = await buf.get_sample("g0/0")
            assert len(s.response_ids) == 900
            k = s.versions.index(1)
            assert 8 <= k < 900 and s.versions == [0] * k + [1] * (900 - k)
            starts = [seg.start for seg in s.segments]
            if pause_mode == "abort":
                assert k in starts and any(seg.end == k and seg.finish_reason == "abort" for seg in s.segments)
            else:
                assert k not in starts and len(s.segments) == 1
            ref0 = recompute_logprobs(models["lm0"], prompt, s.response_ids, TEMPERATURE)
            ref1 = recompute_logprobs(models["lm1"], prompt, s.response_ids, TEMPERATURE)
            assert max(abs(a - b) for a, b in zip(ref0[:k], s.behaviour_logprobs[:k])) < 1e-4
            if pause_mode == "abort":  # KV recomputed under the new weights: exactly the new policy
                assert max(abs(a - b) for a, b in zip(ref1[k:], s.behaviour_logprobs[k:])) < 1e-4
            # in_place keeps the old weights' KV cache, so later tokens are not the new policy's
            # recomputation (SGLang behaves the same): the reason abort is the default mode.
        finally:
            await w.client.update_weights_from_disk(str(models["dir0"]), weight_version="0")
            await w.client.close()


async def test_http_transport_rejects_a_bad_checksum_then_loads_the_next_version(redis_url, server_b, models,
                                                                               tokenizer, tmp_path):
    """weight_sync.transport=http: a version whose announced checksum does not match is not
    loaded (counted, engine keeps its weights, generation goes on); the next good version is
    downloaded, verified and loaded, and new tokens carry it."""
    from asyncrl.core.weights import WeightFileServer

    weights = tmp_path / "weights"
    _publish_weights(weights, 1, models["dir1"])
    _, sha2 = _publish_weights(weights, 2, models["dir1"])
    files = WeightFileServer(weights).start()
    settings = _settings(n_samples_per_prompt=1, train_batch_groups=1, max_response_len=6, max_budget=6)
    async with await ReplayBuffer.open(redis_url, "http", settings) as buf:
        w = _worker(buf, server_b.url, tokenizer, "w-http", transport="http", weights_cache_dir=tmp_path / "cache")
        stop = asyncio.Event()
        task = asyncio.create_task(w.run(stop))
        try:
            deadline = time.monotonic() + 60
            while w.version != 0:  # started: engine at version 0
                assert not task.done() and time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await buf.clock.publish(1, files.uri_for(1), "0" * 64)  # wrong checksum
            while w.stats.weight_update_errors < 1:
                assert not task.done() and time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert w.version == 0 and await w.client.weight_version() == "0"
            assert not (tmp_path / "cache" / "v000001").exists()  # nothing half-installed

            await buf.clock.publish(2, files.uri_for(2), sha2)
            while w.version != 2:
                assert not task.done() and time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert await w.client.weight_version() == "2" and (tmp_path / "cache" / "v000002" / "model.safetensors").is_file()
            prompt = _prompt(tokenizer, "after the update")
            await _feed(buf, [PromptGroup("g0", prompt, {}, 1)])
            while (await buf.stats())["groups_by_state"].get("ready", 0) < 1:
                assert not task.done() and time.monotonic() < deadline
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await task
            files.stop()
            await w.client.update_weights_from_disk(str(models["dir0"]), weight_version="0")
            await w.client.close()
        s = await buf.get_sample("g0/0")
        assert s.versions == [2] * len(s.response_ids)
        ref = recompute_logprobs(models["lm1"], prompt, s.response_ids, TEMPERATURE)
        assert max(abs(a - b) for a, b in zip(ref, s.behaviour_logprobs)) < 1e-4


async def test_recovery_rewind_new_lineage_reloads_and_regenerates(redis_url, server_b, models, tokenizer, tmp_path):
    """The trainer recovers to version 0 (new lineage) while a sample streams under version 1:
    the worker loses the lease or gets VersionAhead, reloads the version-0 weights announced for
    the new lineage, and the sample is regenerated under version 0 only."""
    weights = tmp_path / "weights"
    path0, sha0 = _publish_weights(weights, 0, models["dir0"])
    path1, sha1 = _publish_weights(weights, 1, models["dir1"])
    settings = _settings(n_samples_per_prompt=1, train_batch_groups=1, max_budget=600, max_response_len=600,
                         flush_tokens=4, max_staleness=2)
    async with await ReplayBuffer.open(redis_url, "rewind", settings) as buf:
        prompt = _prompt(tokenizer, "rewind me")
        await _feed(buf, [PromptGroup("g0", prompt, {}, 1)])
        w = _worker(buf, server_b.url, tokenizer, "w-rewind", extra_sampling_params={"ignore_eos": True})
        state = {"published": False, "recovered": False}

        async def cond() -> bool:
            s = await buf.get_sample("g0/0")
            if not state["published"] and len(s.response_ids) >= 8:
                await buf.clock.publish(1, str(path1), sha1)
                state["published"] = True
            elif state["published"] and not state["recovered"] and 1 in s.versions:
                await buf.recover(0, 0, str(path0), sha0)
                state["recovered"] = True
            return state["recovered"] and s.status == SampleStatus.SCORED

        try:
            stats = await _run_until(w, cond, timeout_seconds=120)
            assert (w.version, w.lineage) == (0, 1) and await w.client.weight_version() == "0"
            assert stats.weight_updates == 2 and stats.lease_lost + stats.version_ahead >= 1
            s = await buf.get_sample("g0/0")
            assert len(s.response_ids) == 600 and s.versions == [0] * 600 and s.num_restarts >= 1
            ref = recompute_logprobs(models["lm0"], prompt, s.response_ids, TEMPERATURE)
            assert max(abs(a - b) for a, b in zip(ref, s.behaviour_logprobs)) < 1e-4
        finally:
            await w.client.update_weights_from_disk(str(models["dir0"]), weight_version="0")
            await w.client.close()


async def test_reward_error_marks_sample_failed_and_run_continues(redis_url, server_a, tokenizer):
    """One raising reward: that sample is FAILED with the error, its group trains with the other
    two. Every reward raising: the group is dropped (``reward_error``). Other groups go on."""
    settings = _settings(n_samples_per_prompt=3, max_response_len=6, max_budget=6)
    async with await ReplayBuffer.open(redis_url, "rerr", settings) as buf:
        await _feed(buf, [PromptGroup("allbad", _prompt(tokenizer, "explode"), {"fail": True}, 3),
                          PromptGroup("onebad", _prompt(tokenizer, "wobble"), {"fail_once": f"k{time.time()}"}, 3),
                          PromptGroup("good", _prompt(tokenizer, "behave"), {}, 3)])

        async def cond() -> bool:
            st = await buf.stats()
            return st["groups_by_state"].get("ready", 0) == 2 and st["dropped_by_reason"].get("reward_error") == 1

        w = _worker(buf, server_a.url, tokenizer, "w-rerr")
        stats = await _run_until(w, cond)
        await w.client.close()
        assert stats.reward_errors == 4 and stats.scored == 9
        assert (await buf.dropped_groups()) == {"allbad": "reward_error"}
        group, onebad = await buf.get_group("onebad")
        failed = [s for s in onebad if s.status == SampleStatus.FAILED]
        assert len(failed) == 1 and "RuntimeError: reward function exploded once" in failed[0].error
        assert sum(s.status == SampleStatus.SCORED for s in onebad) == 2 and group.state.value == "ready"
        _, good = await buf.get_group("good")
        assert all(s.status == SampleStatus.SCORED for s in good)


async def test_engine_rejecting_a_prompt_stops_the_worker_with_a_clear_error(redis_url, server_a, tokenizer):
    async with await ReplayBuffer.open(redis_url, "toolong", _settings()) as buf:
        await _feed(buf, [PromptGroup("long", [5] * 1020, {}, 2)])  # 1020 + 12 > 1024 context
        w = _worker(buf, server_a.url, tokenizer, "w-long")
        with pytest.raises(WorkerError, match=r"long/\d.*rejected|rejected.*long/\d"):
            await asyncio.wait_for(w.run(asyncio.Event()), 30)
        await w.client.close()
        _, samples = await buf.get_group("long")
        assert all(s.status == SampleStatus.PENDING and not s.response_ids for s in samples)  # given back untouched


# ---------------------------------------------------------------------------------------------
# the `asyncrl rollout-server` process: kill -9 and SIGTERM


def _write_config(path: Path, redis_url: str, run: str, model_dir: Path, **rollout) -> Path:
    import yaml

    r = dict(base_port=0, n_samples_per_prompt=2, rollout_batch_size=4, max_budget=800, max_response_len=800,
             temperature=TEMPERATURE, max_inflight_requests=4, engine_threads=1)
    r.update(rollout)
    cfg = {"run": {"name": run, "output_dir": str(path.parent / "runs")}, "model": {"path": str(model_dir)},
           "data": {"reward": REWARD}, "rollout": r,
           "buffer": {"redis_url": redis_url, "lease_seconds": 2.0, "flush_tokens": 2}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _start_cli(config: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH"), str(REPO)])))
    return subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "rollout-server", "--config", str(config)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)


async def _wait_log(proc: subprocess.Popen, log: Path, needle: str, timeout_seconds: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if needle in text:
            return text
        assert proc.poll() is None, f"rollout-server exited with {proc.returncode}:\n{text[-3000:]}"
        await asyncio.sleep(0.2)
    raise AssertionError(f"{needle!r} not in the log after {timeout_seconds} s:\n{log.read_text()[-3000:]}")


async def _settings_of(config: Path) -> BufferSettings:
    from asyncrl.core.config import load_config

    return BufferSettings.from_config(load_config(["--config", str(config)]))


async def _running_with_tokens(buf: ReplayBuffer, sample_ids: list[str], min_tokens: int) -> dict:
    """The samples of ``sample_ids`` that are RUNNING with at least ``min_tokens`` flushed tokens."""
    snap = {}
    for sid in sample_ids:
        s = await buf.get_sample(sid)
        if s.status == SampleStatus.RUNNING and len(s.response_ids) >= min_tokens:
            snap[sid] = s
    return snap


@pytest.mark.slow
async def test_kill9_rollout_server_mid_stream_samples_reclaimed_and_finished_elsewhere(redis_url, models,
                                                                                      tokenizer, tmp_path):
    config = _write_config(tmp_path / "rollout.yaml", redis_url, "kill9", models["dir0"])
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = _start_cli(config, log_a)
    b = None
    try:
        await _wait_log(a, log_a, "requests in flight")
        async with await ReplayBuffer.open(redis_url, "kill9", await _settings_of(config)) as buf:
            await _feed(buf, [PromptGroup("g0", _prompt(tokenizer, "one"), {}, 2),
                              PromptGroup("g1", _prompt(tokenizer, "two"), {}, 2)])
            sids = ["g0/0", "g0/1", "g1/0", "g1/1"]
            # Kill as soon as two samples stream (>= 4 tokens flushed each). Waiting for all four at
            # once raced the engine: a random model's sample can hit EOS within a few tokens, so the
            # moment when all four run may never come.
            deadline = time.monotonic() + 60
            while len(await _running_with_tokens(buf, sids, 4)) < 2:
                assert time.monotonic() < deadline, [(s.sample_id, s.status, len(s.response_ids), s.segments)
                                                     for s in [await buf.get_sample(i) for i in sids]]
                await asyncio.sleep(0.01)
            a.kill()  # SIGKILL mid-stream: no drain, leases left to expire
            a.wait()
            after = {sid: await buf.get_sample(sid) for sid in sids}  # every token flushed before the kill
            snap = {sid: s for sid, s in after.items() if s.status == SampleStatus.RUNNING}
            brief = {sid: (s.status.value, len(s.response_ids)) for sid, s in after.items()}
            assert snap, brief  # at least one sample was mid-stream when the server died
            assert all(len(s.response_ids) < 800 for s in snap.values())
            finished_or_waiting = (SampleStatus.PENDING, SampleStatus.COMPLETE, SampleStatus.SCORED)
            assert all(s.status in finished_or_waiting for sid, s in after.items() if sid not in snap), brief

            b = _start_cli(config, log_b)
            deadline = time.monotonic() + 180
            while (await buf.stats())["groups_by_state"].get("ready", 0) < 2:
                assert b.poll() is None and time.monotonic() < deadline, log_b.read_text()[-3000:]
                await asyncio.sleep(0.2)
            st = await buf.stats()
            assert st["samples_by_state"] == {"scored": 4} and st["counters"]["completed_samples"] == 4
            for sid, before in snap.items():
                s = await buf.get_sample(sid)
                T = len(s.response_ids)
                assert s.response_ids[: len(before.response_ids)] == before.response_ids  # nothing lost
                assert s.behaviour_logprobs[: len(before.response_ids)] == before.behaviour_logprobs
                assert T <= 800 and len(s.behaviour_logprobs) == T and s.versions == [0] * T
                assert s.num_resumes >= 1
                ends = [0] + [seg.end for seg in s.segments]
                assert [seg.start for seg in s.segments] == ends[:-1] and ends[-1] == T  # no overlap, no gap
            b.send_signal(signal.SIGTERM)
            assert b.wait(60) == 0
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
async def test_sigterm_parks_every_in_flight_sample_and_exits_0(redis_url, models, tokenizer, tmp_path):
    config = _write_config(tmp_path / "rollout.yaml", redis_url, "sigterm", models["dir0"])
    log = tmp_path / "server.log"
    proc = _start_cli(config, log)
    try:
        await _wait_log(proc, log, "requests in flight")
        async with await ReplayBuffer.open(redis_url, "sigterm", await _settings_of(config)) as buf:
            await _feed(buf, [PromptGroup(f"g{i}", _prompt(tokenizer, f"prompt {i}"), {}, 2) for i in range(3)])
            deadline = time.monotonic() + 60
            all_ids = [f"g{g}/{i}" for g in range(3) for i in range(2)]
            while True:  # mid-stream: requests in flight (at least 2 of the 4 allowed), each with flushed tokens
                samples = [await buf.get_sample(sid) for sid in all_ids]
                running = [s for s in samples if s.status == SampleStatus.RUNNING]
                if len(running) >= 2 and all(len(s.response_ids) >= 2 for s in running):
                    break  # not "all 4": a random model's sample can stop within a few tokens
                assert time.monotonic() < deadline, [(s.sample_id, s.status.value, len(s.response_ids))
                                                     for s in samples]
                await asyncio.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
            text = log.read_text()
            line = [ln for ln in text.splitlines() if "parked" in ln and "in-flight samples" in ln]
            assert len(line) == 1, text[-3000:]
            n = int(line[0].split("parked ")[1].split()[0])
            ids = set(line[0].split("[")[1].split("]")[0].split(","))
            st = await buf.stats()
            assert 1 <= n == len(ids) <= 4, line[0]  # 4 requests in flight at most (max_inflight_requests)
            assert "running" not in st["samples_by_state"] and st["queues"]["leased"] == 0
            partial = set()
            for g in range(3):
                _, samples = await buf.get_group(f"g{g}")
                partial |= {s.sample_id for s in samples if s.status == SampleStatus.PARTIAL}
                for s in samples:
                    if s.status == SampleStatus.PARTIAL:
                        assert s.response_ids and s.segments[-1].finish_reason == "abort"
            assert partial == ids  # parked partials == the in-flight requests at the signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_rejects_bad_invocations_before_starting_anything(redis_url, tiny_model_dir, capsys):
    from rollout_server.cli import main

    assert main(["--model_path", str(tiny_model_dir)]) == 2
    assert "buffer.redis_url is not set" in capsys.readouterr().err
    assert main(["--model_path", str(tiny_model_dir), "--redis_url", redis_url, "--server_index", "x"]) == 2
    assert "take integers" in capsys.readouterr().err
    assert main(["--model_path", str(tiny_model_dir), "--redis_url", redis_url, "--max_response_len", "2000"]) == 2
    assert "exceed the context of 1024 tokens" in capsys.readouterr().err
    assert main(["--model_path", str(tiny_model_dir), "--redis_url", redis_url, "--server_index", "3",
                 "--max_response_len", "64", "--rollout.server_urls", "[http://127.0.0.1:9]"]) == 2
    assert "--server_index 3 is out of range" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "--server_index" in capsys.readouterr().out


async def test_stream_that_keeps_breaking_on_a_healthy_engine_stops_the_worker(redis_url, tokenizer):
    """Fault injection over real HTTP: an engine that answers /health but cuts every /generate
    stream after its first chunk. The worker must not reclaim and break the sample forever: after
    ``MAX_ENGINE_FAILURES`` broken streams of one sample it stops with a WorkerError naming it."""
    from aiohttp import web

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"text": "", "output_ids": [7], "meta_info": {
            "id": "x", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 1,
            "weight_version": "0", "output_token_logprobs": [[-1.0, 7, None]]}}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        request.transport.close()  # the connection breaks mid-stream
        return resp

    async def ok(_request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "0", "incremental_streaming_output": True,
                                  "success": True, "message": "ok"})

    app = web.Application()
    app.router.add_post("/generate", generate)
    for path in ("/health", "/get_model_info", "/get_server_info"):
        app.router.add_get(path, ok)
    app.router.add_post("/update_weight_version", ok)
    from rollout_server.testing import serve_app

    async with serve_app(app) as port:
        async with await ReplayBuffer.open(redis_url, "broken", _settings(n_samples_per_prompt=2)) as buf:
            await _feed(buf, [PromptGroup("g", [5, 6, 7], {}, 2)])
            w = _worker(buf, f"http://127.0.0.1:{port}", tokenizer, "w-broken", inflight=1)
            with pytest.raises(WorkerError, match=r"g/\d.*broke 3 times"):
                await asyncio.wait_for(w.run(asyncio.Event()), 60)
            await w.client.close()
            _, samples = await buf.get_group("g")
            assert all(s.status != SampleStatus.COMPLETE for s in samples)  # nothing was passed off as done
