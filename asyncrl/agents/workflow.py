"""The workflow API: multi-turn episodes written as plain async Python (docs/agents.md).

A **workflow** is ``async def run(task, model, env) -> Episode``:

* ``task`` (:class:`EpisodeTask`): the prompt group's problem (its ``metadata``, e.g. the gold
  answer), the prompt's token ids, and a ``seed`` fixed per sample (so an environment seeded with
  it behaves the same when the episode is replayed).
* ``model`` (:class:`EpisodeModel`): asyncrl's handle to the rollout engine for this episode's
  trajectory. ``await model.generate()`` continues the conversation and returns the text with the
  exact token ids, behaviour logprobs and per-token policy versions (:class:`ModelOutput`);
  ``await model.observe(text, role=...)`` adds an environment message, tokenised once with the
  chat template's delimiters (:mod:`asyncrl.agents.chat`); ``await model.tool(fn, *args)`` runs a
  tool with a timeout (a failing tool is an observation, not a crash). Every model call is a
  :class:`Step` in ``model.steps``.
* ``env``: what the configured environment factory built for this task (None without one).

Token in, token out: the trajectory's context is the prompt ids followed by every output and
observation id in order; it is what the buffer stores and what the trainer trains on, with the
loss mask covering model tokens only.

Durable execution (as in Temporal): every model call's tokens are recorded in the buffer as
they stream. When an episode is interrupted (token budget, weight update, SIGTERM, a kill -9 of
its rollout server) it resumes on any server by running the workflow again from the start: model
calls and observations are answered from the recorded history until it is exhausted, then the
episode continues live. A workflow must therefore be deterministic given ``task`` (seed its
randomness with ``task.seed``); a replayed call or observation that differs from the record
raises :class:`NonDeterministicWorkflow`, and the episode restarts from its prompt, counted as
``restarted_samples:nondeterministic``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Sequence

from asyncrl.agents.chat import ChatFormat

__all__ = [
    "TERMINATIONS",
    "EpisodeTask",
    "ModelOutput",
    "Step",
    "Episode",
    "EpisodeModel",
    "TokenLimit",
    "EpisodeTimeout",
    "EpisodeInterrupt",
    "NonDeterministicWorkflow",
    "RecordedEvent",
    "RecordedHistory",
    "LiveCalls",
    "Workflow",
]

#: Why an episode ended (metric label ``termination``): the environment said done, the turn
#: limit, the token limit (``rollout.max_response_len`` for the whole conversation), the episode
#: timeout, or the workflow raised.
TERMINATIONS = ("env_done", "turn_limit", "token_limit", "timeout", "error")


class TokenLimit(Exception):
    """The conversation reached ``rollout.max_response_len`` tokens: no more calls or observations.

    A workflow may catch it and return an :class:`Episode`; uncaught, the episode ends with
    termination ``token_limit`` and reward 0.
    """


class EpisodeTimeout(Exception):
    """The episode ran longer than ``agent.episode_timeout_seconds`` (checked at each call).

    Uncaught, the episode ends with termination ``timeout`` and reward 0.
    """


class EpisodeInterrupt(BaseException):
    """Control flow of the runner (the episode is parked, its lease lost, ...): not an error.

    A ``BaseException`` so that a workflow's ``except Exception`` cannot swallow it.
    """


class NonDeterministicWorkflow(EpisodeInterrupt):
    """A replayed model call or observation differs from the recorded history (names which)."""


@dataclass
class EpisodeTask:
    """What a workflow is asked to do.

    Attributes:
        metadata: the prompt group's task data (``gold``, ``expression``, ... from asyncrl.tasks).
        prompt_ids: (P,) the prompt's token ids (chat-templated), the trajectory's first context.
        prompt_text: the prompt decoded (for reading; never re-tokenised).
        seed: fixed per sample; seed the environment with it so that a replay is identical.
        sample_id: the buffer's sample id (for logs).
    """

    metadata: dict[str, Any]
    prompt_ids: list[int]
    prompt_text: str
    seed: int
    sample_id: str = ""

    def __getitem__(self, key: str) -> Any:
        return self.metadata[key]


@dataclass
class ModelOutput:
    """One model call's output: ``token_ids``, ``logprobs`` and ``versions`` are aligned, shape (T,).

    ``finish_reason``: ``stop`` (end of turn / a stop string) or ``length`` (the call's
    ``max_tokens``). ``replayed``: answered from the recorded history.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    replayed: bool = False


