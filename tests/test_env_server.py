"""The environment-server role (issue 28 item 2): latency sampler, schemas, deadline, client, role.

Units first (the latency model against its own quantiles and the published measurements it is
fitted to; the schemas' bounds; ``EpisodeModel.tool`` with remote tools). Then a real
``EnvServer`` on a loopback port (aiohttp, real sockets) for the deadline, queueing, refusals,
health, metrics and drain, and the client's outage handling against a port nobody listens on.
Then real processes: ``asyncrl env-server`` with SIGTERM, and episodes of the built-in
``calculator`` workflow run by the real rollout worker against a real embedded engine (tiny
random model), a real redis-server and a real environment-server process. The ``kill -9`` test
of the role is tests/test_env_server_kill.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web
from pydantic import SecretStr, ValidationError

from asyncrl.core.config import ConfigError, load_config
from asyncrl.core.net import free_port
from asyncrl.env_server import MEASURED, EnvServerClient, EnvServerUnavailable, LatencyModel, ToolCallError, fit_lognormal
from asyncrl.env_server.schemas import ToolResponse, calculate_request_model
from asyncrl.env_server.server import EnvServer, EnvServerOptions

REPO = Path(__file__).resolve().parent.parent
KEY = "env-test-key-0123456789"


# ------------------------------------------------------------------------------------------------
# the latency model


def test_latency_draws_are_a_function_of_seed_and_call_id():
    m = LatencyModel("lognormal", 1.737, 0.233, seed=7)
    assert m.sample("g0/1:0:2") == m.sample("g0/1:0:2")  # a replayed call waits as long
    assert m.sample("g0/1:0:2") != m.sample("g0/1:0:3")
    assert LatencyModel("lognormal", 1.737, 0.233, seed=8).sample("g0/1:0:2") != m.sample("g0/1:0:2")


def test_lognormal_draws_follow_the_configured_median_and_spread():
    m = LatencyModel("lognormal", 1.737, 0.233, seed=0)
    xs = sorted(m.sample(f"c{i}") for i in range(20000))
    assert xs[10000] == pytest.approx(m.quantile(0.5), rel=0.02)
    assert xs[19000] == pytest.approx(m.quantile(0.95), rel=0.03)
    assert sum(xs) / len(xs) == pytest.approx(m.mean(), rel=0.02)
    median, sigma = fit_lognormal(xs)
    assert median == pytest.approx(1.737, rel=0.01) and sigma == pytest.approx(0.233, rel=0.03)
    assert "lognormal median 1.737 s" in m.describe()


def test_constant_none_and_clip():
    assert LatencyModel().sample("x") == 0.0 and LatencyModel().describe() == "no added latency"
    assert LatencyModel("constant", 0.25).sample("x") == 0.25 == LatencyModel("constant", 0.25).quantile(0.99)
    clipped = LatencyModel("lognormal", 1.0, 2.0, max_seconds=1.5)
    assert max(clipped.sample(f"c{i}") for i in range(2000)) == 1.5
    assert clipped.quantile(0.999) == 1.5


@pytest.mark.parametrize("kwargs", [dict(distribution="gamma", median_seconds=1.0), dict(distribution="constant"),
                                    dict(distribution="lognormal", median_seconds=1.0, sigma=-1.0),
                                    dict(distribution="lognormal", median_seconds=1.0, max_seconds=0.0)])
def test_bad_latency_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        LatencyModel(**kwargs)


def test_bad_latency_config_is_refused():
    with pytest.raises(ConfigError, match="median_seconds"):
        load_config(["--agent.env_server.latency.distribution", "lognormal"], environ={})
    with pytest.raises(ConfigError):
        load_config(["--agent.env_server.latency.distribution", "gamma"], environ={})
    with pytest.raises(ConfigError, match="security.api_key"):
        load_config(["--agent.env_server.api_key_required", "true"], environ={})
    with pytest.raises(ValueError):
        fit_lognormal([1.0])
    with pytest.raises(ValueError):
        fit_lognormal([1.0, -2.0])


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_measured_fits_reproduce_the_published_percentiles(name):
    """Each shipped fit predicts the source's own median and p95 (ComputeSDK sequential TTI, 100 runs)."""
    m = MEASURED[name]
    model = LatencyModel("lognormal", m.fit_median, m.fit_sigma)
    assert model.quantile(0.5) == pytest.approx(m.median, rel=0.2)
    assert model.quantile(0.95) == pytest.approx(m.p95, rel=0.25)
    assert m.median <= m.p95 <= m.p99 <= m.max


