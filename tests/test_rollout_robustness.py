"""Robustness of the embedded engine: the "probability tensor contains either inf, nan or
element < 0" failures, reproduced and guarded.

Root cause reproduced here: the engine's KV buffers are left-padded, and a row's padding
columns (and the columns exposed when longer rows join and the batch is shifted right) were
never written: they held a previous row's keys or uninitialised memory (``torch.empty``).
The attention mask hides them, but attention still does arithmetic on them (score NaN + mask
= NaN, 0 * NaN = NaN), so one NaN/inf bit pattern there turned a whole row's logits into NaN
and ``torch.multinomial`` failed the step (and with it every live request).

Fault injection (not a mock: the real engine, model, server and HTTP): :class:`PoisonEngine`
fills every buffer area the engine does not own — fresh allocations and the slots of rows
that leave the batch — with NaN, the worst case of uninitialised or stale memory. The
engine must then behave exactly as with clean memory (greedy output equal to a full
recomputation; no failed request). Also here: a row whose logits are non-finite fails alone
(500, clear message) while the others finish; weight updates with NaN/inf, unknown names,
wrong shapes, integer dtypes or inconsistent tied aliases are refused with 400 and change
nothing; a partial update (one tensor, bf16) changes only that tensor.

The tiny model (redrawn at std 0.2 for non-degenerate greedy output), fp32, in-process
servers on loopback (real aiohttp app, real HTTP).
"""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest

from asyncrl.core.net import free_port
from rollout_server.client import EngineClient, EngineError
from rollout_server.engine import Engine
from rollout_server.engine_sample import EngineGroup, EngineSample
from rollout_server.sampling import SamplingParams
from rollout_server.testing import greedy_reference, make_random_model

pytestmark = pytest.mark.integration

NAN = float("nan")


class PoisonEngine(Engine):
    """The real engine, with NaN written into every buffer cell it does not own.

    * fresh allocations: everything except the copied live region ``[:B, :, :length]``;
    * a row that leaves the batch (finished, aborted, retracted, failed): its whole slot.
    ``victims`` (rids) additionally get NaN in their *own* keys before the next decode step:
    the row's logits become NaN, which must fail that request only.
    """

    victims: set[str] = set()

    def _ensure_capacity(self, slots, cols):
        old = (self._slots, self._cols)
        B, L = len(self._rows), self._length
        keep = [(k[:B, :, :L].clone(), v[:B, :, :L].clone()) for k, v in zip(self._K, self._V)] if self._K else []
        super()._ensure_capacity(slots, cols)
        if (self._slots, self._cols) != old:
            for i, (k, v) in enumerate(zip(self._K, self._V)):
                k.fill_(NAN)
                v.fill_(NAN)
                if keep:
                    k[:B, :, :L] = keep[i][0]
                    v[:B, :, :L] = keep[i][1]

    def _maybe_compact(self):
        for i, row in enumerate(self._rows):
            if row is None:
                for k, v in zip(self._K, self._V):
                    k[i].fill_(NAN)
                    v[i].fill_(NAN)
        super()._maybe_compact()

    def _decode_step(self):
        for i, row in enumerate(self._rows):
            if row is not None and row.sample.rid in self.victims and len(row.sample.output_ids) >= 2:
                for k in self._K:
                    k[i, :, row.start : self._length] = NAN
        return super()._decode_step()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return make_random_model(tiny_model_dir, tmp_path_factory.mktemp("robust") / "m", seed=3)


@pytest.fixture(scope="module")
def model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _sample(rid, prompt, max_new, temperature=0.0):
    return EngineSample(rid, list(prompt), SamplingParams(max_new_tokens=max_new, temperature=temperature, ignore_eos=True))


