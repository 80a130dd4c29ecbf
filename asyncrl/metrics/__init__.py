"""The Prometheus metric catalogue of every asyncrl role, and how each role serves it.

Why one module: dashboards, alert rules and tests refer to metric *names*; keeping every
name, type, unit, label set and bucket layout in one place means a rename breaks a test here
(``tests/test_monitoring.py`` checks every dashboard/rule expression against these
registries) instead of silently emptying a Grafana panel.

Conventions (prometheus.io "Metric and label naming"; ``ecosystem.md`` B.1):

* names start with ``asyncrl_<subsystem>_``, are snake_case and never contain ``:`` (colons
  are for recording rules, see ``monitoring/prometheus/rules/``);
* base units with a plural suffix (``_seconds``, ``_bytes``), ratios are ``_ratio`` in 0..1,
  counters end in ``_total`` (the client appends it: ``Counter("asyncrl_x")`` exposes
  ``asyncrl_x_total``), timestamps are ``_timestamp_seconds``;
* labels are low-cardinality enumerations, listed below as tuples (``FINISH_REASONS`` ...);
  never sample ids, request ids, prompts or run-specific numbers. Helper methods validate
  label values and raise ``ValueError`` for unknown ones;
* histograms (not summaries) so quantiles aggregate across instances; buckets are chosen
  for RL rollouts that last seconds to tens of minutes (the client's default buckets stop at
  10 s);
* ``_created`` series are disabled (:func:`prometheus_client.disable_created_metrics`) —
  they double the series count and no dashboard uses them.

Each role creates its metrics on a private :class:`prometheus_client.CollectorRegistry`
(so tests and several roles in one process never collide), e.g.::

    reg = CollectorRegistry()
    build_info(reg, "rollout")
    m = RolloutMetrics(reg)
    m.request_finished("stop", duration_seconds=3.2, generated_tokens=120)
    app.router.add_get("/metrics", metrics_app_handler(reg))   # aiohttp roles
    port = start_metrics_server(reg, 0)                         # roles without HTTP server

Which process exports what: rollout servers export :class:`RolloutMetrics` (the embedded
engine additionally exports SGLang's own ``sglang:`` engine metrics, :data:`SGLANG_ENGINE_METRICS`,
the only names exempt from these rules); trainer rank 0 exports :class:`TrainerMetrics`;
the controller exports :class:`ControllerMetrics`. :class:`BufferMetrics` counts replay-buffer
events and may be instantiated in any process that performs them (counters add up across
processes with ``sum``); its state gauges (samples by state, the version clock) are set only
by the process that polls the buffer's stats (the controller).

Simplifications: the trainer exports only from rank 0 (no multiprocess collector); idle
time is measured by the role itself with :class:`IdleTracker` (busy/idle transitions), not
sampled by an external profiler. docs/metrics.md lists every metric.
"""

from __future__ import annotations

import os
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = [
    "ROLES",
    "FINISH_REASONS",
    "PARK_REASONS",
    "SAMPLE_STATES",
    "GROUP_STATES",
    "DROP_REASONS",
    "RESTART_REASONS",
    "SCORE_OUTCOMES",
    "TRAINER_PHASES",
    "WEIGHT_TRANSPORTS",
    "RESULTS",
    "SGLANG_ENGINE_METRICS",
    "exponential_buckets",
    "ROLLOUT_DURATION_BUCKETS_SECONDS",
    "REQUEST_DURATION_BUCKETS_SECONDS",
    "PHASE_DURATION_BUCKETS_SECONDS",
    "WEIGHT_SYNC_BUCKETS_SECONDS",
    "STALENESS_BUCKETS",
    "RESPONSE_LENGTH_BUCKETS_TOKENS",
    "REWARD_BUCKETS",
    "IdleTracker",
    "RolloutMetrics",
    "BufferMetrics",
    "TrainerMetrics",
    "ControllerMetrics",
    "build_info",
    "git_sha",
    "role_registry",
    "metrics_app_handler",
    "start_metrics_server",
    "stop_metrics_server",
    "exposition",
    "lint_exposition",
]

# The _created series double the series count and are used by nothing here (ecosystem B.1).
prometheus_client.disable_created_metrics()

# ----------------------------------------------------------------------------------------------
# label vocabularies (low cardinality, closed sets)