def test_shipped_remote_config_uses_the_modal_fit():
    cfg = load_config(["--config", str(REPO / "configs" / "smollm2_calculator_remote.yaml")], environ={})
    es, modal = cfg.agent.env_server, MEASURED["modal"]
    assert es.enabled and cfg.agent.workflow == "calculator"
    assert (es.latency.distribution, es.latency.median_seconds, es.latency.sigma) == \
        ("lognormal", modal.fit_median, modal.fit_sigma)
    # the deadline is far in the measured tail: the slowest of 100 measured calls took 4.8 s
    assert es.deadline_seconds > modal.max and LatencyModel.from_config(es.latency).quantile(0.9999) < es.deadline_seconds
    base = load_config(["--config", str(REPO / "configs" / "smollm2_calculator.yaml")], environ={})
    assert cfg.model_dump(exclude={"run": {"name"}, "agent": {"env_server"}}) == \
        base.model_dump(exclude={"run": {"name"}, "agent": {"env_server"}})


# ------------------------------------------------------------------------------------------------
# schemas


def _body(**kw):
    body = {"expression": "12*13", "call_id": "g0/1:0:0", "deadline_ms": 1000, "replay": False}
    body.update(kw)
    return {k: v for k, v in body.items() if v is not ...}


@pytest.mark.parametrize("body", [
    _body(expression=""), _body(expression="1" * 201), _body(expression=12), _body(call_id=""),
    _body(call_id="a b"), _body(call_id="x" * 257), _body(deadline_ms=0), _body(deadline_ms=3_600_001),
    _body(deadline_ms="10"), _body(replay="yes"), _body(extra=1), _body(expression=...), _body(deadline_ms=...),
], ids=lambda b: ",".join(f"{k}" for k in b)[:60])
def test_calculate_schema_bounds_every_field(body):
    schema = calculate_request_model(200)
    with pytest.raises(ValidationError):
        schema.model_validate_json(json.dumps(body))


def test_calculate_schema_accepts_a_valid_body_and_the_answer_is_bounded():
    req = calculate_request_model(200).model_validate_json(json.dumps(_body(replay=True)))
    assert (req.expression, req.call_id, req.deadline_ms, req.replay) == ("12*13", "g0/1:0:0", 1000, True)
    with pytest.raises(ValueError):
        calculate_request_model(0)
    with pytest.raises(ValidationError):
        ToolResponse(outcome="ok", result="x" * 4097, call_id="c", latency_seconds=0.0, elapsed_seconds=0.0)
    with pytest.raises(ValidationError):
        ToolResponse(outcome="crashed", call_id="c", latency_seconds=0.0, elapsed_seconds=0.0)


# ------------------------------------------------------------------------------------------------
# a real server on a loopback port