def _wait(samples, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not all(s.finished for s in samples):
        assert time.monotonic() < deadline, [s.finish_reason for s in samples]
        time.sleep(0.01)


def test_masked_kv_columns_never_reach_attention(model_dir):
    """Rows join a running batch with shorter prompts (padding columns in reused/fresh slots),
    with longer prompts (the batch shifts right into fresh columns), finish, are aborted and
    compacted, all over NaN-poisoned memory: greedy output equals a full recomputation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eng = PoisonEngine(model, None, context_len=1024, max_batch_size=8, threads=1).start()
    try:
        rng = random.Random(0)
        prompts = {f"r{i}": [rng.randrange(3, 700) for _ in range(n)] for i, n in enumerate([5, 40, 3, 120, 9, 60, 2])}
        lengths = {"r0": 60, "r1": 12, "r2": 30, "r3": 8, "r4": 25, "r5": 15, "r6": 20}
        samples = {}
        for i, (rid, prompt) in enumerate(prompts.items()):
            samples[rid] = _sample(rid, prompt, lengths[rid])
            eng.submit([EngineGroup(prompt, [samples[rid]])])
            if rid == "r4":
                eng.abort("r2")  # leaves a dead slot in the middle of the batch
            time.sleep(0.02 * (i % 3))
        _wait(list(samples.values()))
        assert eng.error is None, eng.error
        for rid, s in samples.items():
            if rid == "r2" and s.finish_reason["type"] == "abort":
                want = greedy_reference(model, prompts[rid], len(s.output_ids))[0]
            else:
                assert s.finish_reason["type"] == "length", (rid, s.finish_reason)
                want = greedy_reference(model, prompts[rid], lengths[rid])[0]
            assert s.output_ids == want, rid
            assert all(math.isfinite(x) for x in s.output_logprobs)
    finally:
        eng.stop()


def test_nonfinite_row_fails_alone(model_dir):
    """A row whose logits turn NaN ends with a 500 naming the request; the rest of the batch finishes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eng = PoisonEngine(model, None, context_len=1024, max_batch_size=8, threads=1)
    eng.victims = {"victim"}
    eng.start()
    try:
        others = [_sample(f"ok{i}", [5 + i, 6, 7, 8], 20, temperature=1.0) for i in range(3)]
        victim = _sample("victim", [9, 10, 11], 20, temperature=1.0)
        eng.submit([EngineGroup(s.prompt_ids, [s]) for s in others[:2] + [victim] + others[2:]])
        _wait(others + [victim])
        assert victim.finish_reason["status_code"] == 500
        assert "non-finite logits" in victim.finish_reason["message"] and "victim" in victim.finish_reason["message"]
        assert [s.finish_reason["type"] for s in others] == ["length"] * 3
        assert eng.error is None and eng.stats["nonfinite_logits_total"] == 1
        again = _sample("after", [1, 2, 3], 5)  # the engine keeps serving
        eng.submit([EngineGroup(again.prompt_ids, [again])])
        _wait([again])
        assert again.finish_reason["type"] == "length"
    finally:
        eng.stop()


class _InProcessServer:
    """The real aiohttp app of ``rollout_server.server`` with a :class:`PoisonEngine`, on a free port."""

    def __init__(self, model_dir, limits=None):
        self.model_dir, self.limits = model_dir, limits

    async def __aenter__(self):
        from aiohttp import web

        from rollout_server.server import RolloutHTTPServer, ServerOptions

        port = free_port()
        opts = ServerOptions(str(self.model_dir), port=port, weight_version="0", max_running_requests=16,
                             engine_threads=1, incremental_streaming_output=True, limits=self.limits)
        self.server = RolloutHTTPServer(opts)
        await asyncio.get_running_loop().run_in_executor(None, self.server.load)
        self.server.engine.__class__ = PoisonEngine
        self.runner = web.AppRunner(self.server.app())
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


async def test_stress_concurrency_pauses_aborts_resumes_weight_updates(model_dir, model, tmp_path):
    """Many concurrent streamed requests (prompt lengths 1..150, T = 1 and greedy), aborts by rid,
    pauses in every mode, resumes of aborted samples from prompt + output (as the rollout worker
    does after budget parking), and weight updates from disk mid-stream (partial: one tensor,
    unchanged; and the full model), over NaN-poisoned memory, for a bounded time: no request
    fails, every logprob is finite, the weights are unchanged."""
    import torch
    from safetensors.torch import load_file, save_file

    norm_dir = tmp_path / "norm_only"
    norm_dir.mkdir()
    full = load_file(str(model_dir / "model.safetensors"))
    save_file({"model.norm.weight": full["model.norm.weight"]}, str(norm_dir / "model.safetensors"))
    rng = random.Random(1)
    failures: list[str] = []
    done = {"segments": 0, "tokens": 0, "resumes": 0, "updates": 0, "pauses": 0, "aborts": 0}
    deadline = time.monotonic() + 8.0

    async with _InProcessServer(model_dir) as srv, EngineClient(srv.url) as c:
        before = _weights(srv.server.engine.model)

        async def sample_loop(j):
            while time.monotonic() < deadline:
                prompt = [rng.randrange(3, 700) for _ in range(rng.choice([1, 4, 23, 40, 87, 150]))]
                response: list[int] = []
                params = {"max_new_tokens": rng.choice([8, 16, 64]), "temperature": rng.choice([1.0, 1.0, 0.7, 0]),
                          "ignore_eos": True}
                for seg in range(3):  # a sample in up to 3 segments (budget parking / abort, then resume)
                    try:
                        res = await c.generate_collect(prompt + response, params, rid=f"s{j}-{seg}-{rng.random():.6f}")
                    except EngineError as exc:
                        failures.append(f"{exc.status}: {exc.message}")
                        return
                    if not all(math.isfinite(x) for x in res.logprobs):
                        failures.append(f"non-finite logprob in {res.logprobs}")
                    response += res.token_ids
                    done["segments"] += 1
                    done["tokens"] += len(res.token_ids)
                    if res.finish_type != "abort" and rng.random() < 0.5:
                        break
                    done["resumes"] += 1

        async def chaos():
            while time.monotonic() < deadline:
                await asyncio.sleep(rng.uniform(0.05, 0.3))
                action = rng.choice(["pause", "pause", "abort", "update"])
                if action == "abort":
                    await c.abort(rid=f"s{rng.randrange(12)}-")
                    done["aborts"] += 1
                    continue
                mode = rng.choice(["in_place", "in_place", "abort", "retract"])
                await c.pause(mode)
                done["pauses"] += 1
                if action == "update" or rng.random() < 0.5:
                    path = norm_dir if rng.random() < 0.7 else model_dir
                    await c.update_weights_from_disk(str(path), weight_version=str(done["updates"] + 1))
                    done["updates"] += 1
                await asyncio.sleep(rng.uniform(0, 0.05))
                await c.resume()

        await asyncio.gather(chaos(), *(sample_loop(j) for j in range(12)))
        assert srv.server.engine.error is None, srv.server.engine.error
        after = _weights(srv.server.engine.model)
    assert not failures, failures[:3]
    assert done["segments"] >= 20 and done["resumes"] >= 5 and done["updates"] >= 2 and done["pauses"] >= 5, done
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)


