"""The closed label vocabularies, histogram bucket layouts and label checks of every metric catalogue.

One job: say which label values and buckets exist, so a catalogue module cannot invent its own
(see the package docstring for the naming conventions). Importing it disables the
``_created`` series for the whole process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import prometheus_client

from asyncrl.core.types import FinishReason

if TYPE_CHECKING:
    from prometheus_client import Counter

# The _created series double the series count and are used by nothing here (prometheus_client
# docs, "Disabling _created metrics").
prometheus_client.disable_created_metrics()

# ----------------------------------------------------------------------------------------------
# label vocabularies (low cardinality, closed sets)

#: Values of ``asyncrl_build_info{role}``.
ROLES: tuple[str, ...] = ("rollout", "trainer", "controller", "buffer", "reward_model", "env_server")
#: Why an engine request (one segment) ended: SGLang's ``meta_info.finish_reason.type``
#: (``stop``/``length``/``abort``) plus ``budget`` (reached ``max_budget`` under this policy
#: version; the sample is parked) and ``error`` (HTTP/engine failure).
FINISH_REASONS: tuple[str, ...] = (
    *(r.value for r in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.BUDGET, FinishReason.ABORT)), "error",
)
#: Why a sample was parked as PARTIAL: its per-version token budget, a weight update that
#: aborted the request, or a shutdown (SIGTERM drain).
PARK_REASONS: tuple[str, ...] = ("budget", "weight_update", "shutdown")
#: States of samples in the replay buffer (``asyncrl_buffer_samples{state}``).
SAMPLE_STATES: tuple[str, ...] = ("queued", "generating", "partial", "scoring", "complete", "failed")
#: States of prompt groups (``asyncrl_buffer_groups{state}``): admitted and generating,
#: READY for the trainer, handed to the trainer (claimed, not yet acknowledged), acknowledged
#: by a step but not yet covered by a checkpoint.
GROUP_STATES: tuple[str, ...] = ("in_flight", "ready", "claimed", "acknowledged")
#: Why a sample or group left the run untrained (docs/architecture.md: the stale policies of
#: #the-three-knobs, #failed-samples, #acknowledgement-and-recovery).
DROP_REASONS: tuple[str, ...] = ("stale", "reward_error", "invalid", "lineage", "too_long", "zero_variance",
                                 "best_of_n")
#: Why a sample or group was regenerated from its pristine prompt.
RESTART_REASONS: tuple[str, ...] = ("stale", "lineage", "lease_expired")
#: Outcome of scoring one sample (accuracy = correct / (correct + incorrect)).
SCORE_OUTCOMES: tuple[str, ...] = ("correct", "incorrect", "error")
#: The named, timed phases of one trainer step (docs/architecture.md#training-step).
TRAINER_PHASES: tuple[str, ...] = ("wait_batch", "forward_backward", "optim_step", "publish_weights")
#: Weight transports (docs/architecture.md#weight-sync).
WEIGHT_TRANSPORTS: tuple[str, ...] = ("disk", "http", "nccl")
#: Components of the embedded engine's thread (``asyncrl_rollout_engine_seconds_total{component}``;
#: rollout_server/engine_profile.py says what each one covers; they add up to the thread's lifetime).
ENGINE_COMPONENTS: tuple[str, ...] = ("prefill_forward", "prefill_other", "decode_forward", "decode_other", "sampling",
                                      "weights", "publish", "idle", "paused", "other")
#: What the rollout worker waits on (``asyncrl_rollout_worker_seconds_total{component}``): claiming
#: work, buffer writes (appends, segment ends, scores), the reward function, fetching a
#: version's weights, and the engine's pause + load + continue of a weight update.
WORKER_COMPONENTS: tuple[str, ...] = ("claim", "buffer_write", "scoring", "weight_fetch", "weight_load")
#: Result of an operation that can fail.
RESULTS: tuple[str, ...] = ("ok", "error")
#: Why an episode of a multi-turn workflow ended (asyncrl.agents.TERMINATIONS).
TERMINATIONS: tuple[str, ...] = ("env_done", "turn_limit", "token_limit", "timeout", "error")
#: Why an episode was restarted from its prompt.
EPISODE_RESTART_REASONS: tuple[str, ...] = ("nondeterministic",)
#: Buckets of turns / tool calls per episode.
EPISODE_COUNT_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
#: Outcome of one ``POST /score`` request to the reward-model server: answered, rejected by its
#: schema or auth (4xx), refused while draining (503), or failed in the forward pass (500).
RM_REQUEST_RESULTS: tuple[str, ...] = ("ok", "bad_request", "unauthorized", "draining", "error")
#: Outcome of one tool call on the environment server: a result, the tool refused its input, the
#: call's deadline passed, or the request was refused (schema or size 400/413, auth 401, draining 503).
ENV_CALL_OUTCOMES: tuple[str, ...] = ("ok", "tool_error", "deadline", "bad_request", "unauthorized", "draining")
#: The tools the environment server serves (``asyncrl.env_server.tools.TOOLS``).
ENV_TOOLS: tuple[str, ...] = ("calculate",)

#: SGLang engine metric names (``python/sglang/srt/metrics/collector.py``) that dashboards may
#: query; the embedded torch engine exports the same names (with the ``model_name`` label) so
#: one dashboard serves both engines. name -> Prometheus type as exposed.
SGLANG_ENGINE_METRICS: dict[str, str] = {
    "sglang:num_running_reqs": "gauge",
    "sglang:num_queue_reqs": "gauge",
    "sglang:num_used_tokens": "gauge",
    "sglang:token_usage": "gauge",
    "sglang:gen_throughput": "gauge",
    "sglang:num_paused_reqs": "gauge",
    "sglang:prompt_tokens_total": "counter",
    "sglang:generation_tokens_total": "counter",
    "sglang:num_requests_total": "counter",
    "sglang:num_aborted_requests_total": "counter",
    "sglang:time_to_first_token_seconds": "histogram",
    "sglang:e2e_request_latency_seconds": "histogram",
}


def exponential_buckets(start: float, factor: float, count: int) -> tuple[float, ...]:
    """``count`` histogram bucket bounds ``start * factor**i`` (Prometheus' Go client helper).

    Raises:
        ValueError: ``start <= 0``, ``factor <= 1`` or ``count < 1``.
    """
    if start <= 0 or factor <= 1 or count < 1:
        raise ValueError(f"exponential_buckets needs start > 0, factor > 1, count >= 1 (got {start}, {factor}, {count})")
    return tuple(float(f"{start * factor**i:.6g}") for i in range(count))


#: Whole-sample rollout wall time (first claim to completion, across segments): 0.5 s .. 1 h.
ROLLOUT_DURATION_BUCKETS_SECONDS = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600)
#: One engine request (one segment): 50 ms .. 20 min.
REQUEST_DURATION_BUCKETS_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
#: Trainer phases, checkpoints, admission waits: 10 ms .. ~45 min (x2 steps).
PHASE_DURATION_BUCKETS_SECONDS = exponential_buckets(0.01, 2.0, 19)
#: Weight publish / load: 10 ms .. ~10 min.
WEIGHT_SYNC_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Staleness in policy versions (integers; ``le="0"`` counts on-policy samples).
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 16, 32)
#: Response length in tokens: 16 .. 32768.
RESPONSE_LENGTH_BUCKETS_TOKENS = tuple(float(2**i) for i in range(4, 16))
#: Texts in one reward-model forward pass (the dynamic batcher's batch size): 1 .. 1024.
RM_BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(11))
#: One reward-model request or forward pass: 5 ms .. 5 min.
RM_DURATION_BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: One environment-server call or its drawn latency: 10 ms .. 2 min, dense around measured
#: sandbox times (0.2 .. 5 s, docs/agents.md).
ENV_DURATION_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10, 20, 30, 60, 120)
#: Per-sample reward (after scale/bias/clip; ``data.reward_clip`` defaults to 10).
REWARD_BUCKETS = (-10, -5, -2, -1, -0.5, 0, 0.25, 0.5, 0.75, 1, 2, 5, 10)


def _check(value: str, allowed: Iterable[str], label: str) -> str:
    if value not in allowed:
        raise ValueError(f"unknown {label} {value!r}: use one of {', '.join(allowed)} (labels are closed sets)")
    return value


def _check_nonneg(value: float, what: str) -> float:
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


def _zero(metric: "Counter", values: Iterable[str]) -> None:
    """Create the series of every value of a closed label set at 0, so a counter that has not
    moved yet (no drop, no correct answer, no weight update) still has a series: ``rate()``
    then answers 0 instead of nothing and dashboard panels are not empty (Prometheus'
    instrumentation guide: initialise known label values)."""
    for v in values:
        metric.labels(v)
