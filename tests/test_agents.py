"""Episodes of multi-turn workflows (issue 15): token identity, durability, replay, failure paths.

Real processes and services: an embedded engine server (tiny random model) over HTTP, a real
redis-server (fixture ``redis_url``), the real rollout worker running the workflows of
``tests/agent_workflows.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from asyncrl.agents import ChatFormat, load_workflow
from asyncrl.agents.workflow import RecordedHistory
from asyncrl.core.config import AgentConfig, AsyncRLConfig
from asyncrl.core.types import PromptGroup, SampleStatus, Segment
from buffers import BufferSettings, ReplayBuffer
from rollout_server.client import EngineClient
from rollout_server.episodes import EpisodeRunner
from rollout_server.testing import make_random_model, start_embedded_server
from rollout_server.worker import RolloutWorker, WorkerOptions
from trainer.episodes import episode_layout

import agent_workflows


def _settings(**kw) -> BufferSettings:
    base = dict(rollout_batch_size=4, train_batch_groups=2, n_samples_per_prompt=2, max_budget=64,
                max_response_len=96, max_staleness=1, lease_seconds=3.0, flush_tokens=2)
    base.update(kw)
    return BufferSettings(**base)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from asyncrl.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return make_random_model(tiny_model_dir, tmp_path_factory.mktemp("agents") / "m0", seed=21)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_embedded_server(model_dir, "--weight-version", "0")
    yield srv
    srv.stop()


def _worker(buf, url, tokenizer, workflow: str, worker_id="w-agent", **agent_kw) -> RolloutWorker:
    from asyncrl.tasks.rewards import RewardScorer

    opts = WorkerOptions(worker_id, temperature=1.0, max_inflight_requests=4, version_poll_seconds=0.1)
    w = RolloutWorker(buf, EngineClient(url), RewardScorer("rollout_worker_rewards:length_reward"), tokenizer, opts)
    agent = AgentConfig(workflow=workflow, **agent_kw)
    w.episodes = EpisodeRunner(w, load_workflow(agent), agent, seed=3)
    return w


async def _run_until(worker, cond, timeout_seconds=90.0):
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    deadline = time.monotonic() + timeout_seconds
    try:
        while not await cond():
            if task.done():
                task.result()
                raise AssertionError("the worker stopped before the condition was met")
            assert time.monotonic() < deadline, f"not met in {timeout_seconds} s: {await worker.buffer.stats()}"
            await asyncio.sleep(0.1)
    finally:
        stop.set()
    return await task


def _ready(buf, n):
    async def cond():
        return (await buf.stats())["groups_by_state"].get("ready", 0) >= n
    return cond


def _prompt(tokenizer, text):
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------- units
def test_observation_tokens_use_the_template_delimiters(tokenizer):
    chat = ChatFormat(tokenizer)
    eos = tokenizer.eos_token_id
    after_eos = chat.observation_text("hi", "user", "5 =", after_ids=[7, eos])
    assert after_eos == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n5 ="
    cut = chat.observation_text("hi", "tool", after_ids=[7, 8])  # a call cut by max_tokens: close its turn
    assert cut == "<|im_end|>\n<|im_start|>tool\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = chat.observation_ids("hi", "user", after_ids=[eos])
    assert tokenizer.decode(ids, skip_special_tokens=False) == after_eos[:-len("5 =")]


def test_recorded_history_rebuilds_calls_and_observations():
    ids = list(range(10))
    segs = [Segment(0, 2, "budget"), Segment(2, 3, "turn"), Segment(3, 5, "obs"), Segment(5, 7, "abort"),
            Segment(7, 8, "lease")]
    h = RecordedHistory.from_record(ids, [-0.5] * 10, [0] * 10, segs)
    kinds = [(e.kind, e.token_ids, e.complete) for e in h.events]
    assert kinds == [("model", [0, 1, 2], True), ("obs", [3, 4], False if False else True),
                     ("model", [5, 6, 7, 8, 9], False)]
    env, calls = episode_layout(segs, 10)
    assert env == [(3, 5)] and calls == [(0, 3), (5, 10)]
    with pytest.raises(ValueError, match="do not tile"):
        RecordedHistory.from_record(ids, [0.0] * 10, [0] * 10, [Segment(1, 2, "turn")])


def test_per_step_is_deprecated_and_mapped_to_broadcast():
    with pytest.warns(DeprecationWarning, match="per_step"):
        cfg = AsyncRLConfig.model_validate({"agent": {"workflow": "arithmetic_retry", "stepwise_mode": "per_step"}})
    assert cfg.agent.stepwise_mode == "broadcast"
    with pytest.raises(ValueError, match="stepwise_mode"):
        AsyncRLConfig.model_validate({"agent": {"stepwise_mode": "per_token"}})
    from trainer.episodes import check_stepwise_mode

    with pytest.raises(ValueError, match="broadcast"):
        check_stepwise_mode("per_step")


def test_bad_workflow_specs_are_named():
    from asyncrl.agents import WorkflowError

    for spec, msg in [("nosuch", "neither a built-in"), ("nosuchmod:run", "cannot import"),
                      ("agent_workflows:nothing", "no callable"), ("agent_workflows:FEEDBACK", "no callable")]:
        with pytest.raises(WorkflowError, match=msg):
            load_workflow(AgentConfig(workflow=spec))


# ---------------------------------------------------------------------------------------------- episodes
async def test_episode_token_identity_and_segments(redis_url, server, tokenizer):
    """The trained ids are the engine's output ids plus the observation ids, byte for byte."""
    async with await ReplayBuffer.open(redis_url, "ep1", _settings()) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "count"), {}, 2),
                        PromptGroup("g1", _prompt(tokenizer, "talk"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:three_turns")
        await _run_until(w, _ready(buf, 2))
        await w.client.close()
        chat = ChatFormat(tokenizer)
        differs = 0
        for gid in ("g0", "g1"):
            group, samples = await buf.get_group(gid)
            for s in samples:
                assert s.status == SampleStatus.SCORED
                env, calls = episode_layout(s.segments, len(s.response_ids))
                assert len(calls) == 3 and len(env) == 2
                # rebuild: each call's engine ids, then the observation tokenised once after it
                rebuilt = []
                for k, (a, b) in enumerate(calls):
                    out = s.response_ids[a:b]
                    assert 1 <= len(out) <= 6 and len(rebuilt) == a
                    rebuilt += out
                    if k < 2:
                        obs = chat.observation_ids(agent_workflows.FEEDBACK[k], "user", after_ids=out)
                        assert s.response_ids[env[k][0]:env[k][1]] == obs
                        rebuilt += obs
                assert rebuilt == s.response_ids
                assert all(s.behaviour_logprobs[i] == 0.0 for a, b in env for i in range(a, b))
                assert s.reward == pytest.approx(sum(b - a for a, b in calls) / 100.0)
                assert s.info["termination"] == "env_done" and s.info["turns"] == 3
                text = tokenizer.decode(group.prompt_ids + s.response_ids, skip_special_tokens=False)
                differs += list(tokenizer(text, add_special_tokens=False)["input_ids"]) != group.prompt_ids + s.response_ids
        assert differs > 0, "re-tokenising decoded history would have given the same ids: the test proves nothing"


async def test_budget_interrupted_episodes_resume_without_regenerating(redis_url, server, tokenizer):
    """M = 4 < a call's 6 tokens: calls are parked mid-way and resumed by replay; no token is generated twice."""
    async with await ReplayBuffer.open(redis_url, "ep2", _settings(max_budget=4)) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "count"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:three_turns")
        stats = await _run_until(w, _ready(buf, 1))
        await w.client.close()
        _, samples = await buf.get_group("g0")
        model_tokens = 0
        for s in samples:
            env, calls = episode_layout(s.segments, len(s.response_ids))
            assert len(calls) == 3
            model_tokens += sum(b - a for a, b in calls)
            assert s.num_resumes >= 1 and any(seg.finish_reason == "budget" for seg in s.segments)
        assert stats.generated_tokens == model_tokens  # nothing regenerated
        assert (await buf.stats())["counters"].get("idle_resumes", 0) >= 1


async def test_budget_parked_episodes_are_scored_on_their_whole_calls(redis_url, server, tokenizer):
    """M = 4 < a call's 6 tokens: every call is parked mid-way and continued; the workflow's reward,
    computed from each call's text, equals the same function of the recorded calls (a resumed call's
    text is the whole call, not the part after the park)."""
    async with await ReplayBuffer.open(redis_url, "ep2t", _settings(max_budget=4)) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "digest"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:three_turns_text")
        await _run_until(w, _ready(buf, 1))
        await w.client.close()
        _, samples = await buf.get_group("g0")
        parked_mid_call = 0
        for s in samples:
            _, calls = episode_layout(s.segments, len(s.response_ids))
            assert len(calls) == 3 and s.num_resumes >= 1
            texts = [tokenizer.decode(s.response_ids[a:b], skip_special_tokens=True) for a, b in calls]
            assert s.reward == pytest.approx(agent_workflows.text_digest(texts), abs=1e-9)
            parked_mid_call += sum(1 for a, b in calls if any(seg.finish_reason == "budget" and a < seg.end < b
                                                              for seg in s.segments))
        assert parked_mid_call > 0, "no call was parked in its middle: the test proves nothing"


async def _calculator_episodes(redis_url, url, tokenizer, run: str, max_budget: int) -> list:
    """The built-in ``calculator`` workflow, greedy, on 3 prompts whose prefill opens a calculator
    call (so every episode calls the tool once, then answers): the samples, by group."""
    from asyncrl.tasks.rewards import RewardScorer

    async with await ReplayBuffer.open(redis_url, run, _settings(max_budget=max_budget, max_response_len=160,
                                                                 rollout_batch_size=3, train_batch_groups=3)) as buf:
        groups = []
        for i, (expr, gold) in enumerate([("12*3", "36"), ("7+8", "15"), ("90-4", "86")]):
            prefill = f"<calc>{expr}</calc>"
            groups.append(PromptGroup(f"g{i}", _prompt(tokenizer, f"What is {expr}?") + list(
                tokenizer(prefill, add_special_tokens=False)["input_ids"]), {"response_prefix": prefill, "gold": gold}, 2))
        await buf.feed(groups, 0)
        opts = WorkerOptions(f"w-{run}", temperature=0.0, max_inflight_requests=4, version_poll_seconds=0.1)
        w = RolloutWorker(buf, EngineClient(url), RewardScorer("math_verify"), tokenizer, opts)
        agent = AgentConfig(workflow="calculator", max_turns=3, max_tokens_per_turn=24)
        w.episodes = EpisodeRunner(w, load_workflow(agent), agent, seed=3)
        await _run_until(w, _ready(buf, 3))
        await w.client.close()
        return [(await buf.get_group(f"g{i}"))[1] for i in range(3)]


async def test_parked_calculator_episodes_equal_unparked_ones(redis_url, server, tokenizer):
    """The async calculator job parks episodes at ``max_budget`` model tokens per version and resumes
    them from their record (issue 28 item 3: its async arm lost tool use where sync learned it). Greedy,
    a budget of 5 tokens parks every call several times; the episodes must be token for token those
    of a budget that never parks: same calls, same tool results in the context, same rewards."""
    whole = await _calculator_episodes(redis_url, server.url, tokenizer, "calc-whole", 1000)
    parked = await _calculator_episodes(redis_url, server.url, tokenizer, "calc-parked", 5)
    assert any(s.num_resumes >= 1 for g in parked for s in g), "nothing was parked: the test proves nothing"
    for gw, gp in zip(whole, parked):
        for a, b in zip(gw, gp):
            assert a.info["tool_calls"] == b.info["tool_calls"] >= 1
            assert tokenizer.decode(b.response_ids, skip_special_tokens=False) == tokenizer.decode(
                a.response_ids, skip_special_tokens=False)
            assert b.response_ids == a.response_ids and b.reward == a.reward
            assert episode_layout(b.segments, len(b.response_ids)) == episode_layout(a.segments, len(a.response_ids))


async def test_tools_failures_are_observations(redis_url, server, tokenizer):
    async with await ReplayBuffer.open(redis_url, "ep3", _settings()) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "tool"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:failing_tool")
        await _run_until(w, _ready(buf, 1))
        await w.client.close()
        _, samples = await buf.get_group("g0")
        for s in samples:
            assert s.reward == 0.5 and s.info["tool_calls"] == 2 and s.info["tool_failures"] == 2
            text = tokenizer.decode(s.response_ids, skip_special_tokens=False)
            assert "tool exploded" in text and "longer than 0.2 s" in text


async def test_workflow_error_fails_the_sample_with_its_reason(redis_url, server, tokenizer):
    async with await ReplayBuffer.open(redis_url, "ep4", _settings()) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "bug"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:raises")

        async def dropped():
            return "g0" in await buf.dropped_groups()
        await _run_until(w, dropped)
        await w.client.close()
        st = await buf.stats()
        assert st["counters"]["failed_samples:workflow_error"] == 2


async def test_nondeterministic_workflow_is_detected_on_replay(redis_url, server, tokenizer):
    async with await ReplayBuffer.open(redis_url, "ep5", _settings(max_budget=3)) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "noise"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:unseeded")

        async def restarted():
            return (await buf.stats())["counters"].get("restarted_samples:nondeterministic", 0) >= 1
        await _run_until(w, restarted)
        await w.client.close()


async def test_precomputed_step_advantages_reach_the_buffer(redis_url, server, tokenizer):
    async with await ReplayBuffer.open(redis_url, "ep6", _settings()) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "adv"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:step_advantages")
        await _run_until(w, _ready(buf, 1))
        await w.client.close()
        _, samples = await buf.get_group("g0")
        for s in samples:
            env, calls = episode_layout(s.segments, len(s.response_ids))
            (a0, b0), (a1, b1) = calls
            adv = s.advantages
            assert len(adv) == len(s.response_ids)
            assert adv[a0:b0] == [0.5] * (b0 - a0) and adv[a1:b1] == [float(i) for i in range(b1 - a1)]
            assert all(adv[i] == 0.0 for a, b in env for i in range(a, b))


# ---------------------------------------------------------------------------------------------- kill -9
def _write_agent_config(path, redis_url, run, model_dir):
    import yaml

    cfg = {"run": {"name": run, "output_dir": str(path.parent / "runs")}, "model": {"path": str(model_dir)},
           "data": {"reward": "rollout_worker_rewards:length_reward"},
           "rollout": {"base_port": 0, "n_samples_per_prompt": 2, "rollout_batch_size": 4, "max_budget": 800,
                       "max_response_len": 400, "temperature": 1.0, "max_inflight_requests": 8, "engine_threads": 1},
           "buffer": {"redis_url": redis_url, "lease_seconds": 2.0, "flush_tokens": 2},
           "agent": {"workflow": "agent_workflows:long_episode", "max_turns": 8, "tool_timeout_seconds": 5}}
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
async def test_kill9_mid_episode_and_mid_tool_call_resumes_elsewhere_losing_nothing(redis_url, model_dir, tokenizer,
                                                                                    tmp_path):
    """10 rounds: start a rollout server, SIGKILL it mid-episode (every other round while a tool call runs),
    snapshot every record; then one server finishes. Every snapshot is a prefix of the final record (no
    model token lost), every episode has exactly its 8 calls and 7 observations in order (no call
    regenerated or repeated), and no replay diverged."""
    import os
    import random
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from asyncrl.core.config import load_config

    tests = Path(__file__).resolve().parent
    config = _write_agent_config(tmp_path / "agent.yaml", redis_url, "agentkill", model_dir)
    markers = tmp_path / "markers"
    markers.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", ASYNCRL_TEST_TOOL_MARKERS=str(markers),
               PYTHONPATH=os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH"), str(tests.parent)])))

    def start(i):
        log = tmp_path / f"server{i}.log"
        return subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "rollout-server", "--config", str(config)],
                                stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env), log

    async def wait_up(proc, log):
        deadline = time.monotonic() + 180
        while "requests in flight" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            await asyncio.sleep(0.2)

    rng = random.Random(15)
    settings = BufferSettings.from_config(load_config(["--config", str(config)]))
    sids = [f"g{i}/{j}" for i in range(4) for j in range(2)]
    snapshots: dict[str, list[list[int]]] = {sid: [] for sid in sids}
    procs = []
    mid_tool = 0
    async with await ReplayBuffer.open(redis_url, "agentkill", settings) as buf:
        await buf.feed([PromptGroup(f"g{i}", _prompt(tokenizer, f"task {i}"), {}, 2) for i in range(4)], 0)
        try:
            for rnd in range(10):
                proc, log = start(rnd)
                procs.append(proc)
                await wait_up(proc, log)
                if rnd % 2 == 0:  # kill while a tool call runs
                    deadline = time.monotonic() + 30
                    while not any(markers.iterdir()) and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                    mid_tool += bool(any(markers.iterdir()))
                else:
                    await asyncio.sleep(rng.uniform(0.3, 2.0))
                proc.kill()
                proc.wait()
                for m in markers.iterdir():
                    m.unlink()
                for sid in sids:
                    with contextlib.suppress(Exception):
                        snapshots[sid].append((await buf.get_sample(sid)).response_ids)
            assert mid_tool >= 3, "the kills never landed during a tool call"
            proc, log = start(99)
            procs.append(proc)
            deadline = time.monotonic() + 300
            while (await buf.stats())["groups_by_state"].get("ready", 0) < 4:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                await asyncio.sleep(0.3)
            st = await buf.stats()
            assert st["counters"].get("restarted_samples:nondeterministic", 0) == 0
            assert st["counters"].get("reclaimed_leases", 0) >= 4
            chat = ChatFormat(tokenizer)
            resumed = 0
            for sid in sids:
                s = await buf.get_sample(sid)
                assert s.status == SampleStatus.SCORED
                for snap in snapshots[sid]:
                    assert s.response_ids[:len(snap)] == snap  # nothing lost, nothing rewritten
                env_spans, calls = episode_layout(s.segments, len(s.response_ids))
                assert len(calls) == 8 and len(env_spans) == 7
                for k, (a, b) in enumerate(calls[:-1]):
                    obs = chat.observation_ids(f"call {k} gave {b - a} tokens", "tool", after_ids=s.response_ids[a:b])
                    assert s.response_ids[env_spans[k][0]:env_spans[k][1]] == obs
                assert s.reward == pytest.approx(sum(b - a for a, b in calls) / 100.0)
                resumed += s.num_resumes > 0
            assert resumed >= 4
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