async def test_bad_weight_updates_are_refused_atomically(model_dir, model):
    """NaN, inf, an unknown name, a wrong shape, an integer dtype, inconsistent tied aliases: 400,
    and not even the valid tensors sent with them are applied. A partial bf16 update applies."""
    import torch

    async with _InProcessServer(model_dir) as srv, EngineClient(srv.url) as c:
        eng_model = srv.server.engine.model
        before = _weights(eng_model)
        prompt = [1, 2, 3, 4]
        ref = await c.generate(prompt, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        new_norm = torch.full((64,), 0.5)
        layer_w = before["model.layers.0.mlp.up_proj.weight"]
        cases = {
            "NaN": ({"model.norm.weight": new_norm, "model.layers.0.mlp.up_proj.weight": layer_w.clone().fill_(NAN)},
                    "NaN or inf"),
            "inf": ({"model.norm.weight": new_norm, "model.layers.1.mlp.up_proj.weight": torch.full_like(layer_w, math.inf)},
                    "NaN or inf"),
            "unknown": ({"model.norm.weight": new_norm, "model.nope.weight": torch.zeros(3)}, "unknown parameter"),
            "shape": ({"model.norm.weight": new_norm, "model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, "shape mismatch"),
            "dtype": ({"model.norm.weight": new_norm.to(torch.int32)}, "floating point"),
            "tied": ({"model.embed_tokens.weight": before["model.embed_tokens.weight"],
                      "lm_head.weight": before["model.embed_tokens.weight"] + 1}, "tied"),
        }
        for name, (state, needle) in cases.items():
            with pytest.raises(EngineError) as err:
                await c.update_weights_from_tensor(state, weight_version="bad")
            assert err.value.status == 400 and needle in err.value.message, (name, err.value.message)
            now = _weights(eng_model)
            assert all(torch.equal(before[k], now[k]) for k in before), name
        out = await c.generate(prompt, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert out["output_ids"] == ref["output_ids"] and out["meta_info"]["weight_version"] == "0"
        # a partial update in another dtype changes exactly that tensor
        await c.update_weights_from_tensor({"model.norm.weight": new_norm.to(torch.bfloat16)}, weight_version="1")
        now = _weights(eng_model)
        assert torch.equal(now["model.norm.weight"], new_norm)
        assert all(torch.equal(before[k], now[k]) for k in before if k != "model.norm.weight")


async def test_invalid_distribution_fails_only_its_request(model_dir):
    """A logit bias that would overflow fp32 (1e300 is a finite JSON number) is refused with a 400
    naming it (biases lie in [-100, 100]); had it reached the engine, the NaN distribution would
    fail that request alone (the engine-level path is tests/test_rollout_validation.py's). A
    concurrent request finishes, and the server goes on. NaN/Infinity literals in sampling
    params are refused with 400."""
    import aiohttp

    async with _InProcessServer(model_dir) as srv, EngineClient(srv.url) as c:
        ok = asyncio.create_task(c.generate([4, 5, 6], {"max_new_tokens": 40, "temperature": 1.0, "ignore_eos": True}))
        await asyncio.sleep(0.05)
        with pytest.raises(EngineError) as err:
            await c.generate([7, 8, 9], {"max_new_tokens": 8, "temperature": 1.0, "logit_bias": {"5": 1e300}})
        assert err.value.status == 400 and "logit_bias['5']" in err.value.message
        eng = srv.server.engine
        victim = EngineSample("overflow", [7, 8, 9], SamplingParams(max_new_tokens=8, logit_bias={"5": 1e300}))
        eng.submit([EngineGroup(victim.prompt_ids, [victim])])  # past the HTTP schema, straight to the engine
        _wait([victim])
        assert victim.finish_reason["status_code"] == 500 and "non-finite" in victim.finish_reason["message"]
        res = await ok
        assert res["meta_info"]["finish_reason"]["type"] == "length" and len(res["output_ids"]) == 40
        assert srv.server.engine.error is None
        async with aiohttp.ClientSession() as http:
            for raw in ('{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}',
                        '{"input_ids": [1, 2], "sampling_params": {"logit_bias": {"3": -Infinity}}}'):
                async with http.post(srv.url + "/generate", data=raw, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 400 and "finite" in (await r.json())["error"]["message"], raw
        out = await c.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert len(out["output_ids"]) == 3


async def test_masked_top_logprobs_do_not_break_a_stream(model_dir):
    """``min_new_tokens`` masks the EOS token to -inf; asking for every top logprob puts that -inf
    into the response: it is sent as null (strict JSON), the stream is not cut mid-response.
    (Every top logprob needs the limit raised past its default of 20.)"""
    from rollout_server.limits import ServerLimits

    async with _InProcessServer(model_dir, ServerLimits(max_top_logprobs_num=4096)) as srv, EngineClient(srv.url) as c:
        vocab = srv.server.engine.vocab_size
        params = {"max_new_tokens": 3, "min_new_tokens": 3, "temperature": 1.0}
        chunks = [d async for d in c.generate_stream([1, 2, 3], params, top_logprobs_num=vocab)]
        assert sum(len(d.token_ids) for d in chunks) == 3 and chunks[-1].finish_reason["type"] == "length"
        out = await c.generate([1, 2, 3], params, return_logprob=True, top_logprobs_num=vocab)
        first = out["meta_info"]["output_top_logprobs"][0]
        assert len(first) == vocab and first[-1][0] is None and all(x[0] is not None for x in first[:-5])
