"""Property-based fuzzing of every HTTP endpoint of the embedded server (issue #18 proof test).

Hypothesis generates bodies for every endpoint — valid, nearly valid (one value replaced by a
hostile one) and hostile (wrong types, huge and negative numbers, ``NaN``/``Infinity``
literals, deep nesting, oversized strings, unknown keys, raw non-JSON bytes) — with and without
the API key. Properties (the answers' checked for every example; the monitors' once, after the
run, so that a monitor's finding is reported as itself, not as a failure of whichever example
was running):

* no 5xx answer (a 503 "queue full" would be one: the queue is large enough here);
* no request affects another in flight: a greedy canary generation runs over and over alongside
  and always returns the tokens it returns alone;
* ``/health`` keeps answering throughout: every answer within :data:`HEALTH_BOUND_S` (a wedged
  event loop, e.g. a request's serialising holding the GIL for seconds, would exceed it; the bound
  is a liveness check, not a speed target, and is loose because CI's 2 cores also run the fuzz
  client, the canary and the engine);
* memory stays bounded: the server's RSS grows by less than 150 MB over the run (the tiny model's
  server idles near 400 MB; a 10 MB ``text`` used to add 1.2 GB, and the largest body here is
  refused at 256 KiB, so any body that were held or copied without bound would show).

Requests that would legitimately change what the canary gets (pausing, aborting all, loading
weights, relabelling the version) are sent with the key only as invalid bodies (an unknown key
makes them a 400), and as anything at all without the key (401). The tiny random model, a
real server process, real HTTP; 120 examples, about 20 s on 2 busy cores.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import aiohttp
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_server.testing import make_random_model, start_embedded_server

pytestmark = pytest.mark.integration

KEY = "fuzz-key"
#: /health must answer within this many seconds throughout the fuzz (see the module docstring).
HEALTH_BOUND_S = 5.0
AUTH = {"Authorization": f"Bearer {KEY}"}
CANARY_PROMPT = [1, 3, 3]
CANARY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
BODY_LIMIT = 256 << 10

POST_SAFE = ["/generate"]  # valid bodies are welcome
POST_GUARDED = ["/abort_request", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
                "/update_weights_from_tensor", "/init_weights_update_group", "/update_weights_from_distributed",
                "/destroy_weights_update_group", "/update_weight_version", "/load_lora_adapter", "/unload_lora_adapter"]
GET = ["/get_model_info", "/model_info", "/get_server_info", "/server_info", "/get_weight_version", "/health",
       "/health_generate", "/v1/loads", "/get_load", "/v1/models", "/metrics", "/flush_cache"]


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    model = make_random_model(tiny_model_dir, tmp_path_factory.mktemp("fz") / "varied", seed=1)
    s = start_embedded_server(model, "--max-request-bytes", str(BODY_LIMIT), "--weight-group-timeout-seconds", "1",
                              api_key=KEY, log_path=tmp_path_factory.mktemp("log") / "fuzz.log")
    yield s
    s.stop()


# ------------------------------------------------------------------------------------------------
# strategies

hostile_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([10**400, -(10**400), 2**63, -1, 0]),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from(["x" * 300_000, "\ud800", "NaN", "", "0"]),
)
hostile_json = st.recursive(hostile_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                            max_leaves=12)
# bytes json.dumps cannot make: NaN/Infinity literals, deep nesting, non-JSON, huge integers
raw_hostile = st.sampled_from([
    b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}',
    b'{"input_ids": [1, 2], "sampling_params": {"top_p": Infinity}}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b"not json", b"", b"\xff\xfe", b"null", b"[]", b"1e999",
    b'{"input_ids": [' + b"9" * 5000 + b"]}",
    b'{"text": "' + b"y" * (BODY_LIMIT + 10) + b'"}',
])

sampling = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.integers(0, 6), "temperature": st.sampled_from([0, 0.5, 1.0]), "top_k": st.sampled_from([-1, 5]),
    "top_p": st.sampled_from([0.5, 1.0]), "n": st.integers(1, 2), "stop": st.just(["a"]), "ignore_eos": st.booleans(),
    "sampling_seed": st.integers(0, 2**63 - 1), "logit_bias": st.just({"5": -100}),
})
valid_generate = st.fixed_dictionaries(
    {"input_ids": st.lists(st.integers(0, 749), min_size=1, max_size=20) | st.lists(st.lists(st.integers(0, 749), min_size=1, max_size=8), min_size=1, max_size=3)},
    optional={"sampling_params": sampling, "stream": st.booleans(), "return_logprob": st.booleans(),
              "top_logprobs_num": st.integers(0, 3), "logprob_start_len": st.integers(-1, 2),
              "rid": st.text("xyz", min_size=1, max_size=8)},
).filter(lambda b: not (isinstance(b["input_ids"][0], list) and "rid" in b))  # a batch needs a list of rids
valid_generate_text = st.fixed_dictionaries({"text": st.text(min_size=1, max_size=50)}, optional={"sampling_params": sampling})


@st.composite
def nearly_valid(draw, base):
    body = dict(draw(base))
    key = draw(st.sampled_from(sorted(body) + ["sampling_params", "unknown_key"]))
    body[key] = draw(hostile_json)
    return body


def _guarded_body(draw) -> dict:
    """A body for an endpoint that changes state: always invalid (an unknown key)."""
    body = draw(st.dictionaries(st.sampled_from(["rid", "abort_all", "mode", "model_path", "new_version", "group_name",
                                                 "names", "world_size", "master_port", "serialized_named_tensors",
                                                 "lora_name", "lora_path"]),
                                hostile_json, max_size=4))
    body["zz_unknown"] = draw(hostile_json)
    return body


@st.composite
def request_case(draw):
    """(method, path, body bytes, with_key, expected status or None)."""
    with_key = draw(st.booleans()) if draw(st.integers(0, 9)) == 0 else True
    kind = draw(st.sampled_from(["valid", "text", "nearly", "hostile", "raw", "guarded", "get"]))
    if kind == "get":
        path = draw(st.sampled_from(GET))
        return "GET", path, b"", with_key, None
    if kind == "guarded" or (kind == "hostile" and draw(st.booleans())):
        path = draw(st.sampled_from(POST_GUARDED))
        return "POST", path, json.dumps(_guarded_body(draw)).encode(), with_key, None
    if kind == "raw":
        path, data = draw(st.sampled_from(POST_SAFE + POST_GUARDED)), draw(raw_hostile)
        if path in POST_GUARDED and not data.strip() and with_key:
            data = b"{,}"  # an empty body is a valid pause (mode abort) or continue: it would stop the canary
        return "POST", path, data, with_key, None
    body = {"valid": valid_generate, "text": valid_generate_text, "nearly": nearly_valid(valid_generate),
            "hostile": hostile_json}[kind]
    data = json.dumps(draw(body)).encode()
    return "POST", "/generate", data, with_key, (200 if kind in ("valid", "text") and with_key else None)


# ------------------------------------------------------------------------------------------------
# the monitors running alongside: canary, /health, RSS


class Monitors:
    def __init__(self, url: str, pid: int, reference: list[int]):
        self.url, self.reference = url, reference
        self.proc = psutil.Process(pid)
        self.problems: list[str] = []
        self.canaries = 0
        self.max_health = 0.0
        self.max_rss = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> "Monitors":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    async def _main(self) -> None:
        await asyncio.gather(self._canary_loop(), self._health_loop())

    async def _canary_loop(self) -> None:
        async with aiohttp.ClientSession(headers=AUTH) as http:
            while not self._stop.is_set():
                ids = await _stream_tokens(http, self.url, CANARY_PROMPT, CANARY, f"canary-{uuid.uuid4().hex}")
                if ids != self.reference:
                    self.problems.append(f"canary got {ids}, alone {self.reference}")
                self.canaries += 1

    async def _health_loop(self) -> None:
        async with aiohttp.ClientSession() as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                async with http.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
                    if r.status != 200:
                        self.problems.append(f"/health answered {r.status}")
                took = time.monotonic() - t0
                self.max_health = max(self.max_health, took)
                if took > HEALTH_BOUND_S:
                    self.problems.append(f"/health took {took:.2f} s")
                self.max_rss = max(self.max_rss, self.proc.memory_info().rss)
                await asyncio.sleep(0.1)


async def _stream_tokens(http: aiohttp.ClientSession, url: str, prompt: list[int], params: dict, rid: str) -> list[int]:
    ids: list[int] = []
    body = {"input_ids": prompt, "sampling_params": params, "stream": True, "rid": rid}
    async with http.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                ids = json.loads(line[6:])["output_ids"]  # cumulative chunks
    return ids


def test_fuzz_every_endpoint(srv):
    async def alone() -> list[int]:
        async with aiohttp.ClientSession(headers=AUTH) as http:
            return await _stream_tokens(http, srv.url, CANARY_PROMPT, CANARY, "canary-alone")

    reference = asyncio.run(alone())
    assert len(reference) == CANARY["max_new_tokens"]
    mon = Monitors(srv.url, srv.process.pid, reference).start()
    baseline = mon.max_rss
    loop = asyncio.new_event_loop()
    http = loop.run_until_complete(_session())
    seen: list[tuple[str, int]] = []

    @settings(max_examples=120, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=request_case())
    def check(case):
        method, path, data, with_key, expected = case
        status, text = loop.run_until_complete(_send(http, srv.url, method, path, data, with_key))
        seen.append((path, status))
        assert status < 500, (method, path, data[:300], status, text[:500])
        if expected is not None:
            assert status == expected, (path, data[:300], status, text[:500])
        if not with_key and path not in ("/health", "/health_generate", "/metrics"):
            assert status == 401, (path, status)

    try:
        check()
    finally:
        loop.run_until_complete(http.close())
        loop.close()
        mon.stop()
    assert not mon.problems, mon.problems
    assert mon.canaries >= 1
    assert mon.max_rss - baseline < 150 * 2**20, (baseline, mon.max_rss)
    assert mon.max_health < HEALTH_BOUND_S
    assert {p for p, _ in seen} >= {"/generate"}  # sanity: the fuzz reached the server


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))


async def _send(http: aiohttp.ClientSession, url: str, method: str, path: str, data: bytes,
                with_key: bool) -> tuple[int, str]:
    headers = dict(AUTH) if with_key else {}
    headers["Content-Type"] = "application/json"
    async with http.request(method, url + path, data=data or None, headers=headers) as r:
        return r.status, (await r.read()).decode("utf-8", "replace")
