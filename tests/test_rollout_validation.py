"""One request never hurts another; every bad body is a 400 naming the field (issue #18 items 1 and 4).

* Sampling parameters are validated to the range their consumer accepts (a ``sampling_seed`` of
  2**64 used to pass validation and raise inside the engine step, whose catch-all then failed
  every live request): a canary greedy generation running alongside the bad requests returns
  exactly the tokens it returns alone, and each bad request gets its own 400 naming the field.
* Whatever still slips through (a caller of the engine's API bypasses the HTTP schema) fails
  that request alone with a 500 naming it; the engine goes on and the canary is untouched.
* Every endpoint validates its body with one schema (rollout_server/schemas.py): deep JSON
  nesting, integers beyond the digit limit, an unhashable ``group_name``, ``names: [["x"]]``,
  ``weight_version: true``, ``abort_all_requests: "no"`` were 500s or silently misread; now
  each is a 400 that names the field and changes nothing.

Real server processes (``python -m rollout_server.server``) on loopback and real HTTP, as in
tests/test_rollout_api.py; the engine-level test drives a real :class:`Engine` in-process. The
tiny model with redrawn weights (``make_random_model``), fp32.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from rollout_server.client import EngineClient
from rollout_server.engine import Engine
from rollout_server.engine_sample import EngineGroup, EngineSample
from rollout_server.sampling import SamplingParams
from rollout_server.testing import greedy_reference, make_random_model, start_embedded_server

pytestmark = pytest.mark.integration

CANARY_PROMPT = [1, 3, 3]
CANARY = {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True}
BIG = 10**400  # a finite JSON integer that no float conversion survives


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return make_random_model(tiny_model_dir, tmp_path_factory.mktemp("rv") / "varied", seed=1)


@pytest.fixture(scope="module")
def srv(model_dir, tmp_path_factory):
    s = start_embedded_server(model_dir, log_path=tmp_path_factory.mktemp("log") / "validation.log")
    yield s
    s.stop()


async def post_raw(url: str, path: str, data: bytes | str, timeout: float = 60.0) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, data=data, headers={"Content-Type": "application/json"},
                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            raw = await r.read()
            return r.status, (json.loads(raw) if raw.strip() else {})


def _message(body: dict) -> str:
    if "error" in body:
        return body["error"]["message"]
    return body.get("message") or body.get("error_message") or ""  # error_message: SGLang's LoRAUpdateOutput


async def _canary(url: str, started: asyncio.Event) -> list[int]:
    """The canary's greedy tokens, streamed; ``started`` is set once its first tokens arrived."""
    ids: list[int] = []
    async with EngineClient(url) as c:
        async for d in c.generate_stream(CANARY_PROMPT, CANARY, rid=f"canary-{time.monotonic_ns()}"):
            ids += d.token_ids
            if d.finish_reason is not None:
                assert d.finish_reason["type"] == "length", d.finish_reason
            if len(ids) >= 3:
                started.set()
    return ids


async def _alongside_canary(url: str, bad):
    """Run ``bad()`` while the canary generates; returns (canary tokens, bad()'s result)."""
    started = asyncio.Event()
    task = asyncio.create_task(_canary(url, started))
    await asyncio.wait_for(started.wait(), 60)
    try:
        result = await bad()
    finally:
        ids = await asyncio.wait_for(task, 120)
    return ids, result


# ------------------------------------------------------------------------------------------------
# item 1: sampling parameters bounded to what their consumer accepts


def _gen(sp: dict | str, **top) -> str:
    """A /generate body as raw JSON (``sp`` may be raw JSON text, for integers json.dumps would refuse)."""
    sp_json = sp if isinstance(sp, str) else json.dumps(sp)
    extra = "".join(f', "{k}": {v if isinstance(v, str) and v[:1] in "[{0123456789-" else json.dumps(v)}'
                    for k, v in top.items())
    return f'{{"input_ids": [4, 5, 6], "sampling_params": {sp_json}{extra}}}'


