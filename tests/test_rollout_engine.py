"""Behaviour of the embedded engine through its HTTP API: real continuous batching, token
identity of segmented generation across servers, behaviour-logprob consistency with a
trainer-style recomputation, weight updates mid-generation (disk, safetensors tensor payload,
and the distributed choreography over gloo between two processes).

Real server processes on loopback, the tiny model with redrawn weights, fp32.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.core.net import free_port
from asyncrl.core.weights import DistributedWeightSender, load_state_dict_from_dir
from rollout_server.client import EngineClient
from rollout_server.testing import (
    greedy_reference,
    make_random_model,
    recompute_logprobs,
    start_embedded_server,
)

pytestmark = pytest.mark.integration

KEY = "k-engine"


@pytest.fixture(scope="module")
def engine_args():
    """Extra flags of every server these tests start: none here; tests/test_rollout_engine_cuda.py, which
    runs these tests with these fixtures, overrides it (``--device cuda``)."""
    return ()


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("rc_engine")
    return make_random_model(tiny_model_dir, base / "v0", seed=1), make_random_model(tiny_model_dir, base / "v1", seed=2)


@pytest.fixture(scope="module")
def models(dirs):
    """The references (greedy decoding, logprob recomputation), on the CPU in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in dirs)


@pytest.fixture(scope="module")
def srv_a(dirs, engine_args, tmp_path_factory):
    s = start_embedded_server(dirs[0], "--weight-version", "0", *engine_args,
                              log_path=tmp_path_factory.mktemp("log") / "a.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def srv_b(dirs, engine_args, tmp_path_factory):
    s = start_embedded_server(dirs[0], "--weight-version", "0", "--incremental-streaming-output", *engine_args,
                              api_key=KEY, log_path=tmp_path_factory.mktemp("log") / "b.log")
    yield s
    s.stop()


@pytest.fixture
def srv_w(dirs, engine_args, tmp_path):
    """A fresh server per weight-update test (its weights change)."""
    s = start_embedded_server(dirs[0], "--weight-version", "0", *engine_args, log_path=tmp_path / "w.log")
    yield s
    s.stop()


LONG = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}


async def test_batching_is_real(srv_a):
    n = 4
    events: dict[str, list[float]] = {}

    async with EngineClient(srv_a.url) as c:
        async def run(rid, prompt):
            async for d in c.generate_stream(prompt, LONG, rid=rid):
                ev = events.setdefault(rid, [])
                if not ev and d.token_ids:
                    ev.append(time.monotonic())  # first token
                if d.finish_reason is not None:
                    ev.append(time.monotonic())  # finish

        batch = [asyncio.create_task(run(f"b{i}", [1, 10 + i, 20 + i])) for i in range(n)]
        # while they run, the engine reports them all running at once
        peak = 0
        for _ in range(500):
            peak = max(peak, (await c.loads())["num_running_reqs"])
            if peak >= n:
                break
            await asyncio.sleep(0.005)
        assert peak >= n
        late = asyncio.create_task(run("late", [1, 99, 98, 97]))
        await asyncio.gather(*batch, late)
    first_batch_finish = min(events[f"b{i}"][1] for i in range(n))
    assert events["late"][0] < first_batch_finish  # joined the running batch at the next step


async def _segmented(clients, prompt, total, budget):
    """Generate ``total`` greedy tokens in ``budget``-sized segments, alternating servers."""
    response, logprobs, versions = [], [], []
    seg = 0
    while len(response) < total:
        c = clients[seg % len(clients)]
        res = await c.generate_collect(prompt + response, {"max_new_tokens": min(budget, total - len(response)),
                                                           "temperature": 0, "ignore_eos": True})
        assert res.finish_type == "length"
        response += res.token_ids
        logprobs += res.logprobs
        versions += res.versions
        seg += 1
    return response, logprobs, versions, seg