#: Values of ``asyncrl_build_info{role}``.
ROLES: tuple[str, ...] = ("rollout", "trainer", "controller", "buffer")
#: Why an engine request (one segment) ended: SGLang's ``meta_info.finish_reason.type``
#: (``stop``/``length``/``abort``) plus ``budget`` (reached ``max_budget`` under this policy
#: version; the sample is parked) and ``error`` (HTTP/engine failure).
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "budget", "abort", "error")
#: Why a sample was parked as PARTIAL: its per-version token budget, a weight update that
#: aborted the request, or a shutdown (SIGTERM drain).
PARK_REASONS: tuple[str, ...] = ("budget", "weight_update", "shutdown")
#: States of samples in the replay buffer (``asyncrl_buffer_samples{state}``).
SAMPLE_STATES: tuple[str, ...] = ("queued", "generating", "partial", "scoring", "complete", "failed")
#: States of prompt groups (``asyncrl_buffer_groups{state}``): admitted and generating,
#: READY for the trainer, handed to the trainer (claimed, not yet acknowledged), acknowledged
#: by a step but not yet covered by a checkpoint.
GROUP_STATES: tuple[str, ...] = ("in_flight", "ready", "claimed", "acknowledged")
#: Why a sample or group left the run untrained (ARCHITECTURE §3, §6).
DROP_REASONS: tuple[str, ...] = ("stale", "reward_error", "invalid", "lineage", "too_long")
#: Why a sample or group was regenerated from its pristine prompt.
RESTART_REASONS: tuple[str, ...] = ("stale", "lineage", "lease_expired")
#: Outcome of scoring one sample (accuracy = correct / (correct + incorrect)).
SCORE_OUTCOMES: tuple[str, ...] = ("correct", "incorrect", "error")
#: The named, timed phases of one trainer step (ARCHITECTURE §5).
TRAINER_PHASES: tuple[str, ...] = ("wait_batch", "forward_backward", "optim_step", "publish_weights")
#: Weight transports (ARCHITECTURE §7).
WEIGHT_TRANSPORTS: tuple[str, ...] = ("disk", "http", "nccl")
#: Result of an operation that can fail.
RESULTS: tuple[str, ...] = ("ok", "error")

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


# ----------------------------------------------------------------------------------------------
# idle time


def _zero(metric: "Counter", values: Iterable[str]) -> None:
    """Create the series of every value of a closed label set at 0, so a counter that has not
    moved yet (no drop, no correct answer, no weight update) still has a series: ``rate()``
    then answers 0 instead of nothing and dashboard panels are not empty (Prometheus'
    instrumentation guide: initialise known label values)."""
    for v in values:
        metric.labels(v)


class IdleTracker(Collector):
    """Counts a role's idle seconds live, exported at scrape time.

    Exposes ``asyncrl_<subsystem>_idle_seconds_total`` (counter; ``rate()`` of it is the idle
    ratio over any window) and ``asyncrl_<subsystem>_idle_ratio`` (gauge, 0..1, idle share of
    the time since the tracker was created). A counter updated only on transitions would
    stay flat during a long idle spell and then jump; computing it at scrape time does not.

    The role calls :meth:`set_idle` on every transition (thread-safe). It starts idle.
    """

    def __init__(self, registry: CollectorRegistry, subsystem: str, what: str, clock: Callable[[], float] = time.monotonic):
        """``what`` says what idle means for this role (it goes into the help text)."""
        self._name = f"asyncrl_{subsystem}_idle"
        self._what = what
        self._clock = clock
        self._lock = threading.Lock()
        self._start = clock()
        self._idle_since: float | None = self._start
        self._idle_accum = 0.0
        registry.register(self)

    def set_idle(self, idle: bool) -> None:
        """Mark the role idle (``True``) or busy (``False``) from now on."""
        with self._lock:
            now = self._clock()
            if idle and self._idle_since is None:
                self._idle_since = now
            elif not idle and self._idle_since is not None:
                self._idle_accum += now - self._idle_since
                self._idle_since = None

    @contextmanager
    def idle(self) -> Iterator[None]:
        """Context manager: idle inside the block, busy after it."""
        self.set_idle(True)
        try:
            yield
        finally:
            self.set_idle(False)

    def idle_seconds(self) -> float:
        """Idle seconds accumulated so far (including the current idle spell)."""
        with self._lock:
            now = self._clock()
            return self._idle_accum + (now - self._idle_since if self._idle_since is not None else 0.0)

    def idle_ratio(self) -> float:
        """Idle share (0..1) of the time since the tracker was created."""
        elapsed = self._clock() - self._start
        return min(1.0, self.idle_seconds() / elapsed) if elapsed > 0 else 0.0

    def describe(self):  # registry asks for names at register time
        return [
            CounterMetricFamily(self._name + "_seconds", ""),
            GaugeMetricFamily(self._name + "_ratio", ""),
        ]

    def collect(self):
        c = CounterMetricFamily(
            self._name + "_seconds", f"Seconds spent idle ({self._what}); rate() of it is the idle ratio over a window."
        )
        c.add_metric([], self.idle_seconds())
        g = GaugeMetricFamily(self._name + "_ratio", f"Idle share (0-1) since the process started ({self._what}).")
        g.add_metric([], self.idle_ratio())
        return [c, g]


# ----------------------------------------------------------------------------------------------
# per-role catalogues