BAD_SAMPLING = [
    (_gen({"sampling_seed": 2**64}), "sampling_params.sampling_seed"),
    (_gen({"sampling_seed": -1}), "sampling_params.sampling_seed"),
    (_gen({"sampling_seed": 1.5}), "sampling_params.sampling_seed"),
    (_gen({"logit_bias": {"5": 1e300}}), "sampling_params.logit_bias['5']"),
    (_gen({"logit_bias": {"5": -101}}), "sampling_params.logit_bias['5']"),
    (_gen({"logit_bias": {"999999": 1.0}}), "sampling_params.logit_bias"),
    (_gen({"logit_bias": {"five": 1.0}}), "sampling_params.logit_bias"),
    (_gen('{"logit_bias": {"5": %d}}' % BIG), "sampling_params.logit_bias['5']"),
    (_gen('{"max_new_tokens": %d}' % BIG), "sampling_params.max_new_tokens"),
    (_gen('{"temperature": %d}' % BIG), "sampling_params.temperature"),
    (_gen('{"temperature": 1e400}'), "sampling_params.temperature"),
    (_gen('{"top_p": %d}' % BIG), "sampling_params.top_p"),
    (_gen('{"n": %d}' % BIG), "sampling_params.n"),
    (_gen('{"top_k": %d}' % BIG), "sampling_params.top_k"),
    (_gen('{"min_new_tokens": %d}' % BIG), "sampling_params.min_new_tokens"),
    (_gen('{"stream_interval": %d}' % BIG), "sampling_params.stream_interval"),
    (_gen('{"stop_token_ids": [%d]}' % BIG), "sampling_params.stop_token_ids"),
    (_gen({"stop_token_ids": [-1]}), "sampling_params.stop_token_ids"),
    (_gen({"stop": ["x" * 5000]}), "sampling_params.stop[0]"),
    (_gen({"stop": ["x"] * 65}), "sampling_params.stop"),
    (_gen({"ignore_eos": "no"}), "sampling_params.ignore_eos"),
    (_gen({"max_new_tokens": 8.0}), "sampling_params.max_new_tokens"),
    (_gen({"custom_params": [1]}), "sampling_params.custom_params"),
    (_gen([{}, {"sampling_seed": 2**64}]).replace('"input_ids": [4, 5, 6]', '"input_ids": [[4], [5]]'),
     "sampling_params[1].sampling_seed"),
    (_gen({}, logprob_start_len=str(BIG)), "logprob_start_len"),
    (_gen({}, top_logprobs_num=str(BIG)), "top_logprobs_num"),
    (_gen({}, return_logprob="yes"), "return_logprob"),
    (_gen({}, rid="x" * 5000), "rid"),
    ('{"input_ids": [%d]}' % BIG, "input_ids"),
    ('{"input_ids": [1, 2.0]}', "input_ids[1]"),
]


@pytest.mark.parametrize("raw,field", BAD_SAMPLING, ids=[f for _, f in BAD_SAMPLING])
async def test_out_of_range_parameters_are_a_400_naming_the_field(srv, raw, field):
    status, body = await post_raw(srv.url, "/generate", raw)
    assert status == 400, (status, body)
    assert set(body) == {"error"} and _message(body).startswith(field), _message(body)


async def test_bad_requests_never_fail_a_running_canary(srv):
    """Every bad request above, sent while a greedy canary runs: each gets its own 400, the
    canary's tokens equal those of the canary run alone. (Before: the seed 2**64 passed
    validation, raised in the engine step, and the step's catch-all failed the canary too.)"""
    alone = await _canary(srv.url, asyncio.Event())
    assert len(alone) == CANARY["max_new_tokens"]

    async def bad():
        statuses = []
        for raw, _ in BAD_SAMPLING:
            statuses.append((await post_raw(srv.url, "/generate", raw))[0])
        return statuses

    ids, statuses = await _alongside_canary(srv.url, bad)
    assert statuses == [400] * len(BAD_SAMPLING)
    assert ids == alone
    async with EngineClient(srv.url) as c:  # the server goes on serving
        out = await c.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 2**63 - 1})
        assert len(out["output_ids"]) == 4


# ------------------------------------------------------------------------------------------------
# item 1: an error that slips past validation fails that request alone