@dataclass
class Step:
    """One model call of the trajectory.

    Attributes:
        index: 0-based call number.
        start: offset of the call's first token in the trajectory's response (after the prompt).
        output: the call's :class:`ModelOutput`.
        observation_ids: environment ids appended after the call (empty until observed).
        reward: optional per-step reward (read by a ``trajectory_grouping_hook``).
        advantages: optional precomputed advantage: one number, or one per output token. When
            every step of every episode of a group sets it, the advantage estimator is skipped.
    """

    index: int
    start: int
    output: ModelOutput
    observation_ids: list[int] = field(default_factory=list)
    reward: float | None = None
    advantages: float | list[float] | None = None


@dataclass
class Episode:
    """What a workflow returns.

    Attributes:
        reward: the trajectory's scalar reward (finite).
        termination: one of :data:`TERMINATIONS`.
        metrics: numbers to log with the episode (e.g. ``{"correct": 1.0}``).
    """

    reward: float
    termination: str = "env_done"
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.termination not in TERMINATIONS:
            raise ValueError(f"Episode.termination must be one of {TERMINATIONS}, got {self.termination!r}")


Workflow = Callable[[EpisodeTask, "EpisodeModel", Any], Awaitable[Episode]]


@dataclass
class RecordedEvent:
    """One event of a recorded episode: a model call (``kind == "model"``) or an observation.

    ``complete`` is False for a model call that was interrupted (it continues live).
    """

    kind: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    complete: bool = True
    finish_reason: str = "stop"


class RecordedHistory:
    """The events of an episode as the buffer recorded them, consumed in order by a replay.

    Built by :meth:`from_record` from the sample's response arrays and segments (segments
    ``turn`` end a model call, ``obs`` hold observations; other segment ends interrupt a call).
    """

    def __init__(self, events: Sequence[RecordedEvent]) -> None:
        self.events = list(events)
        self.pos = 0

    @classmethod
    def from_record(cls, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                    segments: Sequence[Any], max_tokens_of: Callable[[int], int] | None = None) -> "RecordedHistory":
        """Events of a record.

        Args:
            ids, logprobs, versions: (R,) the sample's response arrays.
            segments: :class:`asyncrl.types.Segment` list (``start``, ``end``, ``finish_reason``).
            max_tokens_of: unused hook for call limits (kept for symmetry with live calls).

        Raises:
            ValueError: segments that do not tile ``[0, R)`` in order.
        """
        events: list[RecordedEvent] = []
        cur: RecordedEvent | None = None
        pos = 0
        for seg in segments:
            if seg.start != pos or seg.end < seg.start or seg.end > len(ids):
                raise ValueError(f"episode segments do not tile the response: segment [{seg.start}, {seg.end}) at "
                                 f"offset {pos} of {len(ids)} tokens")
            span = slice(seg.start, seg.end)
            pos = seg.end
            if seg.finish_reason == "obs":
                if cur is not None:
                    raise ValueError(f"an observation at offset {seg.start} follows an unfinished model call")
                events.append(RecordedEvent("obs", list(ids[span])))
                continue
            if cur is None:
                cur = RecordedEvent("model", [], [], [], complete=False)
                events.append(cur)
            cur.token_ids += list(ids[span])
            cur.logprobs += list(logprobs[span])
            cur.versions += list(versions[span])
            if seg.finish_reason in ("turn", "stop", "length"):
                cur.complete = True
                cur = None
        if pos < len(ids):  # tokens after the last closed segment (not expected; treated as a partial call)
            if cur is None:
                cur = RecordedEvent("model", [], [], [], complete=False)
                events.append(cur)
            cur.token_ids += list(ids[pos:])
            cur.logprobs += list(logprobs[pos:])
            cur.versions += list(versions[pos:])
        return cls(events)

    @property
    def exhausted(self) -> bool:
        """True once every recorded event was consumed."""
        return self.pos >= len(self.events)

    def peek(self) -> RecordedEvent | None:
        return None if self.exhausted else self.events[self.pos]

    def take(self) -> RecordedEvent:
        ev = self.events[self.pos]
        self.pos += 1
        return ev


