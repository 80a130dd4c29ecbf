"""The rollout profile (issue 28 item 4): the engine thread's seconds by component, their export,
and the shared prefill of identical prompts sent as separate requests.

Real engine (the tiny model redrawn at std 0.2, fp32, one thread), real HTTP server in-process;
no timing thresholds: only that the accounting is complete and lands in the right components.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import pytest

from asyncrl.metrics.labels import ENGINE_COMPONENTS
from rollout_server.engine import Engine
from rollout_server.engine_sample import EngineGroup, EngineSample
from rollout_server.sampling import SamplingParams
from rollout_server.testing import make_random_model, recompute_logprobs
from tests.test_sample_tokens import DEVICES  # the engine runs where its model is: CPU, and CUDA when there is one

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return make_random_model(tiny_model_dir, tmp_path_factory.mktemp("profile") / "m", seed=3)


@pytest.fixture(scope="module")
def model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _sample(rid: str, prompt: list[int], n: int) -> EngineSample:
    return EngineSample(rid, list(prompt), SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True),
                        return_logprob=True)


def _wait(samples: list[EngineSample], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(s.finished for s in samples):
        assert time.monotonic() < deadline, "the engine did not finish in time"
        time.sleep(0.01)


def test_identical_prompts_share_one_prefill_row(model):
    """Requests of the same prompt admitted together run one prefill row; their logprobs are still
    the trainer's recomputation and every sample samples on its own (the n samples differ)."""
    eng = Engine(model, None, context_len=512, max_batch_size=16, threads=1)
    p, q = [5, 17, 42, 8, 99, 3, 61], [7, 7, 13]
    samples = [_sample(f"p{i}", p, 6) for i in range(5)] + [_sample(f"q{i}", q, 6) for i in range(3)]
    eng.submit([EngineGroup(s.prompt_ids, [s]) for s in samples])  # one request per sample, as the worker sends
    eng.start()
    try:
        _wait(samples)
    finally:
        eng.stop()
    assert eng.stats["prompt_tokens_total"] == 5 * len(p) + 3 * len(q)
    assert eng.stats["prefill_forward_tokens_total"] == len(p) + len(q)  # one row per distinct prompt
    for s in samples:
        assert s.finish_reason["type"] == "length" and len(s.output_ids) == 6
        ref = recompute_logprobs(model, s.prompt_ids, s.output_ids)
        assert max(abs(a - b) for a, b in zip(s.output_logprobs, ref)) < 1e-4, s.rid
    assert len({tuple(s.output_ids) for s in samples[:5]}) > 1  # not one draw copied to every sample


def test_profile_accounts_the_engine_thread(model):
    """Every second of the engine thread lands in one component; the work lands where it belongs."""
    eng = Engine(model, None, context_len=512, max_batch_size=8, threads=1)
    t0 = time.perf_counter()
    eng.start()
    try:
        time.sleep(0.2)  # idle
        samples = [_sample(f"r{i}", [3 + i, 9, 27, 4], 12) for i in range(4)]
        eng.submit([EngineGroup(s.prompt_ids, [s]) for s in samples])
        _wait(samples)
        eng.call("pause", "in_place").result(60)
        time.sleep(0.2)  # paused
        state = {k: v.detach().clone() for k, v in model.state_dict().items() if k == "model.norm.weight"}
        eng.call("update_weights", state, "1", False).result(60)
        eng.call("resume").result(60)
    finally:
        eng.stop()
    wall = time.perf_counter() - t0
    prof = eng.profile_snapshot()
    assert tuple(prof) == ENGINE_COMPONENTS
    for component in ("prefill_forward", "decode_forward", "sampling", "decode_other", "weights", "idle", "paused"):
        assert prof[component] > 0, (component, prof)
    assert prof["idle"] >= 0.15 and prof["paused"] >= 0.15, prof
    assert sum(prof.values()) <= wall
    assert sum(prof.values()) >= 0.5 * wall, (wall, prof)  # nothing big unaccounted (the thread's start and end are not)


