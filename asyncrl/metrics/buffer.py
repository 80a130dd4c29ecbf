"""The replay buffer's metric catalogue (``asyncrl_buffer_*``): :class:`BufferMetrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrl.metrics.labels import (
    DROP_REASONS,
    GROUP_STATES,
    PHASE_DURATION_BUCKETS_SECONDS,
    RESTART_REASONS,
    SAMPLE_STATES,
    STALENESS_BUCKETS,
    _check,
    _zero,
)


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
        self.restart_discarded_tokens = Counter(
            "asyncrl_buffer_restart_discarded_tokens",
            "Model tokens that restarted samples held and threw away (rate() against the rollout's generated "
            "tokens is the share of its work that restarts lost).",
            registry=r,
        )
        self.reclaimed = Counter(
            "asyncrl_buffer_work_reclaimed", "Claimed work of a silent worker reclaimed after the lease (XAUTOCLAIM).", registry=r
        )
        self.groups_finished = Counter(
            "asyncrl_buffer_groups_finished",
            "Prompt groups whose samples were all scored or failed with enough scored to train (before dynamic sampling).",
            registry=r,
        )
        self.groups_zero_variance = Counter(
            "asyncrl_buffer_groups_zero_variance",
            "Finished prompt groups whose trained samples all had the same reward (no GRPO signal; DAPO dynamic "
            "sampling drops them when on).",
            registry=r,
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