@pytest.fixture(scope="module")
def engine_parts(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.models import load_tokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, load_tokenizer(model_dir)


def _raw_params(**kw) -> SamplingParams:
    """Parameters as a direct engine caller builds them: no validation (that is the HTTP layer's)."""
    return SamplingParams(**{"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, **kw})


def _wait(samples, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not all(s.finished for s in samples):
        assert time.monotonic() < deadline, [s.finish_reason for s in samples]
        time.sleep(0.01)


def test_per_request_engine_errors_fail_only_that_request(engine_parts):
    """Requests whose own data makes the engine raise — a seed the generator refuses (at prefill,
    in the canary's prefill batch and later), a logit-bias token outside the vocabulary (in
    sampling), a stop token outside it (min_new_tokens masking), a prompt token outside it (the
    batched prefill's forward pass), a stop "string" that is not one (stop matching) — each fail
    alone with a 500 naming them; the canary's greedy tokens equal a full recomputation."""
    model, tokenizer = engine_parts
    vocab = int(model.get_output_embeddings().weight.shape[0])
    n = 120
    want = greedy_reference(model, CANARY_PROMPT, n)[0]
    eng = Engine(model, tokenizer, context_len=1024, max_batch_size=16, threads=1).start()
    try:
        canary = EngineSample("canary", list(CANARY_PROMPT), _raw_params(max_new_tokens=n, temperature=0.0))
        first = {
            "seed-together": EngineSample("seed-together", [7, 8], _raw_params(sampling_seed=2**64)),
            "token-together": EngineSample("token-together", [7, vocab + 3], _raw_params()),
        }
        ok_together = EngineSample("ok-together", [9, 10, 11], _raw_params(max_new_tokens=20))
        eng.submit([EngineGroup(s.prompt_ids, [s]) for s in [canary, *first.values(), ok_together]])
        while len(canary.output_ids) < 5:
            assert not canary.finished, canary.finish_reason
            time.sleep(0.005)
        later = {
            "seed-later": EngineSample("seed-later", [7, 8], _raw_params(sampling_seed=-(2**70))),
            "bias-later": EngineSample("bias-later", [7, 8], _raw_params(logit_bias={str(vocab + 5): 1.0})),
            "stopid-later": EngineSample("stopid-later", [7, 8], _raw_params(min_new_tokens=3, stop_token_ids=[vocab + 9])),
            "stopstr-later": EngineSample("stopstr-later", [7, 8], _raw_params(stop=[None])),
        }
        ok_later = EngineSample("ok-later", [12, 13], _raw_params(max_new_tokens=20, sampling_seed=5))
        eng.submit([EngineGroup(s.prompt_ids, [s]) for s in [*later.values(), ok_later]])
        bad = {**first, **later}
        _wait([canary, ok_together, ok_later, *bad.values()])
        assert canary.finish_reason["type"] == "length" and canary.output_ids == want
        assert ok_together.finish_reason["type"] == "length" and len(ok_together.output_ids) == 20
        assert ok_later.finish_reason["type"] == "length" and len(ok_later.output_ids) == 20
        for rid, s in bad.items():
            r = s.finish_reason
            assert r["type"] == "abort" and r["status_code"] == 500, (rid, r)
            assert f"request {rid} " in r["message"] and "only this request failed" in r["message"], r["message"]
        assert eng.error is None and eng.alive
        assert eng.stats["request_errors_total"] == len(bad)
        again = EngineSample("again", [1, 2, 3], _raw_params(max_new_tokens=5, temperature=0.0))
        eng.submit([EngineGroup(again.prompt_ids, [again])])
        _wait([again])
        assert again.output_ids == greedy_reference(model, [1, 2, 3], 5)[0]
    finally:
        eng.stop()


def test_a_failed_batched_prefill_keeps_the_others_seeded_samples_reproducible(engine_parts):
    """When a batched prefill raises (a prompt token outside the vocabulary) it is redone prompt
    by prompt: the bad prompt fails alone, and a seeded sample of the same batch gets the very
    tokens it gets in a batch of its own."""
    model, tokenizer = engine_parts
    vocab = int(model.get_output_embeddings().weight.shape[0])
    eng = Engine(model, tokenizer, context_len=1024, max_batch_size=8, threads=1).start()
    try:
        alone = EngineSample("alone", [5, 6, 7], _raw_params(max_new_tokens=12, sampling_seed=42))
        eng.submit([EngineGroup(alone.prompt_ids, [alone])])
        _wait([alone])
        seeded = EngineSample("seeded", [5, 6, 7], _raw_params(max_new_tokens=12, sampling_seed=42))
        broken = EngineSample("broken", [5, vocab + 1], _raw_params())
        eng.submit([EngineGroup(s.prompt_ids, [s]) for s in (seeded, broken)])
        _wait([seeded, broken])
        assert broken.finish_reason["status_code"] == 500 and "prefill" in broken.finish_reason["message"]
        assert seeded.output_ids == alone.output_ids
    finally:
        eng.stop()


# ------------------------------------------------------------------------------------------------
# item 4: one strict schema per endpoint; 400s where 500s (or silent misreadings) were


DEEP = "[" * 100_000 + "]" * 100_000
HUGE_DIGITS = "9" * 5000  # beyond Python's int digit limit

BAD_BODIES = [
    ("/generate", '{"input_ids": %s}' % DEEP, "nested too deeply"),
    ("/generate", '{"input_ids": [%s]}' % HUGE_DIGITS, "not valid JSON"),
    ("/generate", '{"input_ids": [1], "sampling_params": {"custom_params": {"a": %s}}}' % DEEP, "nested too deeply"),
    ("/generate", "[1, 2]", "must be a JSON object"),
    ("/abort_request", '{"rid": ["x"]}', "rid"),
    ("/abort_request", '{"abort_all": "no"}', "abort_all"),
    ("/abort_request", DEEP, "nested too deeply"),
    ("/pause_generation", '{"mode": ["abort"]}', "mode"),
    ("/pause_generation", '{"mode": "abort", "extra": 1}', "unknown field"),
    ("/continue_generation", '{"x": 1}', "unknown field"),
    ("/continue_generation", "[1]", "must be a JSON object"),
    ("/update_weights_from_disk", '{"model_path": "/nope", "weight_version": true}', "weight_version"),
    ("/update_weights_from_disk", '{"model_path": "/nope", "abort_all_requests": "no"}', "abort_all_requests"),
    ("/update_weights_from_disk", '{"model_path": 5}', "model_path"),
    ("/update_weights_from_disk", '{"model_path": "/nope", "weight_version": %d}' % BIG, "weight_version"),
    ("/update_weights_from_disk", '{"weight_version": "1"}', "missing required field 'model_path'"),
    ("/update_weights_from_tensor", '{"serialized_named_tensors": [1]}', "serialized_named_tensors[0]"),
    ("/update_weights_from_tensor", '{"serialized_named_tensors": ["x"], "abort_all_requests": "no"}', "abort_all_requests"),
    ("/init_weights_update_group", '{"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, '
                                   '"world_size": 2, "backend": "gloo", "group_name": ["x"]}', "group_name"),
    ("/init_weights_update_group", '{"master_address": "127.0.0.1", "master_port": %d, "rank_offset": 1, '
                                   '"world_size": 2, "backend": "gloo"}' % BIG, "master_port"),
    ("/init_weights_update_group", '{"master_address": "127.0.0.1", "master_port": "1", "rank_offset": 1, '
                                   '"world_size": 2, "backend": "gloo"}', "master_port"),
    ("/update_weights_from_distributed", '{"names": [["x"]], "dtypes": ["float32"], "shapes": [[1]]}', "names[0]"),
    ("/update_weights_from_distributed", '{"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": {"a": 1}}',
     "group_name"),
    ("/update_weights_from_distributed", '{"names": ["x"], "dtypes": ["float32"], "shapes": [[-1]]}', "shapes[0][0]"),
    ("/destroy_weights_update_group", '{"group_name": ["x"]}', "group_name"),
    ("/update_weight_version", '{"new_version": true}', "new_version"),
    ("/update_weight_version", '{"new_version": "v9", "abort_all_requests": "no"}', "abort_all_requests"),
    ("/load_lora_adapter", '{"lora_name": ["a"], "lora_path": "/nope"}', "lora_name"),
    ("/load_lora_adapter", '{"lora_name": "a", "lora_path": "%s"}' % ("x" * 5000), "lora_path"),
    ("/load_lora_adapter", '{"lora_name": "a", "lora_path": "/nope", "pinned": "yes"}', "pinned"),
    ("/unload_lora_adapter", '{"lora_name": ""}', "lora_name"),
    ("/generate", '{"input_ids": [1, 2], "lora_path": {"a": 1}}', "lora_path"),
    ("/generate", '{"input_ids": [1, 2], "lora_path": "not-loaded"}', "not loaded"),
]


@pytest.mark.parametrize("path,raw,needle", BAD_BODIES, ids=[f"{p}-{n}" for p, _, n in BAD_BODIES])
async def test_bad_bodies_are_a_400_naming_the_field(srv, path, raw, needle):
    status, body = await post_raw(srv.url, path, raw, timeout=30)
    assert status == 400, (status, body)
    assert needle in _message(body), _message(body)
    if path != "/generate" and "error" not in body:
        assert body["success"] is False


async def test_bad_control_bodies_change_nothing_and_spare_the_canary(srv, model_dir):
    """``weight_version: true`` is not stored as "True" (not even with a loadable model path),
    ``abort_all_requests: "no"`` aborts nothing, an unhashable group name is no 500, unknown
    keys do not pause or resume anything; a canary running meanwhile is untouched."""
    alone = await _canary(srv.url, asyncio.Event())
    loadable = json.dumps({"model_path": str(model_dir), "weight_version": True})

    async def bad():
        statuses = [(await post_raw(srv.url, path, raw, timeout=30))[0] for path, raw, _ in BAD_BODIES]
        status, body = await post_raw(srv.url, "/update_weights_from_disk", loadable)
        assert status == 400 and "weight_version" in body["message"], body
        return statuses

    ids, statuses = await _alongside_canary(srv.url, bad)
    assert statuses == [400] * len(BAD_BODIES)
    assert ids == alone
    async with EngineClient(srv.url) as c:
        assert await c.weight_version() == "default"
