"""The reward-model server's metric catalogue (``asyncrl_reward_model_*``): :class:`RewardModelMetrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrl.metrics.labels import (
    RM_BATCH_SIZE_BUCKETS,
    RM_DURATION_BUCKETS_SECONDS,
    RM_REQUEST_RESULTS,
    _check,
    _check_nonneg,
    _zero,
)


class RewardModelMetrics:
    """Metrics of one reward-model server (``asyncrl reward-model``), served on its ``/metrics``.

    Attributes are the ``prometheus_client`` metric objects; the methods bundle the common
    updates and validate labels (:data:`asyncrl.metrics.labels.RM_REQUEST_RESULTS`).
    """

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.requests = Counter(
            "asyncrl_reward_model_requests",
            "POST /score requests, by result (ok/bad_request/unauthorized/draining/error).",
            ["result"],
            registry=r,
        )
        _zero(self.requests, RM_REQUEST_RESULTS)
        self.request_duration = Histogram(
            "asyncrl_reward_model_request_duration_seconds",
            "Wall time of one answered POST /score request, queueing included.",
            buckets=RM_DURATION_BUCKETS_SECONDS,
            registry=r,
        )
        self.texts = Counter("asyncrl_reward_model_texts", "Texts scored by the reward model.", registry=r)
        self.tokens = Counter(
            "asyncrl_reward_model_tokens", "Tokens run through the reward model (after truncation, no padding).", registry=r
        )
        self.batch_size = Histogram(
            "asyncrl_reward_model_batch_size",
            "Texts per forward pass (the dynamic batcher's batches).",
            buckets=RM_BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.batch_duration = Histogram(
            "asyncrl_reward_model_batch_duration_seconds",
            "Wall time of one forward pass (tokenization included).",
            buckets=RM_DURATION_BUCKETS_SECONDS,
            registry=r,
        )
        self.queue_texts = Gauge(
            "asyncrl_reward_model_queue_texts", "Texts waiting for or in a forward pass right now.", registry=r
        )

    def request_done(self, result: str, duration_seconds: float | None = None) -> None:
        """Count one request by ``result``; ``duration_seconds`` (answered requests) feeds the latency histogram.

        Raises:
            ValueError: unknown ``result`` or a negative duration.
        """
        self.requests.labels(_check(result, RM_REQUEST_RESULTS, "reward-model request result")).inc()
        if duration_seconds is not None:
            self.request_duration.observe(_check_nonneg(duration_seconds, "duration_seconds"))

    def batch_done(self, texts: int, tokens: int, duration_seconds: float) -> None:
        """Record one forward pass over ``texts`` texts holding ``tokens`` tokens."""
        self.batch_size.observe(_check_nonneg(texts, "texts"))
        self.batch_duration.observe(_check_nonneg(duration_seconds, "duration_seconds"))
        self.texts.inc(texts)
        self.tokens.inc(_check_nonneg(tokens, "tokens"))