@contextlib.asynccontextmanager
async def serving(port: int | None = None, registry: bool = True, **opts):
    from asyncrl.metrics import role_registry

    port = port or free_port()
    reg, metrics = role_registry("env_server") if registry else (None, None)
    server = EnvServer(EnvServerOptions(port=port, **opts), metrics=metrics, registry=reg)
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _post(url: str, body, headers=None, raw: bytes | None = None):
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else json.dumps(body).encode()
        async with s.post(url + "/tools/calculate", data=data,
                          headers={"Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, await r.json()


async def test_calculate_answers_results_and_tool_errors():
    async with serving() as (server, url):
        status, ans = await _post(url, _body())
        assert status == 200 and ans["outcome"] == "ok" and ans["result"] == "156" and ans["call_id"] == "g0/1:0:0"
        status, ans = await _post(url, _body(expression="7//0"))
        assert status == 200 and ans["outcome"] == "tool_error" and ans["error"] == "ValueError: division by zero"
        client = EnvServerClient(url, deadline_seconds=2.0)
        assert await client.calculate("(2+3)*4", "c1") == "20"
        with pytest.raises(ToolCallError) as info:
            await client.calculate("2**8", "c2")
        assert info.value.observation.startswith("error: ValueError: only integers") and info.value.outcome == "tool_error"
        await client.aclose()


async def test_the_drawn_latency_is_waited():
    async with serving(latency=LatencyModel("constant", 0.4)) as (server, url):
        t0 = time.monotonic()
        status, ans = await _post(url, _body())
        assert ans["outcome"] == "ok" and 0.4 <= time.monotonic() - t0 < 2.0 and ans["latency_seconds"] == 0.4


async def test_a_call_past_its_deadline_is_cut_at_the_deadline_and_observed():
    async with serving(deadline_seconds=0.3, latency=LatencyModel("constant", 5.0)) as (server, url):
        t0 = time.monotonic()
        status, ans = await _post(url, _body(deadline_ms=60_000))  # the server's own deadline caps the request's
        took = time.monotonic() - t0
        assert status == 200 and ans["outcome"] == "deadline" and "deadline of 0.3 s" in ans["error"]
        assert 0.3 <= took < 1.5, took
        client = EnvServerClient(url, deadline_seconds=0.3)
        with pytest.raises(ToolCallError) as info:
            await client.calculate("1+1", "c")
        assert info.value.observation == "error: the tool took longer than 0.3 s" and info.value.outcome == "deadline"
        await client.aclose()
    async with serving(deadline_seconds=30.0, latency=LatencyModel("constant", 5.0)) as (server, url):
        t0 = time.monotonic()
        status, ans = await _post(url, _body(deadline_ms=200))  # a shorter request deadline is honoured
        assert ans["outcome"] == "deadline" and time.monotonic() - t0 < 1.5


async def test_a_call_the_client_hears_nothing_from_is_a_deadline_observation():
    """A server that accepts and never answers: the worker gives up at deadline + 2 s (an observation)."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    client = EnvServerClient(url, deadline_seconds=0.2, outage_seconds=30)
    t0 = time.monotonic()
    with pytest.raises(ToolCallError) as info:
        await client.calculate("1+1", "c")
    assert info.value.outcome == "deadline" and 2.0 <= time.monotonic() - t0 < 5.0
    await client.aclose()
    sock.close()


async def test_queueing_for_a_slot_counts_toward_the_deadline():
    async with serving(max_concurrent_calls=1, deadline_seconds=1.0, latency=LatencyModel("constant", 0.6)) as (server, url):
        (s1, a1), (s2, a2) = await asyncio.gather(_post(url, _body(call_id="a")), _post(url, _body(call_id="b")))
        assert sorted([a1["outcome"], a2["outcome"]]) == ["deadline", "ok"]


async def test_bad_requests_are_refused_with_a_message_and_counted():
    async with serving(api_key=SecretStr(KEY)) as (server, url):
        auth = {"Authorization": f"Bearer {KEY}"}
        status, ans = await _post(url, _body(expression="1" * 201), auth)
        assert status == 400 and "expression" in ans["error"]["message"] and "200 characters" in ans["error"]["message"]
        status, ans = await _post(url, None, auth, raw=b"x" * (server.body_limit + 10))
        assert status == 413 and "too large" in ans["error"]["message"]
        status, ans = await _post(url, _body(), {**auth, "Content-Encoding": "gzip"})
        assert status == 415
        status, ans = await _post(url, _body())
        assert status == 401 and ans["error"]["message"] == "Unauthorized"
        status, ans = await _post(url, _body(), {"Authorization": "Bearer wrong"})
        assert status == 401
        status, ans = await _post(url, _body(), auth)
        assert status == 200 and ans["outcome"] == "ok"
        async with aiohttp.ClientSession() as s:  # health and metrics stay open
            async with s.get(url + "/health") as r:
                assert r.status == 200
            async with s.get(url + "/metrics") as r:
                text = await r.text()
        for outcome, n in (("bad_request", 3), ("unauthorized", 2), ("ok", 1)):  # 400, 413, 415; 401 twice
            assert _total(text, outcome) == n, (outcome, text)
        client = EnvServerClient(url, deadline_seconds=1.0, api_key="wrong")
        with pytest.raises(EnvServerUnavailable, match="refused the key"):
            await client.calculate("1+1", "c")
        await client.aclose()
        client = EnvServerClient(url, deadline_seconds=1.0, api_key=SecretStr(KEY))
        assert await client.calculate("1+1", "c") == "2"
        with pytest.raises(ToolCallError, match="refused the call"):  # over the schema's bound: an observation
            await client.calculate("1" * 300, "c")
        await client.aclose()


async def test_health_metrics_and_drain():
    from asyncrl.metrics import lint_exposition

    async with serving(latency=LatencyModel("constant", 0.5), drain_timeout_seconds=5.0) as (server, url):
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                health = await r.json()
                assert r.status == 200 and health["status"] == "ok" and health["tools"] == ["calculate"]
                assert health["latency"] == "constant 0.5 s"
            call = asyncio.create_task(_post(url, _body(call_id="inflight", replay=True)))
            await asyncio.sleep(0.2)
            assert server.in_flight == 1
            drain = asyncio.create_task(server.drain())
            await asyncio.sleep(0.05)
            async with s.get(url + "/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "draining"
            status, ans = await _post(url, _body(call_id="late"))
            assert status == 503 and "draining" in ans["error"]["message"]
            assert (await call)[1]["outcome"] == "ok"  # the call in flight is answered
            assert await drain is True
            async with s.get(url + "/metrics") as r:
                text = await r.text()
        assert not lint_exposition(text), lint_exposition(text)
        assert _total(text, "draining") == 1 and _total(text, "ok") == 1
        assert _sample(text, "asyncrl_env_server_replayed_calls_total", tool="calculate") == 1
        assert _sample(text, "asyncrl_env_server_latency_seconds_bucket", tool="calculate", le="0.5") == 1
        assert _sample(text, "asyncrl_env_server_latency_seconds_bucket", tool="calculate", le="0.25") == 0
        assert _sample(text, "asyncrl_env_server_deadline_seconds") == 10.0
        assert _sample(text, "asyncrl_env_server_calls_in_flight") == 0.0


async def test_client_waits_out_an_outage_then_gives_up_after_its_budget(caplog):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = EnvServerClient(url, deadline_seconds=2.0, outage_seconds=30.0)

    async def start_later():
        await asyncio.sleep(0.8)
        async with serving(port=port) as _:
            await asyncio.sleep(3.0)

    later = asyncio.create_task(start_later())
    with caplog.at_level("WARNING"):
        assert await client.calculate("6*7", "c") == "42"  # nobody listened for 0.8 s: sent again, answered
    assert client.stats["retries"] >= 2 and client.stats["outages"] == 1
    assert sum("is unavailable" in r.message for r in caplog.records) == 1
    assert sum("answers again" in r.message for r in caplog.records) == 1
    await later
    short = EnvServerClient(url, deadline_seconds=1.0, outage_seconds=0.5)
    t0 = time.monotonic()
    with pytest.raises(EnvServerUnavailable, match="outage_seconds=0.5"):
        await short.calculate("1+1", "c")
    assert time.monotonic() - t0 < 3.0
    assert not await short.health()
    with pytest.raises(EnvServerUnavailable, match="not ready"):
        await short.wait_ready(0.3, poll_seconds=0.1)
    await client.aclose()
    await short.aclose()


async def test_model_tool_runs_async_tools_and_keeps_outages_out_of_observations():
    from asyncrl.agents.model import EpisodeModel
    from asyncrl.agents.workflow import EpisodeTask, RecordedHistory

    model = EpisodeModel(EpisodeTask({}, [1, 2], "", 0, "s"), None, None, RecordedHistory([]), None,
                         max_tokens=4, max_turns=2, tool_timeout=0.3)

    async def fine(x):
        return x * 2

    async def slow():
        await asyncio.sleep(5)

    async def refused():
        raise ToolCallError("error: the tool took longer than 9 s", "deadline")

    async def down():
        raise EnvServerUnavailable("gone")

    assert await model.tool(fine, 21) == (True, "42")
    assert await model.tool(slow) == (False, "error: the tool took longer than 0.3 s")
    assert await model.tool(refused) == (False, "error: the tool took longer than 9 s")
    with pytest.raises(EnvServerUnavailable):
        await model.tool(down)
    assert (model.tool_calls, model.tool_failures) == (4, 2)
    assert not model.replaying


# ------------------------------------------------------------------------------------------------
# the role as a process


def _env_config(path: Path, port: int, **env_server) -> Path:
    cfg = {"agent": {"workflow": "calculator", "env_server": {"enabled": True, "port": port, **env_server}}}
    path.write_text(yaml.safe_dump(cfg))
    return path


class EnvServerProcess:
    """``asyncrl env-server`` as a child process on a free port."""

    def __init__(self, config: Path, log: Path) -> None:
        self.port = yaml.safe_load(config.read_text())["agent"]["env_server"]["port"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "env-server", "--config", str(config)],
                                     stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))

    async def wait_ready(self, timeout: float = 60.0) -> None:
        client = EnvServerClient(self.url)
        deadline = time.monotonic() + timeout
        try:
            while not await client.health():
                assert self.proc.poll() is None, self.log.read_text()[-2000:]
                assert time.monotonic() < deadline, self.log.read_text()[-2000:]
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def test_env_server_process_serves_then_drains_on_sigterm(tmp_path):
    srv = EnvServerProcess(_env_config(tmp_path / "env.yaml", free_port(), latency={"distribution": "constant",
                                                                                     "median_seconds": 0.5}),
                           tmp_path / "env.log")
    try:
        await srv.wait_ready()
        client = EnvServerClient(srv.url, deadline_seconds=5.0)
        call = asyncio.create_task(client.calculate("12*13", "c0"))
        await asyncio.sleep(0.2)
        srv.proc.send_signal(signal.SIGTERM)
        assert await call == "156"  # answered during the drain
        assert await asyncio.to_thread(srv.proc.wait, 30) == 0
        out = srv.log.read_text()
        assert "deadline 10 s per call" in out and "latency: constant 0.5 s" in out
        assert "drained: 1 calls answered after the stop signal" in out
        await client.aclose()
    finally:
        srv.stop()
    bad = subprocess.run([sys.executable, "-m", "asyncrl.cli", "env-server", "--agent.env_server.deadline_seconds", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "deadline_seconds" in bad.stderr


# ------------------------------------------------------------------------------------------------
# episodes of the built-in calculator on a real environment server


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from asyncrl.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from rollout_server.testing import make_random_model, start_embedded_server

    model_dir = make_random_model(tiny_model_dir, tmp_path_factory.mktemp("envsrv") / "m0", seed=21)
    srv = start_embedded_server(model_dir, "--weight-version", "0", ready_timeout_seconds=300.0)
    yield srv
    srv.stop()


def calculator_worker(buf, engine_url, tokenizer, agent, workflow=None):
    """The real rollout worker running ``agent``'s workflow (or a given LoadedWorkflow)."""
    from asyncrl.agents import load_workflow
    from asyncrl.tasks.rewards import RewardScorer
    from rollout_server.client import EngineClient
    from rollout_server.episodes import EpisodeRunner
    from rollout_server.worker import RolloutWorker, WorkerOptions

    opts = WorkerOptions("w-env", temperature=1.0, max_inflight_requests=8, version_poll_seconds=0.1)
    w = RolloutWorker(buf, EngineClient(engine_url), RewardScorer("rollout_worker_rewards:length_reward"), tokenizer, opts)
    w.episodes = EpisodeRunner(w, workflow or load_workflow(agent), agent, seed=3)
    return w


async def run_until_ready(worker, buf, groups: int, timeout_seconds: float = 180.0, on_tick=None):
    """Run the worker until ``groups`` groups are READY (``on_tick()`` is awaited every 0.1 s)."""
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    deadline = time.monotonic() + timeout_seconds
    try:
        while (await buf.stats())["groups_by_state"].get("ready", 0) < groups:
            if task.done():
                task.result()
                raise AssertionError("the worker stopped before the groups were ready")
            assert time.monotonic() < deadline, f"not ready in {timeout_seconds} s: {await buf.stats()}"
            if on_tick is not None:
                await on_tick()
            await asyncio.sleep(0.1)
    finally:
        stop.set()
    return await task


def buffer_settings(**kw):
    from buffers import BufferSettings

    base = dict(rollout_batch_size=4, train_batch_groups=2, n_samples_per_prompt=2, max_budget=200,
                max_response_len=400, max_staleness=1, lease_seconds=3.0, flush_tokens=2)
    base.update(kw)
    return BufferSettings(**base)


def chat_prompt(tokenizer, text):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def tool_observations(tokenizer, sample) -> list[str]:
    """The decoded observations (environment spans) of an episode, in order (template delimiters included)."""
    from trainer.episodes import episode_layout

    env_spans, _ = episode_layout(sample.segments, len(sample.response_ids))
    return [tokenizer.decode(sample.response_ids[a:b], skip_special_tokens=True) for a, b in env_spans]


def assert_tool_observations(tokenizer, sample, texts: list[str]) -> None:
    """The episode's observations are exactly ``texts`` as ``tool`` messages, each tokenised once after its call."""
    from asyncrl.agents import ChatFormat
    from trainer.episodes import episode_layout

    chat = ChatFormat(tokenizer)
    env_spans, calls = episode_layout(sample.segments, len(sample.response_ids))
    assert len(env_spans) == len(texts), (len(env_spans), texts)
    for (a, b), (ca, cb), text in zip(env_spans, calls, texts):
        expected = chat.observation_ids(text, "tool", after_ids=sample.response_ids[ca:cb])
        assert sample.response_ids[a:b] == expected, (tokenizer.decode(sample.response_ids[a:b]), text)


async def _scrape(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            return await r.text()


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of the series ``name{labels}`` in a text exposition (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def _total(text: str, outcome: str) -> float:
    return _sample(text, "asyncrl_env_server_calls_total", tool="calculate", outcome=outcome)


@pytest.mark.integration
async def test_calculator_episodes_call_their_tool_on_the_env_server(redis_url, engine, tokenizer, tmp_path):
    """The built-in ``calculator`` with ``agent.env_server.enabled``: every calculator call is a call on
    the environment-server process, its result the observation, its latency waited; nothing in-process."""
    from asyncrl.core.config import AgentConfig
    from asyncrl.core.types import PromptGroup, SampleStatus
    from buffers import ReplayBuffer

    port = free_port()
    srv = EnvServerProcess(_env_config(tmp_path / "env.yaml", port, latency={"distribution": "constant",
                                                                             "median_seconds": 0.3}), tmp_path / "env.log")
    agent = AgentConfig(workflow="calculator", max_turns=3, max_tokens_per_turn=6,
                        env_server={"enabled": True, "port": port, "deadline_seconds": 5.0})
    try:
        await srv.wait_ready()
        async with await ReplayBuffer.open(redis_url, "envcalc", buffer_settings()) as buf:
            # the prefill opens a calculator call, as configs/smollm2_calculator.yaml's does
            meta = {"gold": "156", "response_prefix": "<calc>12*13"}
            await buf.feed([PromptGroup(f"g{i}", chat_prompt(tokenizer, f"What is 12*13? ({i})"), meta, 2)
                            for i in range(2)], 0)
            w = calculator_worker(buf, engine.url, tokenizer, agent)
            await run_until_ready(w, buf, 2)
            await w.client.close()
            client = w.episodes.workflow.env_client
            assert client is not None and client.url == f"http://127.0.0.1:{port}"
            await w.episodes.workflow.aclose()
            calls = 0
            for gid in ("g0", "g1"):
                _, samples = await buf.get_group(gid)
                for s in samples:
                    assert s.status == SampleStatus.SCORED and s.info["tool_calls"] >= 1
                    calls += s.info["tool_calls"]
                    obs = tool_observations(tokenizer, s)
                    assert len(obs) == s.info["tool_calls"]
                    assert all("<result>" in o or "error: " in o for o in obs), obs
            text = await _scrape(srv.url)
            assert _total(text, "ok") + _total(text, "tool_error") == calls == client.stats["calls"]
            assert _sample(text, "asyncrl_env_server_latency_seconds_count", tool="calculate") == calls
    finally:
        srv.stop()


@pytest.mark.integration
async def test_a_tool_call_past_its_deadline_is_an_observation_and_the_episode_goes_on(redis_url, engine, tokenizer,
                                                                                       tmp_path):
    from asyncrl.agents import LoadedWorkflow
    from asyncrl.agents.builtin import CalculatorEnv
    from asyncrl.core.config import AgentConfig
    from asyncrl.core.types import PromptGroup, SampleStatus
    from buffers import ReplayBuffer

    import agent_workflows

    port = free_port()
    srv = EnvServerProcess(_env_config(tmp_path / "env.yaml", port, deadline_seconds=0.3,
                                       latency={"distribution": "constant", "median_seconds": 3.0}), tmp_path / "env.log")
    agent = AgentConfig(workflow="agent_workflows:remote_calculator_calls", max_turns=8,
                        env_server={"enabled": True, "port": port, "deadline_seconds": 0.3})
    client = EnvServerClient.from_config(agent.env_server)
    workflow = LoadedWorkflow("remote", agent_workflows.remote_calculator_calls,
                              lambda task: CalculatorEnv.for_task(task, client), client)
    try:
        await srv.wait_ready()
        async with await ReplayBuffer.open(redis_url, "envdeadline", buffer_settings()) as buf:
            await buf.feed([PromptGroup("g0", chat_prompt(tokenizer, "slow tools"), {}, 2)], 0)
            w = calculator_worker(buf, engine.url, tokenizer, agent, workflow)
            await run_until_ready(w, buf, 1)
            await w.client.close()
            await workflow.aclose()
            _, samples = await buf.get_group("g0")
            for s in samples:
                assert s.status == SampleStatus.SCORED and s.reward == 0.0
                assert s.info["tool_calls"] == s.info["tool_failures"] == agent_workflows.REMOTE_CALLS
                assert s.info["turns"] == agent_workflows.REMOTE_CALLS + 1  # every call after a deadline was made
                assert_tool_observations(tokenizer, s, ["error: the tool took longer than 0.3 s"] * agent_workflows.REMOTE_CALLS)
        assert _total(await _scrape(srv.url), "deadline") == 2 * agent_workflows.REMOTE_CALLS
    finally:
        srv.stop()


async def test_env_server_enabled_with_a_workflow_without_a_remote_tool_is_refused():
    from asyncrl.agents import WorkflowError, load_workflow
    from asyncrl.core.config import AgentConfig

    with pytest.raises(WorkflowError, match="only calculator"):
        load_workflow(AgentConfig(workflow="arithmetic_retry", env_server={"enabled": True}))
    wf = load_workflow(AgentConfig(workflow="calculator"))
    assert wf.env_client is None  # off: the calculator runs in-process, as before


async def test_a_replay_answers_the_episodes_tool_calls_from_the_workers_memo():
    """Tool calls are not in the buffer's record: a replay on the same worker takes their results from
    the memo (same trajectory, position, tool and arguments) instead of calling the tool again."""
    from asyncrl.agents.model import EpisodeModel
    from asyncrl.agents.workflow import EpisodeTask, RecordedHistory

    ran = []

    async def remote(x):
        ran.append(x)
        if x < 0:
            raise ToolCallError("error: the tool took longer than 1 s", "deadline")
        return x + 1

    def handle(memo):
        m = EpisodeModel(EpisodeTask({}, [1], "", 0, "s"), None, None, RecordedHistory([]), None, max_tokens=4, max_turns=2)
        m.tool_memo = memo
        return m

    memo: dict = {}
    first = handle(memo)
    assert await first.tool(remote, 1) == (True, "2") and await first.tool(remote, -1) == (False, "error: the tool took longer than 1 s")
    replay = handle(memo)  # the episode run again from the start on the same worker
    assert await replay.tool(remote, 1) == (True, "2")
    assert await replay.tool(remote, -1) == (False, "error: the tool took longer than 1 s")
    assert await replay.tool(remote, 7) == (True, "8")  # a new call runs
    assert ran == [1, -1, 7] and replay.memo_tool_calls == 2 and (replay.tool_calls, replay.tool_failures) == (3, 1)
    other = handle(memo)
    assert await other.tool(remote, 2) == (True, "3") and ran[-1] == 2  # other arguments at that position: it runs
    no_memo = handle(None)
    assert await no_memo.tool(remote, 1) == (True, "2") and ran[-1] == 1 and no_memo.memo_tool_calls == 0


def test_the_controller_runs_the_env_server_as_a_supervised_role(tmp_path):
    import socket

    from asyncrl.controller.resources import assign_resources
    from asyncrl.controller.roles import env_server_spec, role_specs

    remote = REPO / "configs" / "smollm2_calculator_remote.yaml"
    cfg = load_config(["--config", str(remote), "--run.output_dir", str(tmp_path), "--agent.env_server.port",
                       str(free_port())], environ={})
    env: dict[str, str] = {"ASYNCRL_BUFFER__REDIS_URL": "redis://:pw@127.0.0.1:1/0"}
    specs, _ = role_specs(cfg, tmp_path / "config.yaml", env, assign_resources(cfg))
    (spec,) = [s for s in specs if s.name == "env-server"]
    assert spec.argv[-3:] == ["env-server", "--config", str(tmp_path / "config.yaml")]
    assert spec.restart and spec.stop_order == 2 and 2 in spec.fatal_exit_codes and spec.health_check is not None
    assert "ASYNCRL_BUFFER__REDIS_URL" not in spec.env  # no Redis credentials: it never talks to Redis
    assert [s.name for s in specs].index("env-server") < [s.name for s in specs].index("rollout-0")
    off = cfg.model_copy(deep=True)
    off.agent.env_server.enabled = False
    assert env_server_spec(off, [], {}, assign_resources(cfg)) is None
    attached = cfg.model_copy(deep=True)
    attached.agent.env_server.url = "http://env-server.example:30600"
    assert env_server_spec(attached, [], {}, assign_resources(cfg)) is None
    with socket.socket() as busy:  # its port is taken: a free one, announced to every role
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        cfg.agent.env_server.port = busy.getsockname()[1]
        env = {}
        assert env_server_spec(cfg, [], env, assign_resources(cfg)) is not None
        assert int(env["ASYNCRL_AGENT__ENV_SERVER__PORT"]) not in (0, cfg.agent.env_server.port)


@pytest.mark.integration
async def test_an_observation_that_does_not_fit_ends_the_episode_at_the_token_limit(redis_url, engine, tokenizer):
    """A long tool error that does not fit under max_response_len ends the episode (termination
    ``token_limit``, reward 0) and the sample is completed and scored; it used to stay RUNNING and
    stop the worker with ``InvalidTransition: ... only a complete sample can be scored`` (found
    by a tiny ``asyncrl train`` of the remote calculator, whose parse errors are long observations)."""
    from asyncrl.core.config import AgentConfig
    from asyncrl.core.types import PromptGroup, SampleStatus
    from buffers import ReplayBuffer

    agent = AgentConfig(workflow="agent_workflows:observation_overflow", max_turns=2)
    async with await ReplayBuffer.open(redis_url, "envoverflow", buffer_settings(max_response_len=48)) as buf:
        await buf.feed([PromptGroup("g0", chat_prompt(tokenizer, "overflow"), {}, 2)], 0)
        w = calculator_worker(buf, engine.url, tokenizer, agent)
        await run_until_ready(w, buf, 1, timeout_seconds=120.0)
        await w.client.close()
        _, samples = await buf.get_group("g0")
        for s in samples:
            assert s.status == SampleStatus.SCORED and s.reward == 0.0 and s.info["termination"] == "token_limit"
            assert len(s.response_ids) < 48  # the observation was not appended