async def test_token_identity_segmented_across_servers(srv_a, srv_b):
    prompt = [1, 5, 6, 7, 8, 9, 10]
    async with srv_a.client() as a, srv_b.client() as b:
        whole = await a.generate(prompt, {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})
        resp, lps, versions, segments = await _segmented([a, b], prompt, 40, budget=9)
    assert segments >= 4  # >= 3 segment boundaries, on two different servers
    assert len(set(whole["output_ids"])) >= 10
    assert resp == whole["output_ids"]
    ref_lps = [x[0] for x in whole["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(lps, ref_lps)) < 1e-5
    assert set(versions) == {"0"}


async def test_server_info_says_where_the_engine_runs(srv_a):
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(srv_a.url + "/server_info") as r:
        info = await r.json()
    assert (info["device"], info["dtype"]) == ("cpu", "float32")


async def test_greedy_matches_full_recomputation(srv_a, models):
    prompt = [1, 3, 4, 5]
    async with srv_a.client() as a:
        out = await a.generate(prompt, {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True})
    ids, lps = greedy_reference(models[0], prompt, 30)
    assert out["output_ids"] == ids
    assert max(abs(x[0] - y) for x, y in zip(out["meta_info"]["output_token_logprobs"], lps)) < 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_behaviour_logprobs_match_trainer_recomputation(srv_b, models, temperature):
    prompt = [1, 12, 13, 14, 15]
    async with srv_b.client() as b:
        outs = await b.generate(prompt, {"max_new_tokens": 24, "temperature": temperature, "top_p": 1.0, "top_k": -1,
                                         "n": 3, "ignore_eos": True})
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # really sampled
    for o in outs:
        behaviour = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
        trainer = recompute_logprobs(models[0], prompt, o["output_ids"], temperature)
        assert max(abs(x - y) for x, y in zip(behaviour, trainer)) < 1e-4


async def test_sampling_seed_is_reproducible(srv_a):
    body = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 1234}
    async with srv_a.client() as a:
        x = await a.generate([1, 2, 3], body)
        y = await a.generate([1, 2, 3], body)
        z = await a.generate([1, 2, 3], {**body, "sampling_seed": 99})
        group = await a.generate([1, 2, 3], {**body, "n": 2})
    assert x["output_ids"] == y["output_ids"] != z["output_ids"]
    assert group[0]["output_ids"] == x["output_ids"] != group[1]["output_ids"]  # sample j uses seed + j


async def test_stop_conditions(srv_a, models):
    prompt = [1, 5, 6, 7, 8, 9, 10]
    ids, _ = greedy_reference(models[0], prompt, 12)
    target = ids[5]
    k = ids.index(target)
    async with srv_a.client() as a:
        out = await a.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [target]})
        assert out["output_ids"] == ids[: k + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
        # min_new_tokens masks the stop token until reached
        out = await a.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [target],
                                        "min_new_tokens": 12})
        assert target not in out["output_ids"] or out["output_ids"].index(target) >= 12
        full = await a.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        text = full["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        if stop.strip() and "\ufffd" not in stop:
            out = await a.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop]})
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
            assert stop not in out["text"] and len(out["output_ids"]) < 12
            kept = await a.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True,
                                             "stop": [stop], "no_stop_trim": True})
            assert kept["text"].endswith(stop) or stop in kept["text"]


async def test_client_normalises_both_streaming_modes(srv_a, srv_b):
    prompt = [1, 40, 41]
    body = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    async with srv_a.client() as a, srv_b.client() as b:
        assert await a.incremental_streaming() is False
        assert await b.incremental_streaming() is True
        ra = await a.generate_collect(prompt, body)
        rb = await b.generate_collect(prompt, body)
        plain = await a.generate(prompt, body)
    assert ra.token_ids == rb.token_ids == plain["output_ids"]
    assert ra.text == rb.text == plain["text"]
    assert len(ra.logprobs) == len(rb.logprobs) == 20 and ra.versions == rb.versions == ["0"] * 20


