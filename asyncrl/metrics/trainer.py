"""The trainer's metric catalogue (``asyncrl_trainer_*``): :class:`TrainerMetrics`."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrl.metrics.idle import IdleTracker
from asyncrl.metrics.labels import (
    PHASE_DURATION_BUCKETS_SECONDS,
    RESULTS,
    TRAINER_PHASES,
    WEIGHT_SYNC_BUCKETS_SECONDS,
    WEIGHT_TRANSPORTS,
    _check,
    _check_nonneg,
    _zero,
)


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
        self.value_loss = Gauge(
            "asyncrl_trainer_value_loss", "Clipped value loss of the critic in the last step (PPO with GAE).", registry=r
        )
        self.explained_variance = Gauge(
            "asyncrl_trainer_explained_variance",
            "Critic explained variance 1 - Var(R - V)/Var(R) on the last train batch (1 perfect, <= 0 useless).",
            registry=r,
        )
        self.kl_coef = Gauge(
            "asyncrl_trainer_kl_reward_coef", "Coefficient beta of the KL penalty in the reward (kl_ctl; adaptive or fixed).",
            registry=r,
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
        ``behaviour_kl``, ``entropy``, ``grad_norm``, ``learning_rate``, ``staleness_max``, and with
        a critic ``value_loss``, ``explained_variance``, ``kl_ctl``.

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
            "value_loss": self.value_loss,
            "explained_variance": self.explained_variance,
            "kl_ctl": self.kl_coef,
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