# ---------------------------------------------------------------------------------------------- OPSD
def test_opsd_advantages_by_hand():
    from asyncrl.agents.opsd import opsd, opsd_advantages

    assert opsd_advantages([-1.0, -2.0, -0.1, -9.0], [-1.5, -1.0, -4.0, -0.5], clip=2.0) == [0.5, -1.0, 2.0, -2.0]
    with pytest.raises(ValueError, match="teacher has 1 logprobs, student 0"):
        opsd_advantages([-1.0], [], clip=1.0)
    with pytest.raises(ValueError, match="clip"):
        opsd(clip=0.0)
    assert opsd_advantages([-1.0, -9.0], [-1.5, -0.5], clip=2.0, coef=0.25) == [0.125, -0.5]
    with pytest.raises(ValueError, match="coef"):
        opsd(coef=0.0)


def _opsd_want(lm, hint, context, target, clip=0.5):
    """clip(log p(target | hint + context) - log p(target | context)), recomputed from the model."""
    from rollout_server.testing import recompute_logprobs

    student = recompute_logprobs(lm, context, target, 1.0)
    teacher = recompute_logprobs(lm, hint + context, target, 1.0)
    return [max(-clip, min(clip, t - u)) for t, u in zip(teacher, student)]


@pytest.mark.parametrize("coef", [None, 0.25])
async def test_opsd_sets_teacher_minus_student_logratios(redis_url, server, tokenizer, model_dir, coef):
    """Per-token advantages = coef * clip(log p(y | hint + prompt + y<) - log p(y | prompt + y<), 0.5),
    recomputed here; coef = agent.opsd_coef (None: the decorator's, 1)."""
    from asyncrl.models import load_causal_lm

    async with await ReplayBuffer.open(redis_url, f"ep7-{coef}", _settings()) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "distil"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:opsd_two_calls", opsd_coef=coef)
        await _run_until(w, _ready(buf, 1))
        await w.client.close()
        group, samples = await buf.get_group("g0")
        lm = load_causal_lm(model_dir)
        hint = ChatFormat(tokenizer).message_ids("secret hint", "system")
        assert tokenizer.decode(hint) == "<|im_start|>system\nsecret hint<|im_end|>\n"
        for s in samples:
            env, calls = episode_layout(s.segments, len(s.response_ids))
            assert s.reward == 0.25 and len(s.advantages) == len(s.response_ids)
            for a, b in calls:
                want = _opsd_want(lm, hint, group.prompt_ids + s.response_ids[:a], s.response_ids[a:b])
                assert s.advantages[a:b] == pytest.approx([(coef or 1.0) * x for x in want], abs=1e-4)
            assert all(s.advantages[i] == 0.0 for a, b in env for i in range(a, b))
        assert any(abs(x) > 1e-3 for s in samples for x in s.advantages), "teacher and student never differed"


