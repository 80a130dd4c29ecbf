"""The RL data model shared by every asyncrl role: prompt groups, samples, segments, batches.

What and why:

* A **prompt group** is one prompt and its ``n_samples`` samples (GRPO needs whole groups).
* A **sample** is one response being generated: token ids, per-token behaviour logprobs and
  per-token policy versions (``versions[t]`` is the version of the weights that produced
  ``response_ids[t]``), its segments, status, finish reason, reward, optional precomputed
  advantages, how often it was resumed, and timestamps (docs/architecture.md#vocabulary).
* Arrays travel and are stored packed (little-endian int32 / float32): :func:`pack_i32`,
  :func:`unpack_i32`, :func:`pack_f32`, :func:`unpack_f32`. A Python list of 2,048 ints is
  ~60 kB of pickled objects; the packed form is 8 kB and needs no JSON parsing in Lua.

The buffer (``buffers/``) persists these in Redis; the rollout worker and the trainer read
them. Simplified on purpose: timestamps are integer milliseconds of the Redis server clock
(one clock for every machine), and segments record only their token span and why they ended.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Sequence

import numpy as np

__all__ = [
    "SampleStatus",
    "GroupState",
    "FinishReason",
    "REPORTED_FINISH_REASONS",
    "FINISH_CODES",
    "SEGMENT_REASONS",
    "WorkKind",
    "Segment",
    "PromptGroup",
    "Sample",
    "WorkItem",
    "BatchGroup",
    "Batch",
    "WeightAnnouncement",
    "pack_i32",
    "unpack_i32",
    "pack_f32",
    "unpack_f32",
    "staleness",
]


class SampleStatus(str, Enum):
    """Life-cycle state of one sample (docs/buffer.md has the diagram)."""

    PENDING = "pending"
    """Never generated (or restarted from its pristine prompt); waits in the fresh queue."""
    RUNNING = "running"
    """Claimed by a rollout worker under a lease; tokens are appended in chunks."""
    PARTIAL = "partial"
    """Stopped before finishing (budget reached, aborted by a weight update, or its worker died); waits to resume."""
    COMPLETE = "complete"
    """Finished (``stop`` or ``length``); waits for its reward."""
    SCORED = "scored"
    """Complete and rewarded; trainable."""
    FAILED = "failed"
    """The reward function failed; ``error`` says why. Its group trains without it.

    docs/architecture.md#failed-samples.
    """
    DISCARDED = "discarded"
    """Scored, but not among the best ``rollout.n_samples_per_prompt`` of its group when best-of-n
    (``rollout.generation_size`` > n) is on: kept in the buffer for inspection, never trained,
    counted as ``discarded_best_of_n`` (docs/buffer.md#best-of-n-and-dynamic-sampling)."""


class GroupState(str, Enum):
    """Life-cycle state of one prompt group."""

    PENDING = "pending"
    """Fed by the controller, not yet admitted (admission control holds it back)."""
    GENERATING = "generating"
    """Admitted: its samples are being generated or scored; counts toward the R groups in flight."""
    READY = "ready"
    """Every sample is scored or failed and at least two (or all of n=1) scored; waits for a train batch."""
    BATCHED = "batched"
    """Handed to the trainer in a batch that is not acknowledged yet."""
    ACKED = "acked"
    """Trained at an acknowledged step; deleted once a checkpoint commits that step."""
    DROPPED = "dropped"
    """Discarded with a counted reason (``stale_batch``, ``stale_resume``, ``reward_error``, ``abandoned_version``)."""


class FinishReason(str, Enum):
    """Why a segment (and, for ``stop``/``length``, the sample) ended: the one vocabulary.

    Every other list derives from it: the reasons a rollout worker may report
    (:data:`REPORTED_FINISH_REASONS`, checked by ``buffers/``), the codes stored in a sample's
    segments (:data:`FINISH_CODES`; ``buffers/lua/settings.lua``'s ``FINISH_CODE`` must equal it,
    tests/test_finish_reasons.py checks), and the metric labels (:mod:`asyncrl.metrics.labels`).
    """

    STOP = "stop"
    """The engine emitted EOS or a stop string: the sample is finished."""
    LENGTH = "length"
    """The response reached ``max_response_len``: the sample is finished (truncated)."""
    ABORT = "abort"
    """Interrupted (weight update, worker shutdown): the sample is parked as PARTIAL, resumable now."""
    BUDGET = "budget"
    """``max_budget`` tokens produced under the current policy version: parked until a newer version (or idle)."""
    LEASE = "lease"
    """The worker's lease was lost and the buffer closed the segment (read back as ``abort``: resumable)."""
    TURN = "turn"
    """An episode's model call ended (docs/agents.md); the episode goes on."""
    OBS = "obs"
    """Environment tokens of an episode (loss-masked, outside budget and staleness); written by the buffer."""
    CTX = "ctx"
    """The prompt of an episode's further trajectory; written by the buffer."""


#: What a rollout worker may report when it appends a segment's tokens (the buffer writes
#: ``lease``, ``obs`` and ``ctx`` segments itself).
REPORTED_FINISH_REASONS: tuple[str, ...] = tuple(
    r.value for r in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.BUDGET, FinishReason.TURN)
)
#: The code of each reason in a sample's packed segments (the Lua scripts store
#: ``code + 16 * trajectory``); ``buffers/lua/settings.lua``'s ``FINISH_CODE`` is this table.
FINISH_CODES: dict[str, int] = {r.value: i for i, r in enumerate(FinishReason, start=1)}
#: A stored segment code (``% 16``) read back as its finish reason; a lost lease reads as ``abort``.
SEGMENT_REASONS: dict[int, str] = {
    code: (FinishReason.ABORT.value if name == FinishReason.LEASE.value else name) for name, code in FINISH_CODES.items()
}


