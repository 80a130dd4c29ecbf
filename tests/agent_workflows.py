"""Workflows used by tests/test_agents.py (importable by rollout-server child processes too)."""

from __future__ import annotations

import random
import zlib

from asyncrl.agents import Episode

#: observations of :func:`three_turns`, by turn
FEEDBACK = ["first feedback", "second feedback, longer", "third"]


async def three_turns(task, model, env):
    """Three model calls with an observation after each of the first two; reward = output tokens / 100."""
    n = 0
    for turn in range(3):
        out = await model.generate(max_tokens=6)
        n += len(out.token_ids)
        if turn < 2:
            await model.observe(FEEDBACK[turn], role="user")
    return Episode(n / 100.0, "env_done", {"tokens": float(n)})


def text_digest(texts) -> float:
    """A reward that depends on every character of every call's text: sum of crc32(text) mod 997, / 1e4."""
    return sum(zlib.crc32(t.encode()) % 997 for t in texts) / 1e4


async def three_turns_text(task, model, env):
    """:func:`three_turns` whose reward is :func:`text_digest` of the calls' texts (what a verifier reads)."""
    texts = []
    for turn in range(3):
        out = await model.generate(max_tokens=6)
        texts.append(out.text)
        if turn < 2:
            await model.observe(FEEDBACK[turn], role="user")
    return Episode(text_digest(texts), "env_done", {})


async def with_tool(task, model, env):
    """A tool call between two model calls; the tool's result is the observation."""
    out = await model.generate(max_tokens=5)
    ok, text = await model.tool(lambda k: f"{k} tokens", len(out.token_ids))
    await model.observe(text, role="tool")
    out2 = await model.generate(max_tokens=5)
    return Episode(1.0 if ok else 0.0, "env_done", {"tool_ok": float(ok)})


async def failing_tool(task, model, env):
    """A tool that raises and one that times out: both are observations, the episode goes on."""
    await model.generate(max_tokens=3)

    def boom():
        raise RuntimeError("tool exploded")

    ok1, text1 = await model.tool(boom)
    ok2, text2 = await model.tool(__import__("time").sleep, 5, timeout=0.2)
    await model.observe(text1 + " / " + text2, role="tool")
    await model.generate(max_tokens=3)
    return Episode(0.5, "env_done", {"ok1": float(ok1), "ok2": float(ok2)})


async def unseeded(task, model, env):
    """Not deterministic: its observation depends on an unseeded random number."""
    await model.generate(max_tokens=6)
    await model.observe(f"noise {random.random()}", role="user")
    await model.generate(max_tokens=6)
    return Episode(0.0)


async def raises(task, model, env):
    """The workflow itself fails after one call."""
    await model.generate(max_tokens=3)
    raise ValueError("workflow bug")


async def step_advantages(task, model, env):
    """Sets precomputed advantages on every step: a scalar on the first, per token on the second."""
    await model.generate(max_tokens=4)
    await model.observe("ok", role="user")
    out = await model.generate(max_tokens=4)
    model.steps[0].advantages = 0.5
    model.steps[1].advantages = [float(i) for i in range(len(out.token_ids))]
    return Episode(0.0)


LONG_TURNS = 8


def slow_tool(marker_dir: str, sample_id: str, k: int, n: int) -> str:
    """A tool that takes 0.6 s; while it runs, a marker file says so (the kill test waits for one)."""
    import os
    import time

    path = os.path.join(marker_dir, f"{sample_id.replace('/', '_')}-{k}") if marker_dir else ""
    if path:
        open(path, "w").close()
    time.sleep(0.6)
    if path:
        os.unlink(path)
    return f"call {k} gave {n} tokens"


async def long_episode(task, model, env):
    """LONG_TURNS calls of up to 6 tokens, each followed by a slow tool call whose result is observed."""
    import os

    marker_dir = os.environ.get("ASYNCRL_TEST_TOOL_MARKERS", "")
    n = 0
    for k in range(LONG_TURNS):
        out = await model.generate(max_tokens=6)
        n += len(out.token_ids)
        if k == LONG_TURNS - 1:
            break
        ok, text = await model.tool(slow_tool, marker_dir, task.sample_id, k, len(out.token_ids))
        await model.observe(text, role="tool")
    return Episode(n / 100.0, "env_done", {"tokens": float(n)})


from asyncrl.agents.opsd import opsd  # noqa: E402


@opsd(privileged=lambda task: "secret hint", clip=0.5)
async def opsd_two_calls(task, model, env):
    """Two calls with an observation between them, trained by self-distillation (clip 0.5)."""
    await model.generate(max_tokens=5)
    await model.observe("go on", role="user")
    await model.generate(max_tokens=5)
    return Episode(0.25)


@opsd(privileged=lambda task: "secret hint", clip=0.5)
async def opsd_cut_by_the_token_limit(task, model, env):
    """One call longer than max_response_len: cut by the token limit, still distilled."""
    await model.generate(max_tokens=64)
    return Episode(1.0)


JUDGE_PROMPT = [{"role": "user", "content": "Is the answer right?"}]


async def solver_and_judge(task, model, env):
    """Two trajectories: the solver answers, a judge (its own prompt) speaks, the solver answers again."""
    await model.generate(max_tokens=5)
    judge = await model.trajectory("judge", messages=JUDGE_PROMPT)
    await judge.generate(max_tokens=4)
    await model.observe("the judge spoke", role="user")
    await model.generate(max_tokens=5)
    await judge.observe("and now?", role="user")
    await judge.generate(max_tokens=4)
    return Episode(0.5, "env_done", trajectory_rewards={"judge": 1.0 if len(model.steps[0].output.token_ids) % 2 else 0.0})


#: remote calculator calls of :func:`remote_calculator_calls`
REMOTE_CALLS = 4


def remote_expression(seed: int, k: int, n_tokens: int) -> str:
    """The expression of call k of :func:`remote_calculator_calls` (a pure function of the episode)."""
    return f"{seed % 89 + 2}*{k + 3}+{n_tokens}"


async def remote_calculator_calls(task, model, env):
    """REMOTE_CALLS rounds of (a model call of up to 4 tokens, a calculator call on the environment
    server through the built-in ``CalculatorEnv.calculate``, its result observed); then one more call.
    Reward: the fraction of calculator calls that returned a result."""
    ok_calls = 0
    for k in range(REMOTE_CALLS):
        out = await model.generate(max_tokens=4)
        ok, text = await env.calculate(model, remote_expression(task.seed, k, len(out.token_ids)))
        ok_calls += ok
        await model.observe(f"<result>{text}</result>" if ok else text, role="tool")
    await model.generate(max_tokens=4)
    return Episode(ok_calls / REMOTE_CALLS, "env_done", {"ok_calls": float(ok_calls)})


async def observation_overflow(task, model, env):
    """One call, then an observation longer than what is left of max_response_len: TokenLimit, uncaught."""
    await model.generate(max_tokens=4)
    await model.observe("error: " + "this observation does not fit " * 40, role="tool")
    return Episode(1.0)
