"""The built-in workflow ``openai_harness``: an existing OpenAI-client agent program as the episode.

For each episode the harness command (``agent.harness_command``, an argv list) is started as a
subprocess with, in its environment:

* ``OPENAI_BASE_URL=http://127.0.0.1:<port>/v1``: the session app of this rollout worker
  (:class:`asyncrl.agents.sessions.SessionServer`);
* ``OPENAI_API_KEY=<a fresh random session key>``: selects this episode (never logged);
* ``ASYNCRL_TASK=<JSON>``: ``metadata`` (the task's, e.g. ``gold``), ``messages`` (the prompt
  as chat messages: the harness's first request must send exactly these), ``sample_id``,
  ``seed``, ``max_turns``, ``max_tokens_per_turn``.

Only a few variables of the worker's environment are passed on (:data:`PASSED_ENV`): the
worker's secrets (Redis password, engine API key) never reach a harness.

The harness's chat calls are the episode's model calls (:class:`asyncrl.agents.sessions.Session`);
it ends by posting ``{"reward": r, "metrics": {...}}`` to ``/v1/episode/reward`` and exiting.
The workflow returns ``Episode(r, "env_done", metrics)`` (``turn_limit`` when the harness was
refused a call past ``agent.max_turns``); the reward applies to every trajectory of the episode
(a history the harness rewrote starts a new one, :mod:`asyncrl.agents.sessions`). A harness that exits without posting a reward fails
the episode (``WorkflowError``, counted as ``failed_samples:workflow_error``, with its exit code
and the tail of its stderr); one that runs past ``agent.episode_timeout_seconds`` is killed
(termination ``timeout``); one whose worker dies gets SIGKILL (Linux's parent-death signal). When a model call is interrupted (budget, weight update, drain) the
harness is killed and the episode parked; on resume the harness runs again from the start and
its calls are answered from the record (durable execution): this needs a harness that is
deterministic given ``ASYNCRL_TASK`` and the replies it gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import deque
from dataclasses import dataclass
from typing import Any

from asyncrl.agents.sessions import Session, SessionServer, prompt_messages, task_json
from asyncrl.agents.model import EpisodeModel
from asyncrl.agents.workflow import Episode, EpisodeTask, EpisodeTimeout

__all__ = ["HarnessEnv", "HarnessError", "openai_harness", "PASSED_ENV", "REWARD_GRACE_SECONDS"]

#: Variables of the worker's environment a harness inherits (nothing else: no secrets).
PASSED_ENV = ("PATH", "PYTHONPATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "OMP_NUM_THREADS",
              "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")
#: Seconds a harness may take to exit after posting its reward before it is killed.
REWARD_GRACE_SECONDS = 5.0
#: Largest ``ASYNCRL_TASK`` (bytes; Linux limits one environment string to 128 KiB).
MAX_TASK_BYTES = 100_000


class HarnessError(RuntimeError):
    """The harness failed the episode (exited without a reward, could not start); says why."""


@dataclass
class HarnessEnv:
    """The environment of ``openai_harness``: the command and its limits (from the ``agent`` section)."""

    command: list[str]
    timeout: float
    max_tokens: int

    @classmethod
    def from_agent(cls, agent: Any) -> "HarnessEnv":
        """Raises HarnessError when ``agent.harness_command`` is not set."""
        if not agent.harness_command:
            raise HarnessError("agent.workflow openai_harness needs agent.harness_command (the agent program's argv)")
        return cls(list(agent.harness_command), float(agent.episode_timeout_seconds), int(agent.max_tokens_per_turn))


def _served_name(tokenizer: Any) -> str:
    name = os.path.basename(str(getattr(tokenizer, "name_or_path", "") or "").rstrip("/"))
    return name or "policy"


def _die_with_parent() -> None:
    """In the harness (before exec): SIGKILL when the rollout worker dies (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the harness outlives a killed worker until its next call fails
        pass


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the harness and any children it started


async def _stderr_tail(stream: asyncio.StreamReader, tail: deque) -> None:
    while True:
        line = await stream.readline()
        if not line:
            return
        tail.append(line.decode("utf-8", "replace").rstrip()[:500])


async def openai_harness(task: EpisodeTask, model: EpisodeModel, env: HarnessEnv) -> Episode:
    """Run the harness program against a session for this episode (module docstring).

    Raises:
        HarnessError: the harness exited without posting a reward, or the prompt cannot be given
            to it as chat messages.
        EpisodeTimeout: the harness ran past ``agent.episode_timeout_seconds`` (it is killed).
        whatever a model call raised (an interrupt of the episode, the token limit, an engine error).
    """
    try:
        messages = prompt_messages(model.tokenizer, list(task.prompt_ids))
    except ValueError as exc:
        raise HarnessError(str(exc)) from None
    payload = task_json(task, messages, model.max_turns, env.max_tokens)
    if len(payload.encode()) > MAX_TASK_BYTES:
        raise HarnessError(f"ASYNCRL_TASK would be {len(payload.encode())} bytes, over {MAX_TASK_BYTES}: "
                           "the task's metadata is too large for a harness")
    server = await SessionServer.shared()
    session = Session(model, model.chat, _served_name(model.tokenizer), model.temperature)
    key = server.register(session)
    child_env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    child_env.update(OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY=key, ASYNCRL_TASK=payload)
    tail: deque = deque(maxlen=20)
    proc = None
    reader = None
    waiters: list[asyncio.Task] = []
    try:
        try:
            proc = await asyncio.create_subprocess_exec(*env.command, env=child_env, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.DEVNULL,
                                                        stderr=asyncio.subprocess.PIPE, start_new_session=True,
                                                        preexec_fn=_die_with_parent)
        except OSError as exc:
            raise HarnessError(f"cannot start agent.harness_command {env.command[0]!r}: {exc}") from None
        reader = asyncio.create_task(_stderr_tail(proc.stderr, tail))  # type: ignore[arg-type]
        exited = asyncio.create_task(proc.wait())
        finished = asyncio.create_task(session.done.wait())
        waiters = [exited, finished]
        await asyncio.wait(waiters, timeout=env.timeout, return_when=asyncio.FIRST_COMPLETED)
        if session.failure is not None:
            raise session.failure
        if session.reward is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), REWARD_GRACE_SECONDS)
            termination = "turn_limit" if session.turn_limited else "env_done"
            metrics = {**session.metrics, "sessions_history_mismatch": float(session.history_mismatches),
                       "harness_calls": float(session.calls)}
            return Episode(session.reward, termination, metrics)
        if proc.returncode is None:
            raise EpisodeTimeout(f"the harness of sample {task.sample_id} ran past {env.timeout:.0f} s (killed)")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(reader), 2.0)
        stderr = " | ".join(tail) or "(nothing on stderr)"
        raise HarnessError(f"the harness exited with code {proc.returncode} without posting a reward after "
                           f"{session.calls} calls ({session.history_mismatches} new trajectories after a history mismatch); "
                           f"its stderr ends: {stderr[-1500:]}")
    finally:
        server.unregister(key)
        if proc is not None:
            _kill(proc)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 10.0)
        for t in waiters + ([reader] if reader is not None else []):
            t.cancel()
