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
    "TokenLimit",
    "EpisodeTimeout",
    "EpisodeInterrupt",
    "NonDeterministicWorkflow",
    "RecordedEvent",
    "RecordedHistory",
    "LiveCalls",
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
        metadata: the prompt group's task data (``gold``, ``expression``, ... from asyncrl.tasks.tasks).
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
        start: offset of the call's first token in the trajectory's response (after its prompt).
        offset: offset of the call's first token in the episode's record (all trajectories).
        output: the call's :class:`ModelOutput`.
        observation_ids: environment ids appended after the call (empty until observed).
        reward: optional per-step reward (read by a ``trajectory_grouping_hook``).
        advantages: optional precomputed advantage: one number, or one per output token. When
            every step of every episode of a group sets it, the advantage estimator is skipped.
    """

    index: int
    start: int
    output: ModelOutput
    offset: int = -1
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
        trajectory_rewards: rewards of the further trajectories by name (``model.trajectory``);
            a trajectory without one gets ``reward``.
    """

    reward: float
    termination: str = "env_done"
    metrics: dict[str, float] = field(default_factory=dict)
    trajectory_rewards: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.termination not in TERMINATIONS:
            raise ValueError(f"Episode.termination must be one of {TERMINATIONS}, got {self.termination!r}")


@dataclass
class RecordedEvent:
    """One event of a recorded episode: a model call (``kind == "model"``), an observation
    (``obs``) or a further trajectory's prompt (``ctx``), at offset ``start`` of the record.

    ``complete`` is False for a model call that was interrupted (it continues live).
    """

    kind: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    complete: bool = True
    finish_reason: str = "stop"
    start: int = 0
    trajectory: int = 0


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
            segments: :class:`asyncrl.core.types.Segment` list (``start``, ``end``, ``finish_reason``).
            max_tokens_of: unused hook for call limits (kept for symmetry with live calls).

        Raises:
            ValueError: segments that do not tile ``[0, R)`` in order.
        """
        events: list[RecordedEvent] = []
        open_call: dict[int, RecordedEvent] = {}
        pos = 0
        last_traj = 0
        for seg in segments:
            if seg.start != pos or seg.end < seg.start or seg.end > len(ids):
                raise ValueError(f"episode segments do not tile the response: segment [{seg.start}, {seg.end}) at "
                                 f"offset {pos} of {len(ids)} tokens")
            span = slice(seg.start, seg.end)
            pos = seg.end
            traj = int(getattr(seg, "trajectory", 0))
            last_traj = traj
            if seg.finish_reason in ("obs", "ctx"):
                if traj in open_call:
                    raise ValueError(f"an observation at offset {seg.start} follows an unfinished model call")
                events.append(RecordedEvent(seg.finish_reason, list(ids[span]), start=seg.start, trajectory=traj))
                continue
            cur = open_call.get(traj)
            if cur is None:
                cur = open_call[traj] = RecordedEvent("model", [], [], [], complete=False, start=seg.start,
                                                      trajectory=traj)
                events.append(cur)
            cur.token_ids += list(ids[span])
            cur.logprobs += list(logprobs[span])
            cur.versions += list(versions[span])
            if seg.finish_reason in ("turn", "stop", "length"):
                cur.complete = True
                del open_call[traj]
        if pos < len(ids):  # tokens after the last closed segment (not expected; treated as a partial call)
            cur = open_call.get(last_traj)
            if cur is None:
                cur = open_call[last_traj] = RecordedEvent("model", [], [], [], complete=False, start=pos,
                                                           trajectory=last_traj)
                events.append(cur)
            cur.token_ids += list(ids[pos:])
            cur.logprobs += list(logprobs[pos:])
            cur.versions += list(versions[pos:])
        return cls(events)

    def by_trajectory(self) -> dict[int, "RecordedHistory"]:
        """One history per trajectory index, each with its events in record order."""
        out: dict[int, list[RecordedEvent]] = {}
        for ev in self.events:
            out.setdefault(ev.trajectory, []).append(ev)
        return {k: RecordedHistory(v) for k, v in out.items()}

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
    ``observe`` appends observation ids, or with ``kind="ctx"`` a further trajectory's prompt
    (raises :class:`TokenLimit` when they do not fit). ``length`` is the record's length (all
    trajectories); ``trajectory`` tags what is written.
    """

    length: int

    async def generate(self, context_ids: list[int], max_new_tokens: int,
                       trajectory: int = 0) -> tuple[list[int], list[float], list[int], str]: ...

    async def observe(self, ids: list[int], version: int, trajectory: int = 0, kind: str = "obs") -> None: ...

