"""LoRA adapters by name (issue 30 item 2, SGLang's path): the rollout worker registers each adapter
version with ``/load_lora_adapter`` and names it in ``lora_path`` on every request, tested over real
HTTP against the embedded server, which implements SGLang's adapter endpoints (a real redis-server,
the tiny random model, fp32; no SGLang here: no GPU)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from asyncrl.core.config import ConfigError, load_config
from asyncrl.core.types import PromptGroup, SampleStatus
from asyncrl.core.weights import ADAPTER_WEIGHTS_FILE, write_weights
from buffers import ReplayBuffer
from rollout_server.client import EngineClient, EngineError
from rollout_server.testing import recompute_logprobs, start_embedded_server
from rollout_server.worker import WorkerError
from rollout_server.worker_weights import adapter_name
from tests.test_lora import (COMPLETION, PROMPT, _completion_logprobs, _lora_cfg, _publish_adapter,
                             _train_and_publish)
from tests.test_rollout_worker import TEMPERATURE, _feed, _prompt, _ready, _run_until, _settings, _worker
from tests.test_rollout_worker import models, server_a, tokenizer  # noqa: F401 (fixtures)
from tests.test_trainer import tiny_model  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow


def _diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b))


async def _prompt_logprobs(c: EngineClient, **extra) -> list[float]:
    out = await c.generate(PROMPT + COMPLETION, {"max_new_tokens": 1, "temperature": 0},
                           logprob_start_len=len(PROMPT) - 1, **extra)
    return [v[0] for v in out["meta_info"]["input_token_logprobs"][1:]]


async def _model_info(c: EngineClient) -> dict:
    return await c.model_info()


def test_trainer_adapter_loaded_by_name_gives_the_trainer_logprobs(tmp_path, tiny_model_dir, tiny_model, redis_url):
    """The real trainer publishes adapter v1 (disk); a ``by_name`` worker registers it on the engine
    under its versioned name without touching the base weights; a request naming it gets the
    trainer's logprobs to 1e-4, one naming none the base model's, bit for bit as before."""
    want, announced = _train_and_publish(_lora_cfg(tmp_path, tiny_model_dir, loss={"kl_coef": 0.1}), tiny_model)
    (version, uri, checksum), = announced
    base = _completion_logprobs(tiny_model)
    assert _diff(want, base) > 1e-3  # the adapter changed the policy
    server = start_embedded_server(tiny_model_dir, "--weight-version", "0")
    try:
        async def go():
            async with await ReplayBuffer.open(redis_url, "byname-trainer", _settings()) as buf:
                await buf.clock.publish(version, uri, checksum)
                w = _worker(buf, server.url, None, "w-trainer", lora_mode="by_name")
                try:
                    assert await w.sync_weights(initial=True) is True
                    assert (w.version, w.adapter) == (1, adapter_name(await buf.clock.latest()))
                    async with server.client() as c:
                        info = await _model_info(c)
                        return w.adapter, info, await _prompt_logprobs(c, lora_path=w.adapter), await _prompt_logprobs(c)
                finally:
                    await w.client.close()

        name, info, got, got_base = asyncio.run(go())
    finally:
        server.stop()
    assert name.startswith("asyncrl-l") and f"-v1-{checksum[:12]}" in name
    assert list(info["lora_adapters"]) == [name] and info["lora_adapters"][name]["checksum"] == checksum
    assert info["weight_version"] == "0" and info["lora_adapter"] is None  # nothing merged: the base stays
    assert _diff(got, want) < 1e-4
    assert _diff(got_base, base) < 1e-5


async def test_partial_rollout_resumes_under_the_next_adapter_and_the_registered_set_is_bounded(
        redis_url, server_a, models, tokenizer, tmp_path):
    """Through the real worker (``by_name``, ``max_staleness`` 1): a sample parked at the budget
    under adapter v1 resumes under adapter v2, per-token versions [1]*4 + [2]*8 and each token's
    logprob that version's recomputation (PEFT's own merge). Loading v3 unloads v1: at most
    ``max_staleness + 1`` adapters stay registered, and a leftover of an earlier worker goes too."""
    server = server_a
    settings = _settings(n_samples_per_prompt=2, max_budget=4, max_response_len=12, flush_tokens=2, max_staleness=1)
    adapters = {v: _publish_adapter(tmp_path / "weights", v, models["lm0"], seed=10 + v) for v in (1, 2, 3)}
    async with server.client() as c:  # a leftover of an earlier worker life on this engine
        await c.load_lora_adapter("asyncrl-l0-v0-leftover", str(adapters[1][0]))
    async with await ReplayBuffer.open(redis_url, "byname-partial", settings) as buf:
        prompt = _prompt(tokenizer, "count to ten")
        await _feed(buf, [PromptGroup("g0", prompt, {}, 2)])
        w = _worker(buf, server.url, tokenizer, "w-byname", lora_mode="by_name", extra_sampling_params={"ignore_eos": True})
        try:
            await buf.clock.publish(1, str(adapters[1][0]), adapters[1][1])
            assert await w.sync_weights(initial=True) is True and w.version == 1
            name1 = w.adapter
            items = await buf.claim("w-byname", 2)
            assert await asyncio.gather(*(w.process(it) for it in items)) == [SampleStatus.PARTIAL] * 2
            await buf.clock.publish(2, str(adapters[2][0]), adapters[2][1])
            stats = await _run_until(w, _ready(buf, 1))
            assert stats.weight_updates == 2 and w.version == 2 and w.adapter != name1  # v1, then v2
            name2 = w.adapter
            await w.adapters_pruned()
            async with server.client() as c:
                registered = set((await _model_info(c))["lora_adapters"])
            assert registered == {name1, w.adapter}  # v1 and v2: max_staleness + 1; the leftover is gone
            _, samples = await buf.get_group("g0")
            for s in samples:
                assert s.status == SampleStatus.SCORED and s.versions == [1] * 4 + [2] * 8, s.versions
                ref1 = recompute_logprobs(adapters[1][2], prompt, s.response_ids, TEMPERATURE)
                ref2 = recompute_logprobs(adapters[2][2], prompt, s.response_ids, TEMPERATURE)
                ref0 = recompute_logprobs(models["lm0"], prompt, s.response_ids, TEMPERATURE)
                got = s.behaviour_logprobs
                assert _diff(ref1[:4], got[:4]) < 1e-4 and _diff(ref2[4:], got[4:]) < 1e-4
                assert _diff(ref0, got) > 1e-3 and _diff(ref1[4:], got[4:]) > 1e-3  # really each version's adapter

            await buf.clock.publish(3, str(adapters[3][0]), adapters[3][1])
            assert await w.sync_weights() is True and w.version == 3
            await w.adapters_pruned()
            async with server.client() as c:
                registered = set((await _model_info(c))["lora_adapters"])
                assert w.adapter == adapter_name(await buf.clock.latest())
                assert registered == {name2, w.adapter} and len(registered) == settings.max_staleness + 1
                with pytest.raises(EngineError) as err:  # v1 is gone for new requests: a 400, never the base model
                    await c.generate(prompt, {"max_new_tokens": 1}, lora_path=name1)
                assert err.value.status == 400 and "not loaded" in err.value.message
        finally:
            await w.client.close()
            await _unload_all(server.url)


async def _unload_all(url: str) -> None:
    async with EngineClient(url) as c:
        for name in list((await c.model_info())["lora_adapters"]):
            await c.unload_lora_adapter(name)


async def test_a_failed_adapter_load_fails_loudly_and_the_worker_keeps_its_version(redis_url, server_a, models, tokenizer,
                                                                                   tmp_path):
    """Adapter v2 targets a module the model lacks: ``/load_lora_adapter`` refuses it (400), the
    worker counts an error, stays at version 1 with adapter v1 (the next segment's tokens are v1's,
    never labelled 2), nothing new is registered. An adapter unloaded behind the worker's back makes
    the engine refuse its next request (400) and the worker stops with :class:`WorkerError`."""
    server = server_a
    settings = _settings(n_samples_per_prompt=1, max_budget=4, max_response_len=12, flush_tokens=2, max_staleness=1)
    path1, sha1, merged1 = _publish_adapter(tmp_path / "weights", 1, models["lm0"], seed=5)
    good2 = _publish_adapter(tmp_path / "good", 2, models["lm0"], seed=6)[0]
    cfg = json.loads((good2 / "adapter_config.json").read_text())
    from safetensors.torch import load_file

    tensors = {k.replace("q_proj", "no_such_proj"): v for k, v in load_file(str(good2 / ADAPTER_WEIGHTS_FILE)).items()}
    bad, bad_sha = write_weights(tmp_path / "weights", 2, tensors, cfg, adapter=True)
    async with await ReplayBuffer.open(redis_url, "byname-bad", settings) as buf:
        prompt = _prompt(tokenizer, "count to ten")
        await buf.clock.publish(1, str(path1), sha1)
        w = _worker(buf, server.url, tokenizer, "w-bad", lora_mode="by_name", extra_sampling_params={"ignore_eos": True})
        try:
            assert await w.sync_weights(initial=True) is True
            name1 = w.adapter
            await buf.clock.publish(2, str(bad), bad_sha)
            assert await w.sync_weights() is False
            assert w.stats.weight_update_errors == 1 and (w.version, w.adapter) == (1, name1)
            async with server.client() as c:
                assert set((await _model_info(c))["lora_adapters"]) == {name1}
            await _feed(buf, [PromptGroup("g0", prompt, {}, 1)])
            w._retry_after = float("inf")  # no retry of v2 in the middle of the segment below
            item, = await buf.claim("w-bad", 1)
            assert await w.process(item) == SampleStatus.PARTIAL
            s = await buf.get_sample("g0/0")
            assert s.versions == [1] * 4
            assert _diff(recompute_logprobs(merged1, prompt, s.response_ids, TEMPERATURE), s.behaviour_logprobs) < 1e-4

            async with server.client() as c:  # the adapter disappears behind the worker's back
                await c.unload_lora_adapter(name1)
            item, = await buf.claim("w-bad", 1)  # g0/0 again: it has budget left under the new clock
            with pytest.raises(WorkerError, match="not loaded"):
                await w.process(item)
        finally:
            await w.client.close()
            await _unload_all(server.url)


async def test_adapters_apply_per_row_in_one_batch(server_a, models, tmp_path):
    """One batched request, three prompts: adapter a, adapter b, none. The decode steps run the
    three rows together; each row's logprobs (prompt and sampled tokens) are its own model's."""
    pa, _, ma = _publish_adapter(tmp_path / "a", 1, models["lm0"], seed=21)
    pb, _, mb = _publish_adapter(tmp_path / "b", 1, models["lm0"], seed=22, target_modules=("k_proj", "o_proj", "up_proj"))
    async with server_a.client() as c:
        try:
            res = await c.load_lora_adapter("a", str(pa))
            assert res["loaded_adapters"] == {"a": str(pa)}
            await c.load_lora_adapter("b", str(pb))
            outs = await c.generate([PROMPT] * 3, {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True},
                                    logprob_start_len=0, lora_path=["a", "b", None])
        finally:
            await _unload_all(server_a.url)
    for out, model, name in zip(outs, (ma, mb, models["lm0"]), ("a", "b", None)):
        meta = out["meta_info"]
        assert meta.get("lora_path") == name
        ids = out["output_ids"]
        want = recompute_logprobs(model, PROMPT, ids, 1.0)
        assert _diff([v[0] for v in meta["output_token_logprobs"]], want) < 1e-4
        with torch.no_grad():
            lsm = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), -1)
        prompt_want = [float(lsm[t - 1, PROMPT[t]]) for t in range(1, len(PROMPT))]
        assert _diff([v[0] for v in meta["input_token_logprobs"][1:]], prompt_want) < 1e-4


async def test_adapter_endpoints_refuse_bad_input_with_a_4xx(server_a, models, tmp_path):
    """Every body is checked by its schema (the message names the field); an unknown adapter is a 400,
    so is a name taken twice, an unload of nothing, a merged adapter under named ones and the reverse,
    and more than ``--max-loaded-loras`` adapters; nothing of it changes what is registered."""
    path, _, _ = _publish_adapter(tmp_path / "w", 1, models["lm0"], seed=31)
    async with server_a.client() as c:
        async def refused(route: str, body: dict) -> str:
            status, data = await c._request("POST", route, body)
            assert status == 400, (route, body, status, data)
            return json.dumps(data)

        try:
            assert "lora_name" in await refused("/load_lora_adapter", {"lora_path": str(path)})
            assert "lora_name" in await refused("/load_lora_adapter", {"lora_name": "a b", "lora_path": str(path)})
            assert "lora_name" in await refused("/load_lora_adapter", {"lora_name": "x" * 257, "lora_path": str(path)})
            assert "colour" in await refused("/load_lora_adapter", {"lora_name": "a", "lora_path": str(path), "colour": 1})
            assert "cannot read the adapter" in await refused("/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)})
            assert "not loaded" in await refused("/unload_lora_adapter", {"lora_name": "a"})
            assert "lora_path" in await refused("/generate", {"input_ids": PROMPT, "lora_path": 3})
            assert "not loaded" in await refused("/generate", {"input_ids": PROMPT, "lora_path": "a"})
            await c.load_lora_adapter("a", str(path))
            assert "already loaded" in await refused("/load_lora_adapter", {"lora_name": "a", "lora_path": str(path)})
            assert "2 entries for a batch of 1" in await refused("/generate", {"input_ids": [PROMPT], "lora_path": ["a", "a"]})
            assert "named LoRA adapters are loaded" in await refused("/update_weights_from_disk", {"model_path": str(path)})
            for i in range(7):  # the server's default --max-loaded-loras is 8
                await c.load_lora_adapter(f"a{i}", str(path))
            assert "at most 8" in await refused("/load_lora_adapter", {"lora_name": "a9", "lora_path": str(path)})
            assert len((await c.model_info())["lora_adapters"]) == 8
            await _unload_all(server_a.url)
            await c.update_weights_from_disk(str(path), weight_version="7")  # merged
            assert "merged LoRA adapter is loaded" in await refused("/load_lora_adapter", {"lora_name": "a", "lora_path": str(path)})
            assert (await c.model_info())["lora_adapters"] == {}
        finally:
            await _unload_all(server_a.url)
            await c.update_weights_from_disk(str(models["dir0"]), weight_version="0")


def test_lora_mode_config():
    """auto: by_name on SGLang, merge on the embedded engine; SGLang cannot merge, by_name cannot take nccl."""
    lora = {"lora": {}}
    assert load_config([], overrides={"trainer": lora}).resolved_lora_mode() == "merge"
    assert load_config([], overrides={"trainer": lora, "rollout": {"engine": "sglang"}}).resolved_lora_mode() == "by_name"
    assert load_config([], overrides={"rollout": {"engine": "sglang"}}).resolved_lora_mode() is None
    with pytest.raises(ConfigError, match="lora_mode=merge needs the embedded engine"):
        load_config([], overrides={"trainer": lora, "rollout": {"engine": "sglang", "lora_mode": "merge"}})
    with pytest.raises(ConfigError, match="use weight_sync.transport disk or http"):
        load_config([], overrides={"trainer": lora, "rollout": {"lora_mode": "by_name"}, "weight_sync": {"transport": "nccl"}})
    from rollout_server.worker_options import WorkerOptions

    cfg = load_config([], overrides={"trainer": lora, "rollout": {"engine": "sglang"}})
    assert WorkerOptions.from_config(cfg, "w").lora_mode == "by_name"
    with pytest.raises(ValueError, match="transport must be disk or http"):
        WorkerOptions("w", lora_mode="by_name", transport="nccl")