class WorkKind(str, Enum):
    """What a claimed :class:`WorkItem` asks the rollout worker to do."""

    GENERATE = "generate"
    """Call the engine with ``prompt_ids + response_ids`` and ``max_new_tokens``; append; end the segment."""
    SCORE = "score"
    """The sample is complete but its previous worker died before scoring it: run the reward function only."""


@dataclass(frozen=True)
class Segment:
    """Tokens ``response_ids[start:end]`` produced by one engine call, and why that call ended.

    Episodes (docs/agents.md) add ``turn`` (a model call ended), ``obs`` (environment tokens) and
    ``ctx`` (the prompt of a further trajectory); ``trajectory`` is the episode's trajectory the
    tokens belong to (0 = the main one, whose prompt is the group's).
    """

    start: int
    end: int
    finish_reason: str
    trajectory: int = 0


@dataclass
class PromptGroup:
    """One prompt and how many samples to draw for it.

    Args:
        group_id: unique within the run; letters, digits, ``_.-`` (<= 128 characters).
        prompt_ids: prompt token ids (already chat-templated), int32 range.
        metadata: task data for the reward function (e.g. ``{"answer": "42"}``); JSON-serialisable.
        n_samples: samples per prompt (``rollout.n_samples_per_prompt``).
        feed_index: position of the prompt in the dataset order (set by :meth:`ReplayBuffer.feed`).
        state: life-cycle state (read back from the buffer).
        admission_seq: admission order (oldest first); 0 while pending.
    """

    group_id: str
    prompt_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)
    n_samples: int = 1
    feed_index: int = -1
    state: GroupState = GroupState.PENDING
    admission_seq: int = 0


@dataclass
class Sample:
    """One response of a prompt group; arrays are aligned per response token.

    ``response_ids``, ``behaviour_logprobs`` and ``versions`` have the same length T
    (``len(response_ids) <= max_response_len``). ``advantages`` is None, a float (whole
    sequence) or a list of T floats, set by custom rollout code. Timestamps are Redis-server
    milliseconds: ``created_ms``, ``updated_ms`` and ``completed_ms`` (0 until complete).

    An **episode** of a multi-turn workflow (docs/agents.md) is one sample too: its response is
    the whole conversation after the prompt, model calls and environment observations in order;
    segments ending with ``turn`` close a model call and segments ``obs`` hold environment tokens
    (loss-masked, outside budget and staleness). ``info`` holds the episode's termination reason
    and counts (None for single-turn samples).
    """

    sample_id: str
    group_id: str
    index: int
    response_ids: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    status: SampleStatus = SampleStatus.PENDING
    finish_reason: str | None = None
    reward: float | None = None
    error: str | None = None
    advantages: float | list[float] | None = None
    num_resumes: int = 0
    num_restarts: int = 0
    created_ms: int = 0
    updated_ms: int = 0
    completed_ms: int = 0
    info: dict[str, Any] | None = None

    @property
    def oldest_version(self) -> int | None:
        """Oldest policy version among the response tokens (None for an empty response)."""
        return min(self.versions) if self.versions else None

    @property
    def timestamps(self) -> dict[str, int]:
        """``{"created_ms", "updated_ms", "completed_ms"}``."""
        return {"created_ms": self.created_ms, "updated_ms": self.updated_ms, "completed_ms": self.completed_ms}