class RolloutMetrics:
    """Metrics of one rollout server (engine + rollout worker), served on its HTTP port.

    Attributes are the ``prometheus_client`` metric objects (use the label constants of this
    module); the methods bundle the common updates and validate labels.
    """

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.generated_tokens = Counter(
            "asyncrl_rollout_generated_tokens", "Response tokens generated by the engine (all segments).", registry=r
        )
        self.prompt_tokens = Counter(
            "asyncrl_rollout_prompt_tokens",
            "Tokens prefilled by the engine, including prompt+response re-prefilled when a partial resumes.",
            registry=r,
        )
        self.requests = Counter(
            "asyncrl_rollout_requests",
            "Engine requests (segments) finished, by finish reason (stop/length/budget/abort/error).",
            ["finish_reason"],
            registry=r,
        )
        self.request_duration = Histogram(
            "asyncrl_rollout_request_duration_seconds",
            "Wall time of one engine request (one segment).",
            ["finish_reason"],
            buckets=REQUEST_DURATION_BUCKETS_SECONDS,
            registry=r,
        )
        self.duration = Histogram(
            "asyncrl_rollout_duration_seconds",
            "Wall time of a whole sample, first claim to completion, across all its segments.",
            ["finish_reason"],
            buckets=ROLLOUT_DURATION_BUCKETS_SECONDS,
            registry=r,
        )
        self.response_length = Histogram(
            "asyncrl_rollout_response_length_tokens",
            "Response length of completed samples.",
            buckets=RESPONSE_LENGTH_BUCKETS_TOKENS,
            registry=r,
        )
        self.samples_completed = Counter(
            "asyncrl_rollout_samples_completed", "Samples that finished generating (stop or length).", registry=r
        )
        self.partial_parked = Counter(
            "asyncrl_rollout_partial_parked",
            "Samples parked as PARTIAL, by reason (budget/weight_update/shutdown).",
            ["reason"],
            registry=r,
        )
        self.partial_resumes = Counter(
            "asyncrl_rollout_partial_resumes", "PARTIAL samples resumed (a new segment started).", registry=r
        )
        self.samples_scored = Counter(
            "asyncrl_rollout_samples_scored",
            "Samples scored by the reward function, by outcome (correct/incorrect/error).",
            ["outcome"],
            registry=r,
        )
        self.reward = Histogram(
            "asyncrl_rollout_reward", "Reward of scored samples (after scale/bias/clip); negative buckets, so no _sum series (OpenMetrics).", buckets=REWARD_BUCKETS, registry=r
        )
        self.inflight_requests = Gauge(
            "asyncrl_rollout_inflight_requests", "Engine requests this worker has in flight.", registry=r
        )
        self.policy_version = Gauge(
            "asyncrl_rollout_policy_version", "Policy version of the weights loaded in this engine.", registry=r
        )
        self.weight_load_duration = Histogram(
            "asyncrl_rollout_weight_load_duration_seconds",
            "Pause-to-continue time of a weight update on this engine (download + load), by transport.",
            ["transport"],
            buckets=WEIGHT_SYNC_BUCKETS_SECONDS,
            registry=r,
        )
        self.weight_updates = Counter(
            "asyncrl_rollout_weight_updates", "Weight updates attempted, by result (ok/error).", ["result"], registry=r
        )
        self.weight_sync_lag = Histogram(
            "asyncrl_rollout_weight_sync_lag_seconds",
            "Time from the trainer's publish announcement to the new weights being live here.",
            buckets=WEIGHT_SYNC_BUCKETS_SECONDS,
            registry=r,
        )
        self.idle = IdleTracker(r, "rollout", "rollout worker: no engine request in flight")
        _zero(self.requests, FINISH_REASONS)
        _zero(self.partial_parked, PARK_REASONS)
        _zero(self.samples_scored, SCORE_OUTCOMES)
        _zero(self.weight_updates, RESULTS)

    def request_finished(self, finish_reason: str, duration_seconds: float, generated_tokens: int, prompt_tokens: int = 0) -> None:
        """Record one finished engine request (segment).

        Raises:
            ValueError: ``finish_reason`` not in :data:`FINISH_REASONS`, or a negative value.
        """
        _check(finish_reason, FINISH_REASONS, "finish_reason")
        for value, what in ((duration_seconds, "duration_seconds"), (generated_tokens, "generated_tokens"), (prompt_tokens, "prompt_tokens")):
            _check_nonneg(value, what)
        self.requests.labels(finish_reason).inc()
        self.request_duration.labels(finish_reason).observe(duration_seconds)
        self.generated_tokens.inc(generated_tokens)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)

    def sample_completed(self, finish_reason: str, duration_seconds: float, response_tokens: int) -> None:
        """Record a sample that finished generating (``stop`` or ``length``).

        Raises:
            ValueError: ``finish_reason`` is not ``stop``/``length``, or a negative value.
        """
        _check(finish_reason, ("stop", "length"), "sample finish_reason")
        _check_nonneg(duration_seconds, "duration_seconds")
        _check_nonneg(response_tokens, "response_tokens")
        self.samples_completed.inc()
        self.duration.labels(finish_reason).observe(duration_seconds)
        self.response_length.observe(response_tokens)

    def parked(self, reason: str, n: int = 1) -> None:
        """Record ``n`` samples parked as PARTIAL for ``reason`` (:data:`PARK_REASONS`)."""
        self.partial_parked.labels(_check(reason, PARK_REASONS, "park reason")).inc(n)

    def resumed(self, n: int = 1) -> None:
        """Record ``n`` PARTIAL samples resumed."""
        self.partial_resumes.inc(n)

    def scored(self, reward: float, outcome: str) -> None:
        """Record one scored sample: its reward and outcome (:data:`SCORE_OUTCOMES`)."""
        self.samples_scored.labels(_check(outcome, SCORE_OUTCOMES, "score outcome")).inc()
        if outcome != "error":
            self.reward.observe(reward)

    def weights_loaded(self, version: int, transport: str, duration_seconds: float, lag_seconds: float | None = None) -> None:
        """Record a successful weight update to ``version`` via ``transport``."""
        t = _check(transport, WEIGHT_TRANSPORTS, "transport")
        _check_nonneg(duration_seconds, "duration_seconds")
        self.weight_load_duration.labels(t).observe(duration_seconds)
        self.weight_updates.labels("ok").inc()
        self.policy_version.set(version)
        if lag_seconds is not None:
            self.weight_sync_lag.observe(max(0.0, lag_seconds))