async def test_weight_update_mid_generation_abort_mode(srv_w, dirs, models):
    """pause(abort) -> partial segment under v0 -> load v1 from disk -> resume: the new segment is
    v1's greedy continuation of prompt + partial, and differs from v0's."""
    prompt = [1, 21, 22, 23]
    async with srv_w.client() as c:
        q: asyncio.Queue = asyncio.Queue()

        async def run():
            async for d in c.generate_stream(prompt, LONG, rid="wu"):
                await q.put(d)

        task = asyncio.create_task(run())
        got = []
        while len(got) < 5:
            got += (await asyncio.wait_for(q.get(), 60)).token_ids
        await c.pause("abort")
        await asyncio.wait_for(task, 30)
        seg1 = got
        while not q.empty():
            d = q.get_nowait()
            seg1 += d.token_ids
            last = d
        assert last.finish_reason["type"] == "abort" and set(last.versions) <= {"0"}
        res = await c.update_weights_from_disk(str(dirs[1]), weight_version="1")
        assert res["success"] and "Weight version updated to 1" in res["message"]
        await c.resume()
        assert await c.weight_version() == "1"
        seg2 = await c.generate_collect(prompt + seg1, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert seg2.versions == ["1"] * 12 and seg2.meta["weight_version"] == "1"
    new_ref, new_lps = greedy_reference(models[1], prompt + seg1, 12)
    old_ref, _ = greedy_reference(models[0], prompt + seg1, 12)
    assert seg2.token_ids == new_ref and seg2.token_ids != old_ref
    assert max(abs(x - y) for x, y in zip(seg2.logprobs, new_lps)) < 1e-4


async def test_weight_update_in_place_tags_token_spans(srv_w, models):
    """pause(in_place) + update from a safetensors tensor payload: one response carries both versions."""
    import torch

    state = {n: p.detach().clone() for n, p in models[1].named_parameters()}
    prompt = [1, 31, 32]
    async with srv_w.client() as c:
        running = asyncio.create_task(c.generate(prompt, LONG, rid="inplace"))
        while (await c.loads())["num_running_reqs"] < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await c.pause("in_place")
        res = await c.update_weights_from_tensor(state, weight_version="2")
        assert res["success"] and res["num_paused_requests"] == 1
        await c.resume()
        out = await asyncio.wait_for(running, 60)
    spans = out["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0 and spans[1]["end"] == 900
    assert out["meta_info"]["weight_version"] == "2"
    del torch


async def test_distributed_weight_update_over_gloo(srv_w, dirs, models):
    """SGLang's NCCL choreography, run over gloo: this test process is trainer rank 0, the server rank 1."""
    state = load_state_dict_from_dir(dirs[1])
    sender = DistributedWeightSender([srv_w.url], "127.0.0.1", free_port(), backend="gloo", timeout_seconds=60)
    await sender.init()
    try:
        await sender.send(state, version="7")
    finally:
        await sender.close()
    prompt = [1, 2, 3, 4]
    async with srv_w.client() as c:
        assert await c.weight_version() == "7"
        out = await c.generate(prompt, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    assert out["output_ids"] == greedy_reference(models[1], prompt, 10)[0]
    assert out["meta_info"]["weight_version"] == "7"


async def test_engine_failure_fails_requests_not_the_server(srv_w, models):
    """NaN weights are refused (400, old weights kept). Finite weights that overflow fp32 (one
    embedding row of 3e38, tied to the output layer, makes every logits row inf/NaN) fail the
    requests (500 / an error chunk naming the non-finite logits), the server keeps serving, and
    good weights fix it."""
    import math

    from rollout_server.client import EngineError

    nan = {n: p.detach().clone().fill_(math.nan) for n, p in models[0].named_parameters() if n.endswith("norm.weight")}
    emb = models[0].get_input_embeddings().weight.detach().clone()
    huge = emb.clone()
    huge[5] = 3e38
    async with srv_w.client() as c:
        with pytest.raises(EngineError) as err:
            await c.update_weights_from_tensor(nan, weight_version="nan")
        assert err.value.status == 400 and "NaN or inf" in err.value.message
        assert await c.weight_version() == "0"
        await c.update_weights_from_tensor({"model.embed_tokens.weight": huge}, weight_version="huge")
        with pytest.raises(EngineError) as err:
            await c.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 1.0})
        assert err.value.status == 500 and "engine error" in err.value.message and "non-finite logits" in err.value.message
        with pytest.raises(EngineError, match="non-finite logits"):
            await c.generate_collect([1, 2, 3], {"max_new_tokens": 4, "temperature": 0})
        assert await c.health()
        await c.update_weights_from_tensor({"model.embed_tokens.weight": emb}, weight_version="0")
        out = await c.generate([1, 2, 3], {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert out["output_ids"] == greedy_reference(models[0], [1, 2, 3], 6)[0]


async def test_prompt_and_top_logprobs(srv_a, models):
    import torch

    prompt = [1, 50, 51, 52, 53]
    async with srv_a.client() as a:
        out = await a.generate(prompt, {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
                               logprob_start_len=0, top_logprobs_num=4)
        scored = await a.generate(prompt, {"max_new_tokens": 0}, logprob_start_len=2)
    m = out["meta_info"]
    inp = m["input_token_logprobs"]
    assert [x[1] for x in inp] == prompt and inp[0][0] is None  # SGLang pads the first with None
    with torch.no_grad():
        lsm = torch.log_softmax(models[0](torch.tensor([prompt])).logits[0].float(), -1)
    ref = [float(lsm[j - 1, prompt[j]]) for j in range(1, len(prompt))]
    assert max(abs(x[0] - y) for x, y in zip(inp[1:], ref)) < 1e-4
    tops = m["output_top_logprobs"]
    assert len(tops) == 3 and all(len(row) == 4 for row in tops)
    for row, (lp, tok, _) in zip(tops, m["output_token_logprobs"]):
        assert row[0][1] == tok and abs(row[0][0] - lp) < 1e-6  # greedy: the top-1 is the sampled token
        assert [x[0] for x in row] == sorted((x[0] for x in row), reverse=True)
    # max_new_tokens 0: prefill only (scoring a prompt), logprobs from position 2 on
    assert scored["output_ids"] == [] and scored["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [x[1] for x in scored["meta_info"]["input_token_logprobs"]] == prompt[2:]
    assert abs(scored["meta_info"]["input_token_logprobs"][1][0] - ref[2]) < 1e-4


async def test_sampling_filters_and_penalties(srv_a, models):
    prompt = [1, 60, 61, 62]
    greedy = greedy_reference(models[0], prompt, 10)[0]
    base = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}
    async with srv_a.client() as a:
        # truncation to one token makes sampling greedy; the reported logprob stays the full distribution's
        for extra in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
            out = await a.generate(prompt, {**base, **extra})
            assert out["output_ids"] == greedy, extra
            assert all(x[0] < 0 for x in out["meta_info"]["output_token_logprobs"])
        forced = await a.generate(prompt, {**base, "logit_bias": {"7": 100.0}})
        assert forced["output_ids"] == [7] * 10
        plain = await a.generate(prompt, {**base, "temperature": 0})
        for extra in ({"repetition_penalty": 1.9}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
            pen = await a.generate(prompt, {**base, "temperature": 0, **extra})
            assert pen["output_ids"] != plain["output_ids"], extra
            counts = {t: pen["output_ids"].count(t) for t in pen["output_ids"]}
            assert max(counts.values()) <= max(plain["output_ids"].count(t) for t in plain["output_ids"])


async def test_weight_update_without_pause_waits_or_aborts(srv_w, dirs):
    """Not paused: an update waits for the running requests (SGLang's writer lock), which finish
    entirely under the old version; with abort_all_requests they are aborted first."""
    async with srv_w.client() as c:
        running = asyncio.create_task(c.generate([1, 2, 3], {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}))
        while (await c.loads())["num_running_reqs"] < 1:
            await asyncio.sleep(0.01)
        await c.update_weights_from_disk(str(dirs[1]), weight_version="1")
        assert running.done()  # the update returned only after the running request finished
        out = running.result()
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 300}]
        running = asyncio.create_task(c.generate([1, 2, 3], LONG))
        while (await c.loads())["num_running_reqs"] < 1:
            await asyncio.sleep(0.01)
        await c.update_weights_from_disk(str(dirs[0]), weight_version="2", abort_all_requests=True)
        out = await asyncio.wait_for(running, 30)
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["weight_version"] == "1"
        assert await c.weight_version() == "2"