class LiveCalls(Protocol):
    """What the rollout worker provides to run calls live (rollout_server/episodes.py).

    ``generate`` streams one call into the buffer and returns ``(ids, logprobs, versions,
    finish)`` with ``finish`` ``stop`` or ``length`` (the call's own limit); it raises
    :class:`TokenLimit` when the conversation reached ``max_response_len`` (the output is then
    kept in ``last_output``) and an :class:`EpisodeInterrupt` when the episode is parked.
    ``observe`` appends observation ids (raises :class:`TokenLimit` when they do not fit).
    """

    length: int

    async def generate(self, context_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float], list[int], str]: ...

    async def observe(self, ids: list[int], version: int) -> None: ...


class EpisodeModel:
    """A workflow's handle to the policy for one trajectory (see the module docstring).

    Args:
        task: the :class:`EpisodeTask` (its prompt ids open the context).
        tokenizer: decodes outputs; :class:`ChatFormat` tokenises observations.
        history: the recorded events to replay first (empty for a new episode).
        live: runs calls live once the history is exhausted; None in a pure replay (scoring a
            complete episode): a call past the record then raises :class:`NonDeterministicWorkflow`,
            or :class:`TokenLimit` when the record ended at the token limit.
        max_tokens: default ``max_tokens`` of a call (``agent.max_tokens_per_turn``).
        max_turns: model calls allowed (``agent.max_turns``); ``model.turns_left`` tells the
            workflow how many remain, and one more call raises RuntimeError.
        tool_timeout: seconds a :meth:`tool` call may take.
        episode_timeout: seconds of live time before the next call raises :class:`EpisodeTimeout`.
        ended_at_token_limit: the record ended at the token limit (for a pure replay).
    """

    def __init__(self, task: EpisodeTask, tokenizer: Any, chat: ChatFormat, history: RecordedHistory,
                 live: LiveCalls | None, *, max_tokens: int, max_turns: int, tool_timeout: float = 10.0,
                 episode_timeout: float = 600.0, ended_at_token_limit: bool = False) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.chat = chat
        self.history = history
        self.live = live
        self.max_tokens = int(max_tokens)
        self.max_turns = int(max_turns)
        self.tool_timeout = float(tool_timeout)
        self.episode_timeout = float(episode_timeout)
        self.ended_at_token_limit = ended_at_token_limit
        self.steps: list[Step] = []
        self.response_ids: list[int] = []
        self.tool_calls = 0
        self.tool_failures = 0
        self.replayed_calls = 0
        self.at_token_limit = False
        #: ``await scorer(context_ids, target_ids) -> logprobs of target_ids`` from the engine's prompt
        #: logprobs (set by the rollout worker; used by :func:`asyncrl.agents.opsd.opsd`); None in ``asyncrl eval``
        self.scorer: Callable[[list[int], list[int]], Awaitable[list[float]]] | None = None
        #: the same for the OPSD teacher when it is another model (``agent.opsd_teacher_url``); None: ``scorer``
        self.teacher_scorer: Callable[[list[int], list[int]], Awaitable[list[float]]] | None = None
        self._t0 = time.monotonic()

    # ------------------------------------------------------------------ reading
    @property
    def context_ids(self) -> list[int]:
        """(P + R,) the prompt followed by every output and observation id so far."""
        return list(self.task.prompt_ids) + self.response_ids

    @property
    def turns(self) -> int:
        """Model calls made so far (replayed ones included)."""
        return len(self.steps)

    @property
    def turns_left(self) -> int:
        """Model calls left under ``agent.max_turns``."""
        return max(0, self.max_turns - len(self.steps))

    @property
    def last_version(self) -> int:
        """Policy version of the last model token (0 before the first call)."""
        for s in reversed(self.steps):
            if s.output.versions:
                return s.output.versions[-1]
        return 0

    # ------------------------------------------------------------------ calls
    def _check_live_time(self) -> None:
        if time.monotonic() - self._t0 > self.episode_timeout:
            raise EpisodeTimeout(f"episode of sample {self.task.sample_id} ran past {self.episode_timeout:.0f} s")

    async def generate(self, max_tokens: int | None = None) -> ModelOutput:
        """Continue the conversation with one model call.

        Args:
            max_tokens: this call's output limit (default ``agent.max_tokens_per_turn``).

        Returns:
            the call's :class:`ModelOutput` (also appended to ``steps``).

        Raises:
            TokenLimit: the conversation is at ``max_response_len`` (or reached it in this call:
                the output is still recorded in ``steps`` before the next call raises).
            RuntimeError: more than ``agent.max_turns`` calls.
            EpisodeTimeout: past ``agent.episode_timeout_seconds``.
            NonDeterministicWorkflow: the record holds an observation here.
        """
        limit = int(max_tokens or self.max_tokens)
        if limit < 1:
            raise ValueError(f"max_tokens must be >= 1, got {limit}")
        if self.at_token_limit:
            raise TokenLimit(f"sample {self.task.sample_id}: the conversation is at the token limit")
        if len(self.steps) >= self.max_turns:
            raise RuntimeError(f"the workflow made more than agent.max_turns={self.max_turns} model calls; "
                               "check model.turns_left before calling")
        start = len(self.response_ids)
        ev = self.history.peek()
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        replayed = False
        finish = "stop"
        if ev is not None:
            if ev.kind != "model":
                raise NonDeterministicWorkflow(
                    f"call {len(self.steps)} of sample {self.task.sample_id}: the record holds an observation "
                    "here, the workflow asked the model")
            self.history.take()
            ids, lps, vers = list(ev.token_ids), list(ev.logprobs), list(ev.versions)
            if len(ids) > limit:
                raise NonDeterministicWorkflow(
                    f"call {len(self.steps)} of sample {self.task.sample_id}: recorded {len(ids)} tokens, more than "
                    f"this call's max_tokens {limit}")
            if ev.complete:
                replayed = True
                finish = "length" if (len(ids) >= limit and not self._ends_turn(ids)) else "stop"
                self.replayed_calls += 1
        if not replayed:
            if self.live is None:
                if self.ended_at_token_limit and ev is None:
                    self.at_token_limit = True
                    raise TokenLimit(f"sample {self.task.sample_id}: the recorded episode ended at the token limit")
                raise NonDeterministicWorkflow(
                    f"call {len(self.steps)} of sample {self.task.sample_id}: the complete record has no such call")
            self._check_live_time()
            context = self.context_ids + ids
            try:
                nids, nlps, nvers, finish = await self.live.generate(context, limit - len(ids))
            except TokenLimit:
                out = getattr(self.live, "last_output", None)
                if out is not None:
                    ids, lps, vers = ids + out[0], lps + out[1], vers + out[2]
                    self._record(start, ids, lps, vers, "length", False)
                self.at_token_limit = True
                raise
            ids, lps, vers = ids + nids, lps + nlps, vers + nvers
        return self._record(start, ids, lps, vers, finish, replayed)

    def _ends_turn(self, ids: Sequence[int]) -> bool:
        return bool(ids) and int(ids[-1]) in self.chat.end_of_turn_ids

    def _record(self, start: int, ids: list[int], lps: list[float], vers: list[int], finish: str,
                replayed: bool) -> ModelOutput:
        out = ModelOutput(self.tokenizer.decode(ids, skip_special_tokens=True), ids, lps, vers, finish, replayed)
        self.steps.append(Step(len(self.steps), start, out))
        self.response_ids += ids
        return out

    async def observe(self, content: str, role: str = "user", prefill: str = "") -> list[int]:
        """Add an environment message (tokenised once with the chat template's delimiters).

        Args:
            content: the message text.
            role: its chat role (``user``, ``tool``, ...).
            prefill: text opening the next assistant turn (not trained).

        Returns:
            the observation's token ids.

        Raises:
            TokenLimit: the observation does not fit under ``max_response_len`` (not appended).
            NonDeterministicWorkflow: the record holds other ids (or a model call) here.
        """
        last = self.steps[-1].output.token_ids if self.steps else ()
        ids = self.chat.observation_ids(content, role, prefill, after_ids=last)
        await self.observe_ids(ids)
        return ids

    async def observe_ids(self, ids: Sequence[int]) -> None:
        """Add environment tokens given as ids (the workflow tokenised them itself).

        Raises: as :meth:`observe`; ValueError for an empty observation.
        """
        ids = [int(x) for x in ids]
        if not ids:
            raise ValueError("an observation needs at least one token")
        if self.at_token_limit:
            raise TokenLimit(f"sample {self.task.sample_id}: the conversation is at the token limit")
        ev = self.history.peek()
        if ev is not None:
            if ev.kind != "obs" or ev.token_ids != ids:
                what = "a model call" if ev.kind != "obs" else f"other observation ids ({len(ev.token_ids)} tokens)"
                raise NonDeterministicWorkflow(
                    f"observation after call {len(self.steps) - 1} of sample {self.task.sample_id}: the record holds "
                    f"{what}, the workflow produced {len(ids)} tokens")
            self.history.take()
        else:
            if self.live is None:
                if self.ended_at_token_limit:
                    self.at_token_limit = True
                    raise TokenLimit(f"sample {self.task.sample_id}: the recorded episode ended at the token limit")
                raise NonDeterministicWorkflow(
                    f"observation after call {len(self.steps) - 1} of sample {self.task.sample_id}: not in the "
                    "complete record")
            self._check_live_time()
            try:
                await self.live.observe(ids, self.last_version)
            except TokenLimit:
                self.at_token_limit = True
                raise
        if self.steps:
            self.steps[-1].observation_ids += ids
        self.response_ids += ids

    async def tool(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> tuple[bool, str]:
        """Run a tool (a plain function, in a thread) with a timeout; count it.

        Returns:
            ``(ok, text)``: the tool's result as text, or ``(False, "error: ...")`` when it raised
            or ran past ``timeout`` (default ``agent.tool_timeout_seconds``). A failing tool is
            an observation for the model, never a crash of the episode.
        """
        self.tool_calls += 1
        loop = asyncio.get_running_loop()
        limit = float(timeout if timeout is not None else self.tool_timeout)
        try:
            result = await asyncio.wait_for(loop.run_in_executor(None, lambda: fn(*args)), limit)
            return True, str(result)
        except asyncio.TimeoutError:
            self.tool_failures += 1
            return False, f"error: the tool took longer than {limit:g} s"
        except Exception as exc:  # noqa: BLE001 - a tool failure is an observation
            self.tool_failures += 1
            return False, f"error: {type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ results
    def info(self, episode: Episode) -> dict[str, Any]:
        """The JSON info the buffer keeps with the episode (termination and counts)."""
        return {"termination": episode.termination, "turns": len(self.steps), "tool_calls": self.tool_calls,
                "tool_failures": self.tool_failures, "replayed_calls": self.replayed_calls,
                **{f"m_{k}": float(v) for k, v in sorted(episode.metrics.items())[:16]}}

    def token_advantages(self) -> tuple[str, list[float] | None]:
        """Per-response-token advantages from the steps' ``advantages`` (observations get 0).

        Returns:
            ``("none", None)`` when no step sets any, ``("some", None)`` when only some do (the
            group then falls back to the estimator, with a warning in the trainer), else
            ``("all", values)`` with one value per response token.

        Raises:
            ValueError: a step's per-token list whose length differs from its output (names the step).
        """
        set_ = [s.advantages is not None for s in self.steps]
        if not any(set_):
            return "none", None
        if not all(set_):
            return "some", None
        out = [0.0] * len(self.response_ids)
        for s in self.steps:
            n = len(s.output.token_ids)
            a = s.advantages
            if isinstance(a, (int, float)):
                vals = [float(a)] * n
            else:
                vals = [float(x) for x in a]  # type: ignore[union-attr]
                if len(vals) != n:
                    raise ValueError(f"step {s.index} of sample {self.task.sample_id}: {len(vals)} advantages for "
                                     f"{n} output tokens (give one number, or one per output token)")
            out[s.start:s.start + n] = vals
        return "all", out