async def test_metrics_export_the_profile(model_dir):
    """``/metrics`` and ``/get_server_info`` of the embedded server carry the engine's seconds by component."""
    from aiohttp import ClientSession, web

    from asyncrl.core.net import free_port
    from rollout_server.client import EngineClient
    from rollout_server.server import RolloutHTTPServer, ServerOptions

    port = free_port()
    server = RolloutHTTPServer(ServerOptions(str(model_dir), port=port, weight_version="0", engine_threads=1,
                                             incremental_streaming_output=True))
    await asyncio.get_running_loop().run_in_executor(None, server.load)
    runner = web.AppRunner(server.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with EngineClient(url) as c:
            await c.generate_collect([4, 5, 6], {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True})
            await c.generate_collect([4, 5, 6], {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True})
        async with ClientSession() as http:
            async with http.get(url + "/metrics") as r:
                text = await r.text()
            async with http.get(url + "/get_server_info") as r:
                info = await r.json()
    finally:
        await runner.cleanup()
    found = dict(re.findall(r'^asyncrl_rollout_engine_seconds_total\{component="(\w+)"\} (\S+)$', text, re.M))
    assert set(found) == set(ENGINE_COMPONENTS)
    assert float(found["decode_forward"]) > 0 and float(found["prefill_forward"]) > 0
    assert set(info["engine_profile_seconds"]) == set(ENGINE_COMPONENTS)
    assert info["engine_profile_seconds"]["decode_forward"] >= float(found["decode_forward"])
    # the same prompt twice under the same weights: prefilled once, served once by the prompt cache
    assert re.search(r"^asyncrl_rollout_prefill_forward_tokens_total 3\.0$", text, re.M), text
    assert re.search(r"^asyncrl_rollout_prompt_cache_hits_total 1\.0$", text, re.M), text
    assert re.search(r"^asyncrl_rollout_context_cache_hits_total 0\.0$", text, re.M), text


def test_prompt_cache_serves_a_prompt_prefilled_before(model):
    """A prompt prefilled in an earlier iteration is not prefilled again (same logprobs as a
    recomputation); a weight update empties the cache; a cache of 0 tokens is off."""
    import torch

    eng = Engine(model, None, context_len=512, max_batch_size=8, threads=1)
    p = [11, 23, 5, 77, 2, 9]
    norm = model.state_dict()["model.norm.weight"].detach().clone()
    eng.start()
    try:
        first = _sample("a", p, 5)
        eng.submit([EngineGroup(p, [first])])
        _wait([first])
        later = [_sample("b", p, 5), _sample("c", [4, 4, 8], 5)]  # one cached prompt, one new, in one prefill
        eng.submit([EngineGroup(s.prompt_ids, [s]) for s in later])
        _wait(later)
        assert eng.stats["prompt_cache_hits_total"] == 1
        assert eng.stats["prefill_forward_tokens_total"] == len(p) + 3
        alone = [_sample("e", p, 5)]  # a prefill served by the cache alone
        eng.submit([EngineGroup(p, alone)])
        _wait(alone)
        assert eng.stats["prompt_cache_hits_total"] == 2 and eng.stats["prefill_forward_tokens_total"] == len(p) + 3
        later += alone
        for s in [first, *later]:
            ref = recompute_logprobs(model, s.prompt_ids, s.output_ids)
            assert max(abs(a - b) for a, b in zip(s.output_logprobs, ref)) < 1e-4, s.rid
        state = {"model.norm.weight": norm * 1.5}
        eng.call("update_weights", state, "1", False).result(60)
        assert len(eng.prompt_cache) == 0  # keys/values of the old weights are never served
        after = _sample("d", p, 3)
        eng.submit([EngineGroup(p, [after])])
        _wait([after])
        assert eng.stats["prompt_cache_hits_total"] == 2 and eng.stats["prefill_forward_tokens_total"] == 2 * len(p) + 3
    finally:
        eng.stop()
        with torch.no_grad():  # the module's model is shared: give the norm its values back
            model.model.norm.weight.copy_(norm)
    off = Engine(model, None, context_len=512, max_batch_size=8, threads=1, prompt_cache_tokens=0)
    assert off.prompt_cache is None


def test_prompt_cache_evicts_by_tokens_and_refuses_a_negative_size():
    from rollout_server.prompt_cache import PromptCache

    pc = PromptCache(10)
    pc.put((None, (1, 2, 3, 4)), [], "a")
    pc.put((None, (5, 6, 7, 8)), [], "b")
    assert pc.get((None, (1, 2, 3, 4)))[1] == "a"  # now the most recently used
    pc.put((None, (9, 9, 9)), [], "c")  # 11 tokens > 10: the least recently used (5, 6, 7, 8) goes
    assert pc.get((None, (5, 6, 7, 8))) is None and len(pc) == 2 and pc.tokens == 7
    pc.put((None, tuple(range(11))), [], "d")  # longer than the whole cache: not kept
    assert len(pc) == 2
    with pytest.raises(ValueError, match=">= 0 tokens"):
        PromptCache(-1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_weight_finiteness_check_finds_every_nan_and_infinity(dtype):
    """The one-pass check of a weight update (engine_weights._all_finite) agrees with isfinite."""
    import torch

    from rollout_server.engine_weights import _all_finite

    x = torch.randn(1000).to(getattr(torch, dtype))
    assert _all_finite(torch, x) and _all_finite(torch, torch.empty(0, 4, dtype=x.dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[617] = bad
        assert not _all_finite(torch, y), bad


def test_weight_finiteness_check_falls_back_where_aminmax_has_no_kernel():
    """fp8 weights have no aminmax kernel on the CPU: the check falls back to isfinite and still
    finds a NaN (float8_e5m2 has NaN and infinities)."""
    import torch

    from rollout_server.engine_weights import _all_finite

    x = torch.randn(64).to(torch.float8_e5m2)
    with pytest.raises(NotImplementedError):
        torch.aminmax(x)  # the case the fallback exists for
    assert _all_finite(torch, x)
    y = x.clone()
    y[5] = float("nan")
    assert not _all_finite(torch, y)


def _wait_tokens(s: EngineSample, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while s.published[0] < n:
        assert time.monotonic() < deadline, "the engine made no progress"
        time.sleep(0.001)


@pytest.mark.parametrize("factor", [0.0, 2000.0])
def test_scheduler_delay_gathers_arrivals_into_one_prefill(model, factor):
    """With vLLM's scheduler delay, requests arriving while rows decode wait for the oldest to have
    waited ``factor`` x the last prefill, then share one prefill; without it each arrival is
    admitted at the next iteration. An idle engine admits at once either way."""
    eng = Engine(model, None, context_len=1024, max_batch_size=8, threads=1, scheduler_delay_factor=factor)
    eng.start()
    try:
        long = _sample("long", [3, 9, 27], 600)
        eng.submit([EngineGroup(long.prompt_ids, [long])])
        _wait_tokens(long, 2)  # the idle engine admitted it at once
        late = [_sample(f"late{i}", [11 + i, 5, 6, 7], 4) for i in range(3)]
        for s in late:
            eng.submit([EngineGroup(s.prompt_ids, [s])])
            mark = long.published[0]
            _wait_tokens(long, mark + 3)  # three decode steps later
            # the delay is 2000 prefill durations, the three steps about three: still waiting
            assert (s.published[0] == 0) == (factor > 0), (s.rid, s.published)
        _wait(late)
    finally:
        eng.stop()
    assert eng.stats["prefill_batches_total"] == (2 if factor else 4)
    for s in late:
        assert s.finish_reason["type"] == "length" and len(s.output_ids) == 4
        ref = recompute_logprobs(model, s.prompt_ids, s.output_ids)
        assert max(abs(a - b) for a, b in zip(s.output_logprobs, ref)) < 1e-4, s.rid


def test_scheduler_delay_must_not_be_negative(model):
    with pytest.raises(ValueError, match="scheduler_delay_factor must be >= 0"):
        Engine(model, None, context_len=64, scheduler_delay_factor=-1.0)


def test_the_profile_bench_reads_the_prefill_counters_and_checks_its_overrides(capsys):
    """bench/rollout_profile.py: the prefill counters are read from an exposition; a ``--set``
    without ``KEY=VALUE`` is refused before anything starts."""
    from bench.rollout_profile import main, parse_metrics

    text = "\n".join([
        'asyncrl_rollout_engine_seconds_total{component="decode_forward"} 2.5',
        'sglang:prompt_tokens_total{model_name="m"} 400.0',
        "asyncrl_rollout_prefill_forward_tokens_total 120.0",
        "asyncrl_rollout_prompt_cache_hits_total 6.0",
        'asyncrl_rollout_partial_parked_total{reason="budget"} 9.0',
    ])
    m = parse_metrics(text)
    assert (m["prompt_tokens"], m["prefill_forward_tokens"], m["prompt_cache_hits"]) == (400.0, 120.0, 6.0)
    assert m["engine"] == {"decode_forward": 2.5} and m["parked"] == {"budget": 9.0}
    with pytest.raises(SystemExit) as info:
        main(["--set", "rollout.engine_scheduler_delay_factor"])
    assert info.value.code == 2 and "--set takes KEY=VALUE" in capsys.readouterr().err


def test_the_plain_loop_runs_with_either_sampler(model):
    """bench/rollout_bench.py's plain loop (the profile's bar) samples with the engine's draw or,
    as before 2026-11-29, with torch.multinomial; anything else is refused."""
    from bench.rollout_bench import ceiling

    prompts = [[3, 9, 27, 4], [5, 6, 7, 8]]
    assert ceiling(model, prompts, 5) > 0 and ceiling(model, prompts, 5, sampler="multinomial") > 0
    with pytest.raises(ValueError, match="sampler must be 'inverse_cdf' or 'multinomial'"):
        ceiling(model, prompts, 5, sampler="gumbel")


#: a prompt long enough for the context cache (>= MIN_PREFIX_TOKENS with its output)
LONG_PROMPT = [11, 23, 5, 77, 2, 9, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]


@contextlib.contextmanager
def _engine_keeping_norm(model, device: str = "cpu"):
    """A started engine on the module's shared model (on the CPU) or on a copy of it on ``device``,
    and that model's final norm weights, given back when done (tests that apply a weight update
    change them)."""
    import copy

    import torch

    if device != "cpu":
        model = copy.deepcopy(model).to(device)
    eng = Engine(model, None, context_len=512, max_batch_size=8, threads=1)
    norm = model.state_dict()["model.norm.weight"].detach().clone()
    eng.start()
    try:
        yield eng, norm
    finally:
        eng.stop()
        with torch.no_grad():
            model.model.norm.weight.copy_(norm)


@pytest.mark.parametrize("device", DEVICES)
def test_a_later_call_runs_only_its_new_tokens_from_the_context_cache(model, device):
    """An episode's second model call, whose prompt is the first call's prompt and output and an
    observation, takes the first call's keys/values from the context cache and runs only the rest
    (its logprobs are still the trainer's recomputation, on the CPU in fp32); a prompt sharing only
    a short prefix is prefilled whole; a weight update empties the cache."""
    p = LONG_PROMPT
    with _engine_keeping_norm(model, device) as (eng, norm):
        first = _sample("call1", p, 12)
        eng.submit([EngineGroup(p, [first])])
        _wait([first])
        assert len(eng.context_cache) == 1
        base = eng.stats["prefill_forward_tokens_total"]
        obs = [7, 8, 9, 10, 12]
        ctx = p + first.output_ids + obs
        second = [_sample("call2a", ctx, 6), _sample("call2b", ctx, 6)]  # two samples of the next call
        eng.submit([EngineGroup(ctx, second)])
        _wait(second)
        assert eng.stats["context_cache_hits_total"] == 1
        # the first call's keys/values cover all but its last output token: that token and the observation run
        assert eng.stats["prefill_forward_tokens_total"] - base == 1 + len(obs)
        for s in [first, *second]:
            ref = recompute_logprobs(model, s.prompt_ids, s.output_ids)
            assert max(abs(a - b) for a, b in zip(s.output_logprobs, ref)) < 1e-4, s.rid
        # a prompt that shares only its first 4 tokens with a kept context: prefilled whole
        other = _sample("other", p[:4] + [90 + i for i in range(20)], 3)
        base = eng.stats["prefill_forward_tokens_total"]
        eng.submit([EngineGroup(other.prompt_ids, [other])])
        _wait([other])
        assert eng.stats["context_cache_hits_total"] == 1
        assert eng.stats["prefill_forward_tokens_total"] - base == len(other.prompt_ids)
        eng.call("update_weights", {"model.norm.weight": norm * 1.5}, "1", False).result(60)
        assert len(eng.context_cache) == 0 and len(eng.prompt_cache) == 0
        third = _sample("call3", second[0].prompt_ids + second[0].output_ids + obs, 3)
        eng.submit([EngineGroup(third.prompt_ids, [third])])
        _wait([third])
        assert eng.stats["context_cache_hits_total"] == 1  # the old weights' keys/values are never served
    off = Engine(model, None, context_len=512, max_batch_size=8, threads=1, context_cache_tokens=0)
    assert off.context_cache is None


def test_a_context_cache_failure_never_fails_the_request(model, caplog):
    """Keeping a finished row's keys/values is an optimisation: if it raises (say no memory for the
    copy), the sample still finishes with all its tokens, and the cache keeps nothing."""
    with _engine_keeping_norm(model) as (eng, _norm):
        def broken(_s, _slot):
            raise MemoryError("no memory for the copy")

        eng._remember_context = broken
        s = _sample("kept-going", LONG_PROMPT, 6)
        with caplog.at_level("WARNING", logger="rollout_server.engine"):
            eng.submit([EngineGroup(s.prompt_ids, [s])])
            _wait([s])
        assert len(s.output_ids) == 6 and s.finish_reason["type"] == "length"
        assert len(eng.context_cache) == 0
        assert "could not keep request kept-going in the context cache" in caplog.text


def test_the_context_cache_matches_a_long_shared_prefix_only():
    from rollout_server.prompt_cache import MIN_PREFIX_SHARE, MIN_PREFIX_TOKENS, PromptCache

    cache = PromptCache(1000)
    key = tuple(range(40))
    cache.put((None, key), ["kv"], None)
    assert cache.longest_prefix(None, list(range(40)) + [99]) == (40, (["kv"], None))
    assert cache.longest_prefix(None, list(range(40))) == (39, (["kv"], None))  # one token left to run
    short = int(MIN_PREFIX_SHARE * 40) - 1
    assert cache.longest_prefix(None, list(range(short)) + [99] * 10) is None  # under 3/4 of the entry
    assert cache.longest_prefix("an adapter", list(range(41))) is None  # another adapter's keys/values
    cache.put((None, tuple(range(MIN_PREFIX_TOKENS - 1))), ["kv2"], None)
    assert cache.longest_prefix(None, list(range(MIN_PREFIX_TOKENS - 1)) + [7]) is None  # too short to count


def test_a_row_that_ran_across_an_unnamed_weight_update_is_not_kept(model):
    """An in-place update without a version name leaves the version string as it was; the row
    decoding across it holds keys/values of both weights and is not kept for a later call."""
    with _engine_keeping_norm(model) as (eng, norm):
        s = _sample("across", LONG_PROMPT, 300)
        eng.submit([EngineGroup(s.prompt_ids, [s])])
        _wait_tokens(s, 2)
        eng.call("pause", "in_place").result(60)
        eng.call("update_weights", {"model.norm.weight": norm * 1.5}, None, False).result(60)
        eng.call("resume").result(60)
        _wait([s])
        assert s.finish_reason["type"] == "length" and eng.weights_epoch == 1
        assert len(eng.context_cache) == 0
