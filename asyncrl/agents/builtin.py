"""Built-in workflows and environments: ``arithmetic_retry`` and ``calculator`` (docs/agents.md).

* ``arithmetic_retry``: the model answers the arithmetic problem; if the answer is wrong the
  environment says so (``"Wrong answer. Try again."``, a user message that re-opens the
  assistant turn with the task's prefill) and the model tries again, up to ``agent.max_turns``
  calls. Reward: ``agent.turn_discount ** (k - 1)`` for a correct answer at call k, else 0.
* ``arithmetic_opsd``: the single-turn task (one call) trained by on-policy self-distillation
  (:mod:`asyncrl.agents.opsd`): the teacher is the policy told the gold answer; the reward
  (correctness) is logged, the advantages are the teacher-minus-student log-ratios.
* ``calculator``: harder arithmetic where the model may call a calculator by writing
  ``<calc>EXPRESSION</calc>`` (the closing tag is optional; ``/`` is integer division); the result comes back as a ``tool`` message
  (``<result>VALUE</result>``, or ``error: ...`` for an expression the calculator refuses), and
  the model continues. With ``agent.env_server.enabled`` the calculator runs on the
  environment server (:mod:`asyncrl.env_server`), with a deadline and a measured latency per
  call. The first output without a calculator call is the final answer; reward 1 when it is
  correct (``Answer: N``, the single-turn task's reward), else 0.
* ``openai_harness``: an existing agent program calling an OpenAI-compatible chat API
  (``agent.harness_command``) runs as the episode, through a session on the rollout worker
  (:mod:`asyncrl.agents.harness`, :mod:`asyncrl.agents.sessions`).

Answers are checked with :func:`asyncrl.tasks.rewards.check_answer` (the single-turn task's
math-verify reward) in a thread, so a slow check never blocks the worker's event loop.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

from asyncrl.agents.harness import openai_harness
from asyncrl.agents.opsd import opsd
from asyncrl.agents.model import EpisodeModel
from asyncrl.agents.workflow import Episode, EpisodeTask
from asyncrl.env_server.tools import safe_calculate
from asyncrl.tasks.rewards import check_answer

__all__ = ["ArithmeticRetryEnv", "CalculatorEnv", "arithmetic_retry", "arithmetic_opsd", "calculator",
           "safe_calculate", "CALC_PATTERN", "BUILTIN_WORKFLOWS", "ENV_SERVER_WORKFLOWS", "openai_harness"]

#: A calculator call in the model's output: ``<calc>`` then an integer expression (digits, spaces,
#: ``+ - * / % ( )``); the closing ``</calc>`` is optional (the 135M model rarely writes it).
CALC_PATTERN = re.compile(r"<calc>\s*([0-9][0-9+\-*/%() ]{0,198})")


async def _correct(text: str, gold: str) -> bool:
    return (await asyncio.to_thread(check_answer, text, gold)).correct


@dataclass
class ArithmeticRetryEnv:
    """The environment of ``arithmetic_retry``: checks answers, writes the feedback."""

    gold: str
    prefill: str
    discount: float

    @classmethod
    def for_task(cls, task: EpisodeTask, discount: float) -> "ArithmeticRetryEnv":
        return cls(str(task.metadata.get("gold", "")), str(task.metadata.get("response_prefix") or ""), discount)

    async def is_correct(self, output_text: str) -> bool:
        """The answer in ``prefill + output_text`` equals the gold (the single-turn reward)."""
        return await _correct(self.prefill + output_text, self.gold)

    def feedback(self) -> str:
        return "Wrong answer. Try again."


async def arithmetic_retry(task: EpisodeTask, model: EpisodeModel, env: ArithmeticRetryEnv) -> Episode:
    """Answer; on a wrong answer hear so and retry, up to ``agent.max_turns`` calls (module docstring)."""
    turn = 0
    while True:
        turn += 1
        out = await model.generate()
        if await env.is_correct(out.text):
            return Episode(env.discount ** (turn - 1), "env_done", {"correct": 1.0, "turn_correct": float(turn)})
        if model.turns_left == 0:
            return Episode(0.0, "turn_limit", {"correct": 0.0})
        await model.observe(env.feedback(), role="user", prefill=env.prefill)


@opsd()
async def arithmetic_opsd(task: EpisodeTask, model: EpisodeModel, env: ArithmeticRetryEnv) -> Episode:
    """One answer, trained by on-policy self-distillation (module docstring)."""
    out = await model.generate()
    ok = await env.is_correct(out.text)
    return Episode(1.0 if ok else 0.0, "env_done", {"correct": float(ok), "turn_correct": float(ok)})


@dataclass
class CalculatorEnv:
    """The environment of ``calculator``: runs calculator calls, checks the final answer.

    Attributes:
        gold: the task's answer.
        prefill: the task's response prefix (it opens the first call).
        remote: the environment server's client when ``agent.env_server.enabled`` (the
            calculator runs there, with its deadline and latency); None: in-process.
    """

    gold: str
    prefill: str
    remote: Any = None

    @classmethod
    def for_task(cls, task: EpisodeTask, remote: Any = None) -> "CalculatorEnv":
        return cls(str(task.metadata.get("gold", "")), str(task.metadata.get("response_prefix") or ""), remote)

    def calculator_call(self, output_text: str, first: bool = False) -> str | None:
        """The expression of the first calculator call of an output (of ``prefill + output`` for
        the episode's first call, which the task's prefill opens), or None."""
        m = CALC_PATTERN.search((self.prefill if first else "") + output_text)
        return m.group(1).strip().replace("/", "//").replace("////", "//") if m else None

    async def calculate(self, model: EpisodeModel, expression: str) -> tuple[bool, str]:
        """Run one calculator call through ``model.tool``: ``(ok, value or "error: ...")``.

        Remote calls carry a call id that is the same on every replay of the episode
        (``<sample id>:<trajectory>:<tool call index>``), so a replayed call draws the same latency.

        Raises:
            EnvServerUnavailable: the environment server stayed unreachable past its outage budget.
        """
        if self.remote is None:
            return await model.tool(safe_calculate, expression)
        sample = _CALL_ID_UNSAFE.sub("_", model.task.sample_id or "episode")[:200]
        call_id = f"{sample}:{model.index}:{model.tool_calls}"

        async def remote_calculate(expression: str, call_id: str) -> str:
            # the replay flag is read when the call runs, and is not an argument: the worker's tool memo
            # (EpisodeModel.tool_memo) keys a call by its arguments, the same live and in a replay
            return await self.remote.calculate(expression, call_id, model.replaying)

        return await model.tool(remote_calculate, expression, call_id, timeout=self.remote.max_call_seconds)

    async def is_correct(self, output_text: str) -> bool:
        return await _correct(output_text, self.gold)


#: Characters a call id may not hold (asyncrl.env_server.schemas.CALL_ID_PATTERN).
_CALL_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.:/~\-]")


async def calculator(task: EpisodeTask, model: EpisodeModel, env: CalculatorEnv) -> Episode:
    """Solve with an optional calculator tool (module docstring)."""
    while True:
        out = await model.generate()
        expr = env.calculator_call(out.text, first=model.turns == 1)
        if expr is None:
            ok = await env.is_correct(out.text)
            return Episode(1.0 if ok else 0.0, "env_done", {"correct": float(ok)})
        if model.turns_left == 0:
            return Episode(0.0, "turn_limit", {"correct": 0.0})
        ok, result = await env.calculate(model, expr)
        await model.observe(f"<result>{result}</result>" if ok else result, role="tool")


def _harness_env(agent: Any, remote: Any = None):
    from asyncrl.agents.harness import HarnessEnv

    env = HarnessEnv.from_agent(agent)
    return lambda task: env


def _arith_env(agent: Any, remote: Any = None):
    return lambda task: ArithmeticRetryEnv.for_task(task, agent.turn_discount)


def _calc_env(agent: Any, remote: Any = None):
    return lambda task: CalculatorEnv.for_task(task, remote)


#: name -> (workflow, env factory builder taking the ``agent`` config section and the environment
#: server's client, or None when ``agent.env_server`` is off)
#: built-in workflows whose tool runs on the environment server when ``agent.env_server.enabled``
ENV_SERVER_WORKFLOWS = ("calculator",)

BUILTIN_WORKFLOWS = {
    "arithmetic_retry": (arithmetic_retry, _arith_env),
    "calculator": (calculator, _calc_env),
    "arithmetic_opsd": (arithmetic_opsd, _arith_env),
    "openai_harness": (openai_harness, _harness_env),
}
