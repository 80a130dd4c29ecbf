"""API conformance of the embedded engine server against SGLang's shapes.

SGLang's native API: https://docs.sglang.io/basic_usage/native_api.html; the subset asyncrl
speaks is in docs/rollout.md.

Real server processes (``python -m rollout_server.server``) on loopback, real HTTP, the tiny
model with redrawn weights (``make_random_model``), fp32.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle
import time

import aiohttp
import pytest

from rollout_server.client import EngineClient, EngineError
from rollout_server.testing import make_random_model, start_embedded_server

pytestmark = pytest.mark.integration

KEY = "s3cret-key"
LONG = {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return make_random_model(tiny_model_dir, tmp_path_factory.mktemp("rc") / "varied", seed=1)


@pytest.fixture(scope="module")
def srv(model_dir, tmp_path_factory):
    """Cumulative streaming, no API key."""
    s = start_embedded_server(model_dir, log_path=tmp_path_factory.mktemp("log") / "cum.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def srv_inc(model_dir, tmp_path_factory):
    """Incremental streaming, API key required."""
    s = start_embedded_server(model_dir, "--incremental_streaming_output", api_key=KEY,
                              log_path=tmp_path_factory.mktemp("log") / "inc.log")
    yield s
    s.stop()


async def post(url, path, body=None, headers=None, data=None):
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body if data is None else None, data=data, headers=headers or {}) as r:
            return r.status, await r.read(), r.headers.get("Content-Type", "")


async def get(url, path, headers=None):
    async with aiohttp.ClientSession() as http:
        async with http.get(url + path, headers=headers or {}) as r:
            return r.status, await r.read(), r.headers.get("Content-Type", "")


async def sse(url, body, headers=None):
    """Raw SSE chunks of one streamed /generate (list of dicts; asserts the [DONE] terminator)."""
    chunks = []
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", json={**body, "stream": True}, headers=headers or {}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        chunks.append(json.loads(e[len("data: "):]))
    return chunks


# ------------------------------------------------------------------------------------------------
# /generate


async def test_generate_response_shape(srv):
    status, raw, ctype = await post(srv.url, "/generate", {
        "input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "return_logprob": True})
    assert status == 200 and ctype.startswith("application/json")
    out = json.loads(raw)
    assert set(out) == {"text", "output_ids", "meta_info"}
    m = out["meta_info"]
    assert len(m["id"]) == 32
    assert m["finish_reason"] == {"type": "length", "length": 6}
    assert m["prompt_tokens"] == 4 and m["completion_tokens"] == 6 and len(out["output_ids"]) == 6
    assert m["weight_version"] == "default"
    assert m["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    assert isinstance(m["e2e_latency"], float) and m["e2e_latency"] > 0
    assert isinstance(m["cached_tokens"], int)
    lps = m["output_token_logprobs"]
    assert len(lps) == 6 and all(len(x) == 3 and x[2] is None and x[0] <= 0 for x in lps)
    assert [x[1] for x in lps] == out["output_ids"]
    assert m["input_token_logprobs"] == []


async def test_generate_text_batch_and_n(srv):
    status, raw, _ = await post(srv.url, "/generate", {"text": "the cat", "sampling_params": {"max_new_tokens": 3}})
    out = json.loads(raw)
    assert status == 200 and isinstance(out["text"], str) and len(out["output_ids"]) == 3
    # batch of two prompts -> list
    status, raw, _ = await post(srv.url, "/generate", {
        "input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "rid": ["a1", "a2"]})
    outs = json.loads(raw)
    assert status == 200 and [o["meta_info"]["id"] for o in outs] == ["a1", "a2"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 2]
    # n samples share one prefill: the others report the prompt as cached
    status, raw, _ = await post(srv.url, "/generate", {
        "input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "n": 3}, "rid": "grp"})
    outs = json.loads(raw)
    assert status == 200 and len(outs) == 3
    assert sorted(o["meta_info"]["id"] for o in outs) == ["grp_0", "grp_1", "grp_2"]
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0, 4, 4]


async def test_stream_cumulative(srv):
    body = {"input_ids": [1, 9, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "return_logprob": True}
    chunks = await sse(srv.url, body)
    # chunks may coalesce several tokens when the client lags (SGLang keeps only the latest)
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(set(counts)) and counts[-1] == 8
    for i, c in enumerate(chunks, 1):
        m = c["meta_info"]
        assert len(c["output_ids"]) == m["completion_tokens"] == len(m["output_token_logprobs"])  # cumulative
        assert c["output_ids"] == chunks[-1]["output_ids"][: len(c["output_ids"])]
        assert ("e2e_latency" in m) == (i == len(chunks))
        assert (m["finish_reason"] is None) == (i < len(chunks))
    status, raw, _ = await post(srv.url, "/generate", body)
    assert json.loads(raw)["output_ids"] == chunks[-1]["output_ids"]
    assert chunks[-1]["text"] == json.loads(raw)["text"]


async def test_stream_incremental(srv_inc):
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"input_ids": [1, 9, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "return_logprob": True}
    chunks = await sse(srv_inc.url, body, h)
    ids = [t for c in chunks for t in c["output_ids"]]
    lps = [x for c in chunks for x in c["meta_info"]["output_token_logprobs"]]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts[-1] == 8 and len(ids) == 8  # deltas add up; completion_tokens stays cumulative
    assert [len(c["output_ids"]) for c in chunks] == [b - a for a, b in zip([0] + counts, counts)]
    status, raw, _ = await post(srv_inc.url, "/generate", body, h)
    full = json.loads(raw)
    assert ids == full["output_ids"] and [x[1] for x in lps] == ids
    assert "".join(c["text"] for c in chunks) == full["text"]
    info = json.loads((await get(srv_inc.url, "/get_server_info", h))[1])
    assert info["incremental_streaming_output"] is True


async def test_stream_batch_chunks_carry_index(srv):
    chunks = await sse(srv.url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "n": 2}})
    assert sorted({c["index"] for c in chunks}) == [0, 1]
    assert sum(1 for c in chunks if c["meta_info"]["finish_reason"]) == 2


# ------------------------------------------------------------------------------------------------
# abort


async def _first_tokens(url, body, n_tokens, headers=None):
    """Start a streamed request; return (task collecting all chunks, queue of chunks) after n tokens."""
    q: asyncio.Queue = asyncio.Queue()

    async def run():
        async with EngineClient(url, api_key=(headers or {}).get("key")) as c:
            async for d in c.generate_stream(**body):
                await q.put(d)

    task = asyncio.create_task(run())
    got = 0
    while got < n_tokens:
        d = await asyncio.wait_for(q.get(), 60)
        got += len(d.token_ids)
    return task, q


async def _drain(task, q):
    await asyncio.wait_for(task, 60)
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


async def test_abort_running_returns_partial(srv):
    task, q = await _first_tokens(srv.url, {"input_ids": [1, 2, 3], "sampling_params": LONG, "rid": "abortme-1"}, 3)
    status, raw, _ = await post(srv.url, "/abort_request", {"rid": "abortme"})  # prefix match
    assert status == 200 and raw == b""
    rest = await _drain(task, q)
    last = rest[-1]
    assert last.finish_reason == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    n = last.meta["completion_tokens"]
    assert 3 <= n < 600 and len(last.meta["output_token_logprobs"]) >= 1


async def test_abort_all_non_streaming(srv):
    async with EngineClient(srv.url) as c:
        reqs = [asyncio.create_task(c.generate([1, 2, i], LONG, rid=f"all-{i}")) for i in range(3)]
        await asyncio.sleep(0.3)
        await c.abort(abort_all=True)
        outs = await asyncio.wait_for(asyncio.gather(*reqs), 60)
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(o["output_ids"]) == o["meta_info"]["completion_tokens"] == len(o["meta_info"]["output_token_logprobs"])
    # empty rid without abort_all is ignored (SGLang): a running request survives it
    async with EngineClient(srv.url) as c:
        t = asyncio.create_task(c.generate([1, 2], {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True}))
        await asyncio.sleep(0.05)
        await c.abort("")
        assert (await t)["meta_info"]["finish_reason"]["type"] == "length"


# ------------------------------------------------------------------------------------------------
# pause / continue


async def test_pause_abort_blocks_new_requests(srv):
    async with EngineClient(srv.url) as c:
        running = asyncio.create_task(c.generate([1, 4, 4], LONG))
        await asyncio.sleep(0.3)
        assert await c.pause("abort") == {"message": "Generation paused successfully.", "status": "ok"}
        out = await asyncio.wait_for(running, 30)
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"]
        late = asyncio.create_task(c.generate([1, 2], {"max_new_tokens": 2}))
        await asyncio.sleep(0.5)
        assert not late.done()  # waits while paused
        assert await c.resume() == {"message": "Generation continued successfully.", "status": "ok"}
        assert (await asyncio.wait_for(late, 30))["meta_info"]["finish_reason"]["type"] == "length"
    # empty body means abort mode (slime/AReaL POST {})
    status, raw, _ = await post(srv.url, "/pause_generation", data=b"")
    assert status == 200
    await post(srv.url, "/continue_generation", {})


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pause_keeps_requests(srv, mode):
    body = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
    async with EngineClient(srv.url) as c:
        ref = await c.generate([1, 7, 7, 7], body)
        running = asyncio.create_task(c.generate([1, 7, 7, 7], body))
        while (await c.loads())["num_running_reqs"] < 1:
            await asyncio.sleep(0.01)
        await c.pause(mode)
        await asyncio.sleep(0.3)
        assert not running.done()
        loads = await c.loads()
        assert loads["num_paused_reqs"] >= 1
        await c.resume()
        out = await asyncio.wait_for(running, 60)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == ref["output_ids"]  # greedy: same tokens as without the pause
    assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)


async def test_pause_bad_mode(srv):
    status, raw, _ = await post(srv.url, "/pause_generation", {"mode": "sideways"})
    assert status == 400 and "mode" in json.loads(raw)["error"]["message"]


# ------------------------------------------------------------------------------------------------
# auth


async def test_auth(srv_inc):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, raw, _ = await post(srv_inc.url, "/generate", body, headers)
        assert status == 401 and json.loads(raw) == {"error": "Unauthorized"}
    for path in ("/pause_generation", "/continue_generation", "/abort_request", "/update_weights_from_disk",
                 "/update_weights_from_tensor", "/flush_cache"):
        assert (await post(srv_inc.url, path, {}))[0] == 401, path
    assert (await get(srv_inc.url, "/get_server_info"))[0] == 401
    assert (await post(srv_inc.url, "/generate", body, {"Authorization": f"bearer {KEY}"}))[0] == 200
    assert (await post(srv_inc.url, "/generate", body, {"x-api-key": KEY}))[0] == 200
    for path in ("/health", "/health_generate", "/metrics"):
        assert (await get(srv_inc.url, path))[0] == 200, path


# ------------------------------------------------------------------------------------------------
# 400s


BAD_REQUESTS = [
    ({"input_ids": []}, "input_ids cannot be empty"),
    ({"input_ids": [[1], []]}, "input_ids cannot be empty"),
    ({}, "Either text, input_ids"),
    ({"input_ids": [1], "text": "x"}, "not both"),
    ({"input_ids": [1], "sampling_params": {"temprature": 0.5}}, "unknown sampling_params key"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": -5}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "not supported"),
    ({"input_ids": [1] * 1020, "sampling_params": {"max_new_tokens": 10}}, "maximum context length"),
    ({"input_ids": [1] * 1024, "sampling_params": {"max_new_tokens": 0}}, "maximum context length"),
    ({"input_ids": [1, 99999]}, "out of range"),
    ({"input_ids": [1, "a"]}, "input_ids[1]"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "batch"),
    ({"input_ids": [[1], [2]], "rid": ["x"]}, "rid"),
    ({"input_ids": [1], "frobnicate": True}, "unknown field"),
    ({"input_ids": [1], "logprob_start_len": -3}, "logprob_start_len"),
    ({"input_ids": [1], "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize("body,needle", BAD_REQUESTS)
async def test_bad_generate_requests(srv, body, needle):
    status, raw, _ = await post(srv.url, "/generate", body)
    assert status == 400
    err = json.loads(raw)
    assert set(err) == {"error"} and needle in err["error"]["message"]


async def test_bad_requests_do_not_disturb_others(srv):
    body = {"max_new_tokens": 80, "temperature": 0, "ignore_eos": True}
    async with EngineClient(srv.url) as c:
        ref = await c.generate([1, 3, 3], body)
        running = asyncio.create_task(c.generate([1, 3, 3], body))
        for bad, _ in BAD_REQUESTS[:8]:
            assert (await post(srv.url, "/generate", bad))[0] == 400
        assert (await post(srv.url, "/generate", data=b"{not json"))[0] == 400
        out = await running
    assert out["output_ids"] == ref["output_ids"] and out["meta_info"]["finish_reason"]["type"] == "length"


async def test_duplicate_running_rid_is_rejected(srv):
    async with EngineClient(srv.url) as c:
        t = asyncio.create_task(c.generate([1, 2], LONG, rid="dup-rid"))
        await asyncio.sleep(0.2)
        status, raw, _ = await post(srv.url, "/generate", {"input_ids": [1], "rid": "dup-rid"})
        assert status == 400 and "Duplicate" in json.loads(raw)["error"]["message"]
        await c.abort("dup-rid")
        await t


# ------------------------------------------------------------------------------------------------
# weights (error paths; the happy paths are in test_rollout_engine.py)


async def test_update_weights_errors_change_nothing(srv, tmp_path):
    import torch
    from safetensors.torch import save_file

    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    before = json.loads((await post(srv.url, "/generate", body))[1])["output_ids"]
    status, raw, _ = await post(srv.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert status == 400 and json.loads(raw)["success"] is False
    # a pickle is refused (never unpickled)
    blob = base64.b64encode(pickle.dumps({"lm_head.weight": [1.0]})).decode()
    status, raw, _ = await post(srv.url, "/update_weights_from_tensor", {"serialized_named_tensors": [blob]})
    assert status == 400 and "safetensors" in json.loads(raw)["message"]
    # wrong shape / unknown name: nothing half-applied
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"model.norm.weight": torch.zeros(64), "model.embed_tokens.weight": torch.zeros(3, 3)}, str(bad / "model.safetensors"))
    status, raw, _ = await post(srv.url, "/update_weights_from_disk", {"model_path": str(bad), "weight_version": "9"})
    assert status == 400 and "shape" in json.loads(raw)["message"]
    save_file({"not.a.param": torch.zeros(2)}, str(bad / "model.safetensors"))
    status, raw, _ = await post(srv.url, "/update_weights_from_disk", {"model_path": str(bad)})
    assert status == 400 and "unknown parameter" in json.loads(raw)["message"]
    assert (await post(srv.url, "/update_weights_from_disk", {}))[0] == 400
    after = json.loads((await post(srv.url, "/generate", body))[1])
    assert after["output_ids"] == before and after["meta_info"]["weight_version"] == "default"
    status, raw, _ = await post(srv.url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                                       "rank_offset": 1, "world_size": 2, "backend": "nccl"})
    assert status == 400 and "gloo" in json.loads(raw)["message"]
    status, raw, _ = await post(srv.url, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []})
    assert status == 400 and "init_weights_update_group" in json.loads(raw)["message"]


# ------------------------------------------------------------------------------------------------
# info / health / metrics


async def test_info_endpoints(srv):
    info = json.loads((await get(srv.url, "/get_model_info"))[1])
    # SGLang's fields, plus the embedded engine's LoRA state (the merged adapter, the named ones)
    assert set(info) == {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version",
                         "has_image_understanding", "has_audio_understanding", "lora_adapter", "lora_adapters"}
    assert info["lora_adapter"] is None and info["lora_adapters"] == {}
    server = json.loads((await get(srv.url, "/get_server_info"))[1])
    for key in ("incremental_streaming_output", "weight_version", "max_total_num_tokens", "version", "model_path"):
        assert key in server
    assert server["incremental_streaming_output"] is False
    assert json.loads((await get(srv.url, "/get_weight_version"))[1]) == {"weight_version": "default"}
    models = json.loads((await get(srv.url, "/v1/models"))[1])
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 1024
    loads = json.loads((await get(srv.url, "/v1/loads?include=core"))[1])
    entry = loads["loads"][0]
    for key in ("num_running_reqs", "num_waiting_reqs", "token_usage", "gen_throughput", "max_total_num_tokens"):
        assert key in entry
    for path in ("/health", "/health_generate"):
        status, raw, _ = await get(srv.url, path)
        assert status == 200 and raw == b""


async def test_flush_cache(srv):
    status, raw, ctype = await post(srv.url, "/flush_cache")
    assert status == 200 and raw.decode().startswith("Cache flushed.") and ctype.startswith("text/plain")
    async with EngineClient(srv.url) as c:
        t = asyncio.create_task(c.generate([1, 2], LONG))
        await asyncio.sleep(0.3)
        assert await c.flush_cache() is False  # 400 while requests run
        await c.abort(abort_all=True)
        await t


async def test_metrics(srv):
    from prometheus_client.parser import text_string_to_metric_families

    await post(srv.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
    status, raw, ctype = await get(srv.url, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(raw.decode())}
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput", "sglang:token_usage",
                 "sglang:prompt_tokens", "sglang:generation_tokens", "sglang:num_aborted_requests",
                 "sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds", "asyncrl_build_info"):
        assert name in fams, name
    gen = [s for s in fams["sglang:generation_tokens"].samples if s.name.endswith("_total")][0]
    assert gen.value >= 3 and gen.labels["model_name"]
    # no filesystem path in a label (the served name defaults to the model directory; docs/security.md)
    labels = [v for f in fams.values() for smp in f.samples for v in smp.labels.values()]
    assert labels and not any("/" in v for v in labels), [v for v in labels if "/" in v]
    assert "sglang:prompt_tokens_total" in raw.decode()


async def test_skip_tokenizer_init(model_dir, tmp_path):
    s = await asyncio.to_thread(start_embedded_server, model_dir, "--skip-tokenizer-init", log_path=tmp_path / "skip.log")
    try:
        status, raw, _ = await post(s.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
        out = json.loads(raw)
        assert status == 200 and "text" not in out and len(out["output_ids"]) == 3
        chunks = await sse(s.url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
        assert all("text" not in c for c in chunks)
        for body in ({"text": "hi"}, {"input_ids": [1], "sampling_params": {"stop": ["x"]}}):
            status, raw, _ = await post(s.url, "/generate", body)
            assert status == 400 and "tokenizer" in json.loads(raw)["error"]["message"]
        info = json.loads((await get(s.url, "/get_server_info"))[1])
        assert info["skip_tokenizer_init"] is True
    finally:
        s.stop()


async def test_incremental_text_is_exact_for_long_outputs(srv, srv_inc):
    """Incremental detokenization (windowed) gives the same text as decoding the whole output."""
    body = {"input_ids": [1, 30, 31], "sampling_params": {"max_new_tokens": 200, "temperature": 1.0, "sampling_seed": 5,
                                                           "ignore_eos": True}}
    h = {"Authorization": f"Bearer {KEY}"}
    inc = await sse(srv_inc.url, body, h)
    cum = await sse(srv.url, body)
    full = json.loads((await post(srv.url, "/generate", body))[1])
    assert "".join(c["text"] for c in inc) == full["text"] == cum[-1]["text"]
    for c in cum:  # every cumulative chunk's text is a prefix of the final text
        assert full["text"].startswith(c["text"])


async def test_queue_beyond_max_running_requests_and_waiting_abort(model_dir, tmp_path):
    s = await asyncio.to_thread(start_embedded_server, model_dir, "--max-running-requests", "1",
                                log_path=tmp_path / "one.log")
    try:
        async with EngineClient(s.url) as c:
            first = asyncio.create_task(c.generate([1, 2], LONG, rid="first"))
            second = asyncio.create_task(c.generate([1, 3], LONG, rid="second"))
            for _ in range(500):
                load = await c.loads()
                if load["num_running_reqs"] == 1 and load["num_waiting_reqs"] == 1:
                    break
                await asyncio.sleep(0.01)
            assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (1, 1)
            await c.abort("second")
            out2 = await asyncio.wait_for(second, 30)
            assert out2["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
            assert out2["output_ids"] == []
            await c.abort("first")
            out1 = await asyncio.wait_for(first, 30)
            assert out1["meta_info"]["finish_reason"]["message"] == "Aborted" and out1["output_ids"]
    finally:
        s.stop()