class BufferMetrics:
    """Replay-buffer events (any process that performs them) and buffer state (the poller).

    Counters and histograms are incremented where the event happens (rollout workers park and
    reclaim, the trainer's batch former checks staleness, the feeder admits); aggregate with
    ``sum without (instance, job)``. The state gauges (samples/groups by state, the version
    clock and lineage) are set by the one process that polls the buffer's stats.
    """

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.samples = Gauge(
            "asyncrl_buffer_samples", "Samples in the replay buffer, by state.", ["state"], registry=r
        )
        self.groups = Gauge(
            "asyncrl_buffer_groups", "Prompt groups in the replay buffer, by state.", ["state"], registry=r
        )
        self.policy_version = Gauge(
            "asyncrl_buffer_policy_version", "The version clock in Redis: newest published policy version.", registry=r
        )
        self.lineage = Gauge(
            "asyncrl_buffer_lineage", "Lineage counter in Redis (increases when a recovery rewinds the clock).", registry=r
        )
        self.max_staleness = Gauge(
            "asyncrl_buffer_max_staleness", "The configured staleness bound eta (buffer.max_staleness, policy versions).", registry=r
        )
        self.group_capacity = Gauge(
            "asyncrl_buffer_group_capacity",
            "Most prompt groups allowed in flight (rollout.rollout_batch_size R); more means admission control failed.",
            registry=r,
        )
        self.sample_staleness = Histogram(
            "asyncrl_buffer_sample_staleness",
            "Staleness (policy versions: clock minus oldest token version) of samples handed to the trainer.",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.groups_admitted = Counter(
            "asyncrl_buffer_groups_admitted", "Prompt groups admitted into generation.", registry=r
        )
        self.admission_wait = Histogram(
            "asyncrl_buffer_admission_wait_seconds",
            "Time a prompt group waited for admission control (the staleness bound) before being admitted.",
            buckets=PHASE_DURATION_BUCKETS_SECONDS,
            registry=r,
        )
        self.admission_blocked = Counter(
            "asyncrl_buffer_admission_blocked",
            "Admission checks that refused a new group because it could not be trained within max_staleness.",
            registry=r,
        )
        self.groups_trained = Counter(
            "asyncrl_buffer_groups_trained", "Prompt groups handed to the trainer in a batch.", registry=r
        )
        self.samples_dropped = Counter(
            "asyncrl_buffer_samples_dropped", "Samples dropped untrained, by reason.", ["reason"], registry=r
        )
        self.groups_dropped = Counter(
            "asyncrl_buffer_groups_dropped", "Prompt groups dropped untrained, by reason.", ["reason"], registry=r
        )
        self.samples_restarted = Counter(
            "asyncrl_buffer_samples_restarted",
            "Samples discarded and regenerated from their pristine prompt, by reason.",
            ["reason"],
            registry=r,
        )
        self.groups_restarted = Counter(
            "asyncrl_buffer_groups_restarted", "READY groups sent back whole to be regenerated, by reason.", ["reason"], registry=r
        )
        self.reclaimed = Counter(
            "asyncrl_buffer_work_reclaimed", "Claimed work of a silent worker reclaimed after the lease (XAUTOCLAIM).", registry=r
        )
        for counter in (self.samples_dropped, self.groups_dropped):
            _zero(counter, DROP_REASONS)
        for counter in (self.samples_restarted, self.groups_restarted):
            _zero(counter, RESTART_REASONS)

    def set_state(self, samples: dict[str, int] | None = None, groups: dict[str, int] | None = None) -> None:
        """Set the state gauges from the buffer's stats; states missing from a dict are set to 0.

        Raises:
            ValueError: a state not in :data:`SAMPLE_STATES` / :data:`GROUP_STATES` (nothing is set).
        """
        for s in samples or {}:
            _check(s, SAMPLE_STATES, "sample state")
        for g in groups or {}:
            _check(g, GROUP_STATES, "group state")
        if samples is not None:
            for s in SAMPLE_STATES:
                self.samples.labels(s).set(samples.get(s, 0))
        if groups is not None:
            for g in GROUP_STATES:
                self.groups.labels(g).set(groups.get(g, 0))

    def set_bounds(self, max_staleness: int, group_capacity: int) -> None:
        """Export the configured bounds the alert rules compare against (eta and R)."""
        self.max_staleness.set(max_staleness)
        self.group_capacity.set(group_capacity)

    def set_clock(self, policy_version: int, lineage: int) -> None:
        """Set the version clock and lineage gauges."""
        self.policy_version.set(policy_version)
        self.lineage.set(lineage)

    def dropped(self, reason: str, samples: int = 0, groups: int = 0) -> None:
        """Count ``samples`` and/or ``groups`` dropped for ``reason`` (:data:`DROP_REASONS`)."""
        _check(reason, DROP_REASONS, "drop reason")
        if samples:
            self.samples_dropped.labels(reason).inc(samples)
        if groups:
            self.groups_dropped.labels(reason).inc(groups)

    def restarted(self, reason: str, samples: int = 0, groups: int = 0) -> None:
        """Count ``samples`` and/or ``groups`` restarted for ``reason`` (:data:`RESTART_REASONS`)."""
        _check(reason, RESTART_REASONS, "restart reason")
        if samples:
            self.samples_restarted.labels(reason).inc(samples)
        if groups:
            self.groups_restarted.labels(reason).inc(groups)


class TrainerMetrics:
    """Metrics of trainer rank 0: step phases, throughput, weight publishing and loss statistics.

    Loss statistics are gauges holding the last step's batch value (one step = one sample of
    the curve; Prometheus' scrape interval is shorter than a step). Time each phase with
    :meth:`phase`.
    """

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.steps = Counter("asyncrl_trainer_steps", "Optimizer steps completed.", registry=r)
        self.step = Gauge("asyncrl_trainer_step", "Index of the last completed optimizer step.", registry=r)
        self.last_step_timestamp = Gauge(
            "asyncrl_trainer_last_step_timestamp_seconds",
            "Unix time of the last completed optimizer step (the trainer's start time before the first step).",
            registry=r,
        )
        self.last_step_timestamp.set(time.time())  # an unset gauge reads 0, which would look like a stall since 1970
        self.step_duration = Histogram(
            "asyncrl_trainer_step_duration_seconds",
            "Duration of the phases of a trainer step (wait_batch/forward_backward/optim_step/publish_weights).",
            ["phase"],
            buckets=PHASE_DURATION_BUCKETS_SECONDS,
            registry=r,
        )
        self.tokens = Counter("asyncrl_trainer_tokens", "Tokens (prompt + response) trained on.", registry=r)
        self.response_tokens = Counter(
            "asyncrl_trainer_response_tokens", "Response tokens trained on (the tokens with a loss).", registry=r
        )
        self.samples = Counter("asyncrl_trainer_samples", "Samples trained on.", registry=r)
        self.policy_version = Gauge(
            "asyncrl_trainer_policy_version", "Policy version of the trainer's newest published weights.", registry=r
        )
        self.lineage = Gauge("asyncrl_trainer_lineage", "Lineage of the trainer's version chain.", registry=r)
        self.weight_publish_duration = Histogram(
            "asyncrl_trainer_weight_publish_duration_seconds",
            "Time to make a policy version durable and loadable and move the clock, by transport.",
            ["transport"],
            buckets=WEIGHT_SYNC_BUCKETS_SECONDS,
            registry=r,
        )
        self.weight_publish_bytes = Gauge(
            "asyncrl_trainer_weight_publish_bytes", "Size of the last published weights.", registry=r
        )
        self.checkpoint_duration = Histogram(
            "asyncrl_trainer_checkpoint_duration_seconds", "Time to write a checkpoint.", buckets=PHASE_DURATION_BUCKETS_SECONDS, registry=r
        )
        self.checkpoints = Counter("asyncrl_trainer_checkpoints", "Checkpoints written, by result.", ["result"], registry=r)
        _zero(self.checkpoints, RESULTS)
        self.loss = Gauge("asyncrl_trainer_loss", "Policy loss of the last step (mean over its mini-batches).", registry=r)
        self.reward_mean = Gauge("asyncrl_trainer_reward_mean", "Mean reward of the last train batch.", registry=r)
        self.accuracy = Gauge(
            "asyncrl_trainer_accuracy_ratio", "Share (0-1) of the last train batch's samples that are correct.", registry=r
        )
        self.clip = Gauge(
            "asyncrl_trainer_clip_ratio", "Share (0-1) of response tokens whose PPO ratio was clipped in the last step.", registry=r
        )
        self.importance_weight_mean = Gauge(
            "asyncrl_trainer_importance_weight_mean", "Mean behaviour importance weight (pi_prox/pi_behav) of the last step.", registry=r
        )
        self.importance_weight_max = Gauge(
            "asyncrl_trainer_importance_weight_max", "Largest behaviour importance weight of the last step (before the cap).", registry=r
        )
        self.importance_weight_capped = Gauge(
            "asyncrl_trainer_importance_weight_capped_ratio",
            "Share (0-1) of tokens whose importance weight hit importance_weight_cap in the last step.",
            registry=r,
        )
        self.behaviour_kl = Gauge(
            "asyncrl_trainer_behaviour_kl",
            "Mean per-token KL(behaviour || trainer policy) of the last step, k3 estimator, nats.",
            registry=r,
        )
        self.entropy = Gauge("asyncrl_trainer_entropy", "Mean per-token policy entropy of the last step, nats.", registry=r)
        self.grad_norm = Gauge("asyncrl_trainer_grad_norm", "Gradient norm before clipping, last step.", registry=r)
        self.learning_rate = Gauge("asyncrl_trainer_learning_rate", "Learning rate of the last step.", registry=r)
        self.batch_staleness_max = Gauge(
            "asyncrl_trainer_batch_staleness_max", "Largest sample staleness (policy versions) in the last train batch.", registry=r
        )
        self.idle = IdleTracker(r, "trainer", "trainer: waiting for a batch")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one phase of a step; ``wait_batch`` also counts as trainer idle time.

        Raises:
            ValueError: ``name`` not in :data:`TRAINER_PHASES` (raised before the block runs).
        """
        _check(name, TRAINER_PHASES, "trainer phase")
        if name == "wait_batch":
            self.idle.set_idle(True)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.step_duration.labels(name).observe(time.perf_counter() - start)
            if name == "wait_batch":
                self.idle.set_idle(False)

    def step_done(self, step: int, tokens: int, response_tokens: int, samples: int, stats: dict[str, float] | None = None) -> None:
        """Record a completed optimizer step and its batch statistics.

        ``stats`` keys (all optional): ``loss``, ``reward_mean``, ``accuracy``, ``clip_ratio``,
        ``importance_weight_mean``, ``importance_weight_max``, ``importance_weight_capped_ratio``,
        ``behaviour_kl``, ``entropy``, ``grad_norm``, ``learning_rate``, ``staleness_max``.

        Raises:
            ValueError: an unknown ``stats`` key (nothing is recorded).
        """
        gauges = {
            "loss": self.loss,
            "reward_mean": self.reward_mean,
            "accuracy": self.accuracy,
            "clip_ratio": self.clip,
            "importance_weight_mean": self.importance_weight_mean,
            "importance_weight_max": self.importance_weight_max,
            "importance_weight_capped_ratio": self.importance_weight_capped,
            "behaviour_kl": self.behaviour_kl,
            "entropy": self.entropy,
            "grad_norm": self.grad_norm,
            "learning_rate": self.learning_rate,
            "staleness_max": self.batch_staleness_max,
        }
        unknown = sorted(set(stats or {}) - set(gauges))
        if unknown:
            raise ValueError(f"unknown trainer stats {unknown}: known keys are {sorted(gauges)}")
        for value, what in ((tokens, "tokens"), (response_tokens, "response_tokens"), (samples, "samples")):
            _check_nonneg(value, what)
        self.steps.inc()
        self.step.set(step)
        self.last_step_timestamp.set(time.time())
        self.tokens.inc(tokens)
        self.response_tokens.inc(response_tokens)
        self.samples.inc(samples)
        for key, value in (stats or {}).items():
            gauges[key].set(value)

    def published(self, version: int, transport: str, duration_seconds: float, nbytes: int | None = None, lineage: int | None = None) -> None:
        """Record a published policy version."""
        t = _check(transport, WEIGHT_TRANSPORTS, "transport")
        _check_nonneg(duration_seconds, "duration_seconds")
        self.weight_publish_duration.labels(t).observe(duration_seconds)
        self.policy_version.set(version)
        if nbytes is not None:
            self.weight_publish_bytes.set(nbytes)
        if lineage is not None:
            self.lineage.set(lineage)


class ControllerMetrics:
    """Metrics of the controller / feeder (``asyncrl train`` or the Kubernetes controller Job)."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.prompts_fed = Counter("asyncrl_controller_prompts_fed", "Prompt groups streamed from the dataset into Redis.", registry=r)
        self.dataset_epoch = Gauge("asyncrl_controller_dataset_epoch", "Passes completed over the training split.", registry=r)
        self.role_processes = Gauge(
            "asyncrl_controller_role_processes", "Live child processes the controller supervises, by role.", ["role"], registry=r
        )
        self.role_restarts = Counter(
            "asyncrl_controller_role_restarts",
            "Child processes restarted by the controller, by role and reason (exit/unhealthy).",
            ["role", "reason"],
            registry=r,
        )
        self.eval_accuracy = Gauge(
            "asyncrl_controller_eval_accuracy_ratio", "Held-out accuracy (0-1) of the last evaluation.", registry=r
        )
        self.eval_duration = Histogram(
            "asyncrl_controller_eval_duration_seconds", "Wall time of a held-out evaluation.", buckets=PHASE_DURATION_BUCKETS_SECONDS, registry=r
        )
        self.run_progress = Gauge(
            "asyncrl_controller_run_progress_ratio", "Trainer steps done / run.total_steps (0-1).", registry=r
        )

    def restarted(self, role: str, reason: str) -> None:
        """Count a restart of a ``role`` process (``reason`` is ``exit`` or ``unhealthy``)."""
        self.role_restarts.labels(_check(role, ROLES, "role"), _check(reason, ("exit", "unhealthy"), "restart reason")).inc()


# ----------------------------------------------------------------------------------------------
# build info, registries, serving


def git_sha(repo: Path | None = None) -> str:
    """The source tree's commit: ``$ASYNCRL_GIT_SHA`` (set in the image), else ``.git/HEAD``, else ``unknown``.

    Reads the files directly (no ``git`` subprocess) so it is cheap and works in slim images.
    """
    env = os.environ.get("ASYNCRL_GIT_SHA")
    if env:
        return env[:40]
    root = repo or Path(__file__).resolve().parents[2]
    try:
        head = (root / ".git" / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            ref_file = root / ".git" / ref
            if ref_file.exists():
                return ref_file.read_text().strip()[:40]
            packed = root / ".git" / "packed-refs"
            for line in packed.read_text().splitlines() if packed.exists() else []:
                sha, _, name = line.partition(" ")
                if name == ref:
                    return sha[:40]
            return "unknown"
        return head[:40]
    except OSError:
        return "unknown"


def build_info(registry: CollectorRegistry, role: str) -> Gauge:
    """Create ``asyncrl_build_info{version,git_sha,role} 1`` on ``registry``.

    Dashboards join on it (``label_values(asyncrl_build_info, job)``) and alerts use it to see
    which roles are up.

    Raises:
        ValueError: ``role`` not in :data:`ROLES`.
    """
    from asyncrl import __version__

    _check(role, ROLES, "role")
    g = Gauge("asyncrl_build_info", "Build of this asyncrl process (always 1).", ["version", "git_sha", "role"], registry=registry)
    g.labels(__version__, git_sha(), role).set(1)
    return g


def role_registry(role: str) -> tuple[CollectorRegistry, object]:
    """A fresh registry with ``asyncrl_build_info`` and the catalogue of ``role``.

    Returns ``(registry, metrics)`` where ``metrics`` is a :class:`RolloutMetrics`,
    :class:`TrainerMetrics`, :class:`ControllerMetrics` or :class:`BufferMetrics`.

    Raises:
        ValueError: unknown ``role``.
    """
    classes = {"rollout": RolloutMetrics, "trainer": TrainerMetrics, "controller": ControllerMetrics, "buffer": BufferMetrics}
    _check(role, ROLES, "role")
    reg = CollectorRegistry()
    build_info(reg, role)
    return reg, classes[role](reg)


def exposition(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """Render ``registry`` for a scrape: ``(body, content_type)``, always the classic text format 0.0.4.

    No OpenMetrics negotiation, on purpose: Prometheus 2.x asks for OpenMetrics without an
    ``escaping`` parameter, and prometheus_client (0.26) then rewrites colons in metric names
    to underscores (``escaping=underscores``), so SGLang-named series (``sglang:num_running_reqs``)
    would arrive as ``sglang_num_running_reqs`` and the dashboard's engine panels would stay
    empty. The text format keeps names as they are and every Prometheus version reads it.
    ``accept`` is accepted for symmetry with handlers and ignored.
    """
    return prometheus_client.generate_latest(registry), prometheus_client.exposition.CONTENT_TYPE_PLAIN_0_0_4


def metrics_app_handler(registry: CollectorRegistry):
    """An aiohttp handler serving ``registry`` (``app.router.add_get("/metrics", handler)``).

    The content type carries a charset, so it goes in ``headers`` — aiohttp's
    ``content_type=`` argument rejects charsets (ecosystem.md B.1). Serves the classic text
    format whatever the ``Accept`` header says (see :func:`exposition`), so a registry that
    also holds SGLang-named engine metrics keeps their colons.
    """
    from aiohttp import web

    async def handle_metrics(request: "web.Request") -> "web.Response":
        body, content_type = exposition(registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    return handle_metrics


_SERVERS: dict[int, object] = {}


def start_metrics_server(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread; returns the bound port.

    Same body as :func:`metrics_app_handler` (classic text format, see :func:`exposition`).

    For roles without an HTTP server of their own (trainer rank 0, the controller). ``port`` 0
    picks a free port. Loopback by default (ARCHITECTURE §8); in a pod pass ``0.0.0.0``.

    Raises:
        OSError: the port is taken (the message names it).
    """
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    def app(environ, start_response):
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: metrics are at /metrics\n"]
        body, content_type = exposition(registry)
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    class _Quiet(WSGIRequestHandler):
        def log_message(self, *args):  # one line per scrape would flood the role's log
            pass

    try:
        httpd = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror}") from exc
    threading.Thread(target=httpd.serve_forever, name=f"metrics-{httpd.server_port}", daemon=True).start()
    bound = int(httpd.server_port)
    _SERVERS[bound] = httpd
    return bound


def stop_metrics_server(port: int) -> None:
    """Stop a server started by :func:`start_metrics_server` (no-op for an unknown port)."""
    httpd = _SERVERS.pop(port, None)
    if httpd is not None:
        httpd.shutdown()  # type: ignore[attr-defined]
        httpd.server_close()  # type: ignore[attr-defined]


#: Unit spellings that are not base units (promtool 2.42 flags only some of them).
_BAD_UNIT = re.compile(r"(_ms|_us|_ns|_millis|_milliseconds|_minutes|_hours|_kb|_mb|_gb|_kib|_mib|_gib|_percent|_pct)(_|$)")
#: Labels whose values are unbounded (one series per sample/request/prompt).
_BAD_LABELS = frozenset({"sample_id", "request_id", "rid", "group_id", "prompt", "prompt_id", "text", "user", "step", "version"})
_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


def lint_exposition(text: str, exempt_prefixes: tuple[str, ...] = ("sglang:",)) -> list[str]:
    """Check a text exposition against asyncrl's naming rules; returns the problems (empty: clean).

    Complements ``promtool check metrics`` (which misses ``_gib``/``_percent`` and label
    cardinality): every family is ``asyncrl_``-prefixed snake_case without colons, uses no
    abbreviated or non-base unit, counters end in ``_total``, ``_ratio`` gauges stay in 0..1,
    no ``_created`` series, has help text, and carries no unbounded label (sample/request ids,
    prompts, step or version numbers as labels; ``asyncrl_build_info{version}`` excepted).
    Families whose name starts with one of ``exempt_prefixes`` (SGLang's engine metrics) are
    skipped.
    """
    from prometheus_client.parser import text_string_to_metric_families

    problems: list[str] = []
    for fam in text_string_to_metric_families(text):
        name = fam.name
        if name.startswith(exempt_prefixes):
            continue
        full = name + "_total" if fam.type == "counter" else name
        if not name.startswith("asyncrl_"):
            problems.append(f"{full}: name must start with asyncrl_")
        if ":" in name or not _NAME.match(name):
            problems.append(f"{full}: snake_case [a-z0-9_] only, no colons (colons are for recording rules)")
        if _BAD_UNIT.search(name):
            problems.append(f"{full}: use base units (_seconds, _bytes, _ratio 0-1), not {_BAD_UNIT.search(name).group(1)}")
        if not fam.documentation:
            problems.append(f"{full}: no help text")
        if fam.type == "counter" and name.endswith("_total"):
            problems.append(f"{full}: counter name doubled _total")
        if fam.type != "counter" and name.endswith("_total"):
            problems.append(f"{full}: only counters end in _total (type {fam.type})")
        for s in fam.samples:
            if s.name.endswith("_created"):
                problems.append(f"{s.name}: _created series must be disabled")
            bad = sorted(set(s.labels) & _BAD_LABELS - ({"version"} if name == "asyncrl_build_info" else set()))
            if bad:
                problems.append(f"{full}: high-cardinality label(s) {bad}")
            if name.endswith("_ratio") and not 0.0 <= s.value <= 1.0:
                problems.append(f"{s.name}: ratio {s.value} outside 0..1")
    return sorted(set(problems))