@dataclass
class WorkItem:
    """A claimed unit of work for a rollout worker (returned by ``ReplayBuffer.claim``).

    For ``kind == GENERATE`` call the engine with ``input_ids = prompt_ids + response_ids`` and
    ``max_new_tokens`` (= ``min(M - produced_under_version_tokens, max_response_len -
    len(response_ids))``, docs/architecture.md#the-three-knobs), append chunks, then end the segment. For
    ``kind == SCORE`` run the reward function and call ``score``. ``claim_token`` fences the
    lease: once the lease is reclaimed or a recovery revokes it, every call with this token
    raises :class:`buffers.errors.LeaseLost` and changes nothing. ``length_tokens`` is the
    response length the buffer holds; the client keeps it current after each append.
    """

    kind: WorkKind
    sample_id: str
    group_id: str
    index: int
    claim_token: str
    prompt_ids: list[int]
    response_ids: list[int]
    metadata: dict[str, Any]
    max_new_tokens: int
    produced_under_version_tokens: int
    clock_version: int
    lineage: int
    num_resumes: int
    length_tokens: int = 0


@dataclass
class BatchGroup:
    """One prompt group of a train batch: its trainable (SCORED) samples, oldest version, staleness.

    ``staleness = batch.version - oldest_version`` (docs/architecture.md#vocabulary); ``n_failed`` samples were
    left out because their reward function failed.
    """

    group: PromptGroup
    samples: list[Sample]
    oldest_version: int
    staleness: int
    n_failed: int = 0


@dataclass
class Batch:
    """B prompt groups handed to trainer rank 0 for one step, oldest first.

    ``version`` is the clock when the batch was formed; ``step`` the trainer step it was
    handed out for; ``redelivered`` is True when the same batch is handed out again (a restart).
    """

    batch_id: str
    step: int
    version: int
    lineage: int
    groups: list[BatchGroup]
    redelivered: bool = False

    @property
    def group_ids(self) -> list[str]:
        """Group ids in batch order."""
        return [g.group.group_id for g in self.groups]


@dataclass(frozen=True)
class WeightAnnouncement:
    """A published policy version: where its weights are and their checksum.

    ``lineage`` increases when a recovery rewinds the clock; a worker that sees a new lineage
    reloads weights even when ``version`` did not increase.
    """

    version: int
    uri: str
    checksum: str
    lineage: int
    published_ms: int = 0


def pack_i32(values: Sequence[int] | np.ndarray) -> bytes:
    """Little-endian int32 bytes of ``values`` (shape (T,)).

    Raises:
        ValueError: a value is outside the int32 range.
    """
    if isinstance(values, (list, tuple)) and len(values) <= 4096:
        try:
            return struct.pack(f"<{len(values)}i", *values)  # fast path for chunks
        except struct.error:
            raise ValueError("token ids / versions must be integers that fit in int32") from None
    arr = np.asarray(values, dtype=np.int64)
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError("token ids / versions must fit in int32")
    return arr.astype("<i4").tobytes()


def unpack_i32(data: bytes | None) -> list[int]:
    """Inverse of :func:`pack_i32`.

    Raises:
        ValueError: the byte length is not a multiple of 4 (malformed data).
    """
    if not data:
        return []
    if len(data) % 4:
        raise ValueError(f"packed int32 array has {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype="<i4").tolist()


def pack_f32(values: Sequence[float] | np.ndarray) -> bytes:
    """Little-endian float32 bytes of ``values`` (shape (T,)).

    Raises:
        ValueError: a value is NaN (a logprob is finite or -inf).
    """
    if isinstance(values, (list, tuple)) and len(values) <= 4096:
        try:
            if any(v != v for v in values):
                raise ValueError("logprobs/advantages must not be NaN")
            return struct.pack(f"<{len(values)}f", *values)
        except (struct.error, TypeError, OverflowError):
            raise ValueError("logprobs/advantages must be floats") from None
    arr = np.asarray(values, dtype="<f4")
    if arr.size and np.isnan(arr).any():
        raise ValueError("logprobs/advantages must not be NaN")
    return arr.tobytes()


def unpack_f32(data: bytes | None) -> list[float]:
    """Inverse of :func:`pack_f32`.

    Raises:
        ValueError: the byte length is not a multiple of 4 (malformed data).
    """
    if not data:
        return []
    if len(data) % 4:
        raise ValueError(f"packed float32 array has {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype="<f4").tolist()


def staleness(clock_version: int, token_versions: Sequence[int]) -> int:
    """Staleness of a sample trained at ``clock_version`` (docs/architecture.md#vocabulary).

    ``clock_version - min(token_versions)``; 0 for an empty response.
    """
    if len(token_versions) == 0:
        return 0
    return int(clock_version - min(token_versions))