def test_opsd_user_note_goes_at_the_end_of_the_last_user_message(tokenizer):
    """agent.opsd_hint user: the hint is appended to the prompt's last user message (the prefill
    after the assistant prompt kept); a prompt without a closed user message is refused."""
    from asyncrl.agents.chat import ChatFormatError
    from asyncrl.agents.opsd import opsd

    chat = ChatFormat(tokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "2 + 3"}],
                                           tokenize=False, add_generation_prompt=True) + "2 + 3 ="
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    got = tokenizer.decode(chat.with_user_note_ids(ids, "(The answer is 5.)"))
    assert got == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n2 + 3\n(The answer is 5.)<|im_end|>\n"
                   "<|im_start|>assistant\n2 + 3 =")
    with pytest.raises(ChatFormatError, match="opsd_hint: system"):
        chat.with_user_note_ids(tokenizer("plain text, no template", add_special_tokens=False)["input_ids"], "x")
    with pytest.raises(ValueError, match="placement"):
        opsd(placement="assistant")


async def test_opsd_user_hint_scores_the_teacher_with_the_note(redis_url, server, tokenizer, model_dir):
    """With agent.opsd_hint user, the teacher's context is the prompt with the note in its user
    message (not a system message), and the advantages are recomputed from it here."""
    from asyncrl.models import load_causal_lm

    async with await ReplayBuffer.open(redis_url, "ep7u", _settings()) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "distil"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:opsd_two_calls", opsd_hint="user")
        await _run_until(w, _ready(buf, 1))
        await w.client.close()
        group, samples = await buf.get_group("g0")
        lm = load_causal_lm(model_dir)
        teacher_prompt = ChatFormat(tokenizer).with_user_note_ids(group.prompt_ids, "secret hint")
        assert "distil\nsecret hint<|im_end|>" in tokenizer.decode(teacher_prompt)
        from rollout_server.testing import recompute_logprobs

        for s in samples:
            _, calls = episode_layout(s.segments, len(s.response_ids))
            for a, b in calls:
                before, target = s.response_ids[:a], s.response_ids[a:b]
                teacher = recompute_logprobs(lm, teacher_prompt + before, target, 1.0)
                student = recompute_logprobs(lm, group.prompt_ids + before, target, 1.0)
                assert s.advantages[a:b] == pytest.approx([max(-0.5, min(0.5, t - u)) for t, u in zip(teacher, student)],
                                                          abs=1e-4)
        assert any(abs(x) > 1e-3 for s in samples for x in s.advantages)


