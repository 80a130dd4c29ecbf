"""``kill -9`` of the environment server loses no episode (issue 28 item 2).

Real processes and services: the environment server runs as the role ``asyncrl train`` starts
(:func:`asyncrl.controller.roles.env_server_spec`) under the real
:class:`asyncrl.controller.supervisor.Supervisor`, which restarts it; the episodes run in the
real rollout worker against a real embedded engine (tiny random model) and a real redis-server.
Every episode makes four calculator calls on the server (each 0.8 s of latency) and is parked by
a small token budget and resumed by durable replay across the kills (its earlier calls answered
from the worker's tool memo, its new ones sent to whichever server runs then). The server is
SIGKILLed three times, each time with calls in flight.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import pytest
import yaml

from asyncrl.core.net import free_port
from asyncrl.env_server import EnvServerClient, safe_calculate

from test_env_server import buffer_settings, calculator_worker, chat_prompt, run_until_ready

import agent_workflows

KILLS = 3


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from asyncrl.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from rollout_server.testing import make_random_model, start_embedded_server

    model_dir = make_random_model(tiny_model_dir, tmp_path_factory.mktemp("envkill") / "m0", seed=21)
    srv = start_embedded_server(model_dir, "--weight-version", "0", ready_timeout_seconds=300.0)
    yield srv
    srv.stop()


async def _in_flight(client: EnvServerClient) -> int | None:
    """The server's calls in flight (``/health``), or None when it does not answer."""
    import aiohttp

    try:
        session = await client._get_session()
        async with session.get(f"{client.url}/health", timeout=aiohttp.ClientTimeout(total=1.0)) as r:
            return int((await r.json())["in_flight"]) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
        return None


@pytest.mark.slow
@pytest.mark.integration
async def test_kill9_of_the_env_server_mid_call_loses_no_episode(redis_url, engine, tokenizer, tmp_path):
    """Three SIGKILLs of the supervised environment server, each with calls in flight: every episode
    still ends with exactly its four calculator results as observations (no error, nothing lost or
    repeated), no sample failed or restarted, and the worker saw three outages that it waited out."""
    from asyncrl.agents import LoadedWorkflow
    from asyncrl.agents.builtin import CalculatorEnv
    from asyncrl.controller.roles import env_server_spec
    from asyncrl.controller.supervisor import Supervisor
    from asyncrl.core.config import load_config
    from asyncrl.core.types import PromptGroup, SampleStatus
    from buffers import ReplayBuffer
    from rollout_server.episodes import episode_seed
    from test_env_server import assert_tool_observations
    from trainer.episodes import episode_layout

    port = free_port()
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "envkill", "output_dir": str(tmp_path / "runs")},
        "agent": {"workflow": "agent_workflows:remote_calculator_calls", "max_turns": 8,
                  "env_server": {"enabled": True, "port": port, "deadline_seconds": 10.0, "outage_seconds": 120.0,
                                 "latency": {"distribution": "constant", "median_seconds": 0.8}}}}))
    cfg = load_config(["--config", str(config)], environ={})
    env: dict[str, str] = {}
    spec = env_server_spec(cfg, ["--config", str(config)], env, SimpleNamespace(rollout_cores=[None], rollout_nice=0))
    assert spec is not None and spec.name == "env-server" and spec.restart and env == {}  # the port was free
    assert "ASYNCRL_BUFFER__REDIS_URL" not in spec.env  # it never talks to Redis
    client = EnvServerClient.from_config(cfg.agent.env_server)
    workflow = LoadedWorkflow("remote", agent_workflows.remote_calculator_calls,
                              lambda task: CalculatorEnv.for_task(task, client), client)
    sup = Supervisor(tmp_path / "logs")
    sup.start(spec)
    try:
        await asyncio.to_thread(sup.wait_healthy, "env-server", 120.0)
        kills_mid_call = 0
        pids = {sup.pid("env-server")}
        state = {"next_kill": time.monotonic() + 1.0, "killed": 0}

        async def tick():
            """Drive the supervisor (restarts) and kill the server when calls are in flight."""
            nonlocal kills_mid_call
            for ev in await asyncio.to_thread(sup.poll):  # its health check blocks: off the event loop
                assert ev.restarted, ev.describe()
            if state["killed"] >= KILLS or time.monotonic() < state["next_kill"]:
                return
            if client.in_outage or not sup.is_running("env-server"):
                return  # each kill its own outage: the worker has had an answer from the restarted server
            if (await _in_flight(client) or 0) < 1:
                return
            pid = sup.pid("env-server")
            os.kill(pid, signal.SIGKILL)  # kill -9, mid-call
            kills_mid_call += 1
            state["killed"] += 1
            state["next_kill"] = time.monotonic() + 3.0

        async with await ReplayBuffer.open(redis_url, "envkill", buffer_settings(max_budget=6)) as buf:
            await buf.feed([PromptGroup(f"g{i}", chat_prompt(tokenizer, f"kill test {i}"), {}, 2) for i in range(3)], 0)
            w = calculator_worker(buf, engine.url, tokenizer, cfg.agent, workflow)
            await run_until_ready(w, buf, 3, timeout_seconds=420.0, on_tick=tick)
            await w.client.close()
            assert state["killed"] == kills_mid_call == KILLS, "the server was not killed mid-call three times"
            assert sup.restarts("env-server") == KILLS
            pids.add(sup.pid("env-server"))
            stats = await buf.stats()
            counters = stats["counters"]
            assert not any(k.startswith("failed_samples") for k in counters), counters
            assert counters.get("restarted_samples:nondeterministic", 0) == 0, counters
            resumed = memo_hits = 0
            for i in range(3):
                _, samples = await buf.get_group(f"g{i}")
                for s in samples:
                    assert s.status == SampleStatus.SCORED and s.reward == 1.0, (s.sample_id, s.info)
                    _, calls = episode_layout(s.segments, len(s.response_ids))
                    assert len(calls) == agent_workflows.REMOTE_CALLS + 1
                    seed = episode_seed(3, s.sample_id)  # the worker's EpisodeRunner seed
                    want = [f"<result>{safe_calculate(agent_workflows.remote_expression(seed, k, b - a))}</result>"
                            for k, (a, b) in enumerate(calls[:-1])]
                    assert_tool_observations(tokenizer, s, want)
                    resumed += s.num_resumes > 0
                    memo_hits += s.info["memo_tool_calls"]
            assert resumed >= 1, "no episode was parked and replayed across the role"
            assert memo_hits >= 1, "no replay answered a tool call from the worker's memo"
        assert client.stats["outages"] == KILLS and client.stats["retries"] >= KILLS, client.stats
        assert client.stats["tool_errors"] == client.stats["deadlines"] == 0, client.stats
        # each call made once (replays used the memo), except the calls of an episode whose lease this
        # worker lost while it waited for the server: the episode was reclaimed and its call sent again
        assert 6 * agent_workflows.REMOTE_CALLS <= client.stats["calls"] <= 6 * agent_workflows.REMOTE_CALLS + \
            w.stats.lease_lost, (client.stats, w.stats)
        log = sup.log_path("env-server").read_text()
        assert log.count("serving calculate on") == KILLS + 1, log[-3000:]
    finally:
        sup.stop_all(grace_seconds=10.0)
        await workflow.aclose()