async def test_opsd_scores_a_call_cut_by_the_token_limit(redis_url, server, tokenizer, model_dir):
    """Before: an episode that reached rollout.max_response_len ended (token_limit) before the
    decorator scored it, so its tokens trained with advantage 0 and OPSD never pushed back on
    over-long answers. Now the cut call gets its teacher-minus-student advantages."""
    from asyncrl.models import load_causal_lm

    async with await ReplayBuffer.open(redis_url, "ep7c", _settings(max_response_len=6, max_budget=6)) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "go long"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:opsd_cut_by_the_token_limit")
        await _run_until(w, _ready(buf, 1))
        await w.client.close()
        group, samples = await buf.get_group("g0")
        lm = load_causal_lm(model_dir)
        hint = ChatFormat(tokenizer).message_ids("secret hint", "system")
        for s in samples:
            assert s.info["termination"] == "token_limit" and s.reward == 0.0 and len(s.response_ids) == 6
            assert s.advantages == pytest.approx(_opsd_want(lm, hint, group.prompt_ids, s.response_ids), abs=1e-4)
        assert any(abs(x) > 1e-3 for s in samples for x in s.advantages)


async def test_opsd_scoring_aborted_by_weight_updates_is_sent_again(redis_url, server, tokenizer, model_dir):
    """A weight update's pause (rollout.pause_mode: abort) aborts whatever the engine holds, the
    OPSD scoring requests included. Before: the aborted scoring answered with no prompt logprobs
    and the worker stopped ("returned 0 prompt logprobs for N tokens"; the SmolLM2 OPSD run died
    three times in its first two minutes). Now it is scored again; the advantages are the same."""
    from asyncrl.models import load_causal_lm

    async with await ReplayBuffer.open(redis_url, "ep7b", _settings()) as buf:
        await buf.feed([PromptGroup(f"g{i}", _prompt(tokenizer, f"distil {i}"), {}, 2) for i in range(2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:opsd_two_calls")
        stop = asyncio.Event()

        async def aborter():  # abort everything in the engine, over and over, as pauses do
            async with EngineClient(server.url) as c:
                while not stop.is_set():
                    await c.abort(abort_all=True)
                    await asyncio.sleep(0.01)

        storm = asyncio.create_task(aborter())
        try:
            await _run_until(w, _ready(buf, 2), timeout_seconds=180)
        finally:
            stop.set()
            await storm
            await w.client.close()
        assert w.stats.parked_abort > 0, "the storm aborted nothing"
        lm = load_causal_lm(model_dir)
        hint = ChatFormat(tokenizer).message_ids("secret hint", "system")
        for gid in ("g0", "g1"):
            group, samples = await buf.get_group(gid)
            for s in samples:
                for a, b in episode_layout(s.segments, len(s.response_ids))[1]:
                    want = _opsd_want(lm, hint, group.prompt_ids + s.response_ids[:a], s.response_ids[a:b])
                    assert s.advantages[a:b] == pytest.approx(want, abs=1e-4)


# ---------------------------------------------------------------------------------------------- docs
async def test_the_docs_example_workflow_runs(redis_url, server, tokenizer, tmp_path, monkeypatch):
    """docs/agents.md's complete example, extracted from the page and run by a real worker."""
    import re
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "agents.md").read_text()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if b.startswith("# example: docs/agents.md")]
    (tmp_path / "docs_example.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("docs_example", None)
    async with await ReplayBuffer.open(redis_url, "ep8", _settings()) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "guess"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "docs_example:guess_the_number", max_turns=3)
        await _run_until(w, _ready(buf, 1))
        await w.client.close()
        _, samples = await buf.get_group("g0")
        for s in samples:
            assert s.info["termination"] in ("env_done", "turn_limit") and 1 <= s.info["turns"] <= 3
            env, calls = episode_layout(s.segments, len(s.response_ids))
            assert len(calls) == s.info["turns"] and len(env) == len(calls) - 1  # a hint after each wrong guess


# ---------------------------------------------------------------------------------------------- trajectories
@pytest.mark.parametrize("budget", [64, 3])
async def test_two_trajectories_recorded_replayed_and_trained_apart(budget, redis_url, server, tokenizer, tmp_path):
    """A solver and a judge in one episode: one record with segments tagged by trajectory; with a budget
    of 3 tokens the calls are parked and replayed across trajectories without regenerating a token; the
    trainer makes one group of solvers and one of judges, each judge prompted by its own ids."""
    from asyncrl.core.config import load_config
    from trainer.batch import prepare_batch

    async with await ReplayBuffer.open(redis_url, f"ep9-{budget}", _settings(max_budget=budget)) as buf:
        await buf.feed([PromptGroup("g0", _prompt(tokenizer, "solve"), {}, 2)], 0)
        w = _worker(buf, server.url, tokenizer, "agent_workflows:solver_and_judge")
        stats = await _run_until(w, _ready(buf, 1))
        await w.client.close()
        group, samples = await buf.get_group("g0")
        judge_prompt = list(tokenizer(tokenizer.apply_chat_template(agent_workflows.JUDGE_PROMPT, tokenize=False,
                                                                    add_generation_prompt=True),
                                      add_special_tokens=False)["input_ids"])
        model_tokens = 0
        for s in samples:
            trajs = [seg.trajectory for seg in s.segments]
            assert set(trajs) == {0, 1} and s.info["trajectories"] == ["main", "judge"]
            ctx = [seg for seg in s.segments if seg.finish_reason == "ctx"]
            assert len(ctx) == 1 and ctx[0].trajectory == 1
            assert s.response_ids[ctx[0].start:ctx[0].end] == judge_prompt
            model_tokens += sum(seg.end - seg.start for seg in s.segments if seg.finish_reason not in ("obs", "ctx"))
            if budget == 3:
                assert any(seg.finish_reason == "budget" for seg in s.segments) and s.num_resumes >= 1
        assert stats.generated_tokens == model_tokens  # nothing regenerated across replays
        cfg = load_config([], overrides={"model": {"path": "tiny"}, "rollout": {"n_samples_per_prompt": 2},
                                         "agent": {"workflow": "agent_workflows:solver_and_judge"}})
        batch = prepare_batch([{"group_id": "g0", "prompt_ids": group.prompt_ids, "samples": samples}], cfg, 0)
        assert batch.group_ids == ["g0", "g0~judge"]
        solvers = [p for p in batch.samples if p.group_id == "g0"]
        judges = [p for p in batch.samples if p.group_id == "g0~judge"]
        assert len(solvers) == len(judges) == 2
        for p, s in zip(judges, samples):
            assert p.prompt_ids == judge_prompt and p.sample_id == f"{s.sample_id}~judge"
            own = [seg for seg in s.segments if seg.trajectory == 1 and seg.finish_reason != "ctx"]
            assert p.response_ids == [t for seg in own for t in s.response_ids[seg.start:seg.end]]
            assert int(p.loss_mask.sum()) == len(p.response_ids) - sum(
                seg.end - seg.start for seg in own if seg.finish_reason == "obs")
            assert p.reward == s.info["trajectory_rewards"][1]
        for p, s in zip(solvers, samples):
            assert p.prompt_ids == group.prompt_ids and p.reward == 0.5
            assert len(p.response_ids) == sum(seg.end - seg.start for seg in s.segments if seg.trajectory == 0)


def test_calculator_tool_and_call_format():
    from asyncrl.agents.builtin import CalculatorEnv, safe_calculate

    assert safe_calculate("23 * 47") == 1081 and safe_calculate("(2 + 3) * -4 // 3") == -7
    for bad, msg in [("__import__('os')", "only integers"), ("2 ** 100", "only integers"), ("1 // 0", "division"),
                     ("1" * 31, "too large"), ("x" * 201, "longer")]:
        with pytest.raises(ValueError, match=msg):
            safe_calculate(bad)
    env = CalculatorEnv("1081", "<calc>")
    assert env.calculator_call(" 23 * 47</calc>", first=True) == "23 * 47"  # the prefill opened the call
    assert env.calculator_call("23*47 = 1081", first=True) == "23*47"       # closing tag optional
    assert env.calculator_call("23*47 = 1081") is None                       # later calls need their own tag
    assert env.calculator_call("so <calc>100 / 7</calc>") == "100 // 7"     # integer division
    assert env.calculator_call("Answer: 1081") is None


def test_opsd_teacher_probe_scores_every_teacher_context(tmp_path, tiny_model_dir):
    """bench/opsd_teacher_probe.py on the tiny model: the student and the three teacher contexts
    (system message, user note, the task's system prompt) are sampled, scored and written."""
    import importlib.util
    import json as _json

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("opsd_teacher_probe", root / "bench" / "opsd_teacher_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    out = tmp_path / "probe.json"
    assert probe.main(["--config", str(root / "configs" / "tiny.yaml"), "--model", str(tiny_model_dir),
                       "--problems", "2", "--samples", "2", "--json", str(out)]) == 0
    got = _json.loads(out.read_text())
    assert set(got["sampled_accuracy"]) == {"student", "system message (opsd_hint system)", "user note (opsd_hint user)",
                                            "appended to the task's system prompt"}
    assert all(0.0 <= a <= 1.0 for a in got["sampled_accuracy"].values())
    assert set(got["logratio_mean_per_token"]) == set(got["sampled_accuracy"]) - {"student"}
