"""The environment server's metric catalogue (``asyncrl_env_server_*``): :class:`EnvServerMetrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrl.metrics.labels import ENV_CALL_OUTCOMES, ENV_DURATION_BUCKETS_SECONDS, ENV_TOOLS, _check, _check_nonneg


class EnvServerMetrics:
    """Metrics of one environment server (``asyncrl env-server``), served on its ``/metrics``.

    Attributes are the ``prometheus_client`` metric objects; :meth:`call_done` bundles the
    updates of one call and validates its labels (:data:`asyncrl.metrics.labels.ENV_TOOLS`,
    :data:`~asyncrl.metrics.labels.ENV_CALL_OUTCOMES`).
    """

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.calls = Counter(
            "asyncrl_env_server_calls",
            "Tool calls by tool and outcome (ok/tool_error/deadline/bad_request/unauthorized/draining).",
            ["tool", "outcome"],
            registry=r,
        )
        for tool in ENV_TOOLS:
            for outcome in ENV_CALL_OUTCOMES:
                self.calls.labels(tool, outcome)
        self.replayed_calls = Counter(
            "asyncrl_env_server_replayed_calls",
            "Tool calls of episodes being replayed by durable execution (their latency is paid again).",
            ["tool"],
            registry=r,
        )
        for tool in ENV_TOOLS:
            self.replayed_calls.labels(tool)
        self.call_duration = Histogram(
            "asyncrl_env_server_call_duration_seconds",
            "Time of one answered tool call on the server, queueing for a free slot included.",
            ["tool"],
            buckets=ENV_DURATION_BUCKETS_SECONDS,
            registry=r,
        )
        self.latency = Histogram(
            "asyncrl_env_server_latency_seconds",
            "The latency drawn for each call from agent.env_server.latency (before its deadline cuts it).",
            ["tool"],
            buckets=ENV_DURATION_BUCKETS_SECONDS,
            registry=r,
        )
        self.in_flight = Gauge("asyncrl_env_server_calls_in_flight", "Tool calls running or queued now.", registry=r)
        self.deadline_seconds = Gauge(
            "asyncrl_env_server_deadline_seconds", "The server's deadline of one call (agent.env_server.deadline_seconds).",
            registry=r,
        )

    def call_done(self, tool: str, outcome: str, duration_seconds: float | None = None,
                  latency_seconds: float | None = None, replay: bool = False) -> None:
        """Count one call of ``tool`` by ``outcome``; answered calls also feed the histograms.

        Raises:
            ValueError: an unknown tool or outcome, or a negative duration or latency.
        """
        _check(tool, ENV_TOOLS, "environment tool")
        self.calls.labels(tool, _check(outcome, ENV_CALL_OUTCOMES, "environment call outcome")).inc()
        if duration_seconds is not None:
            self.call_duration.labels(tool).observe(_check_nonneg(duration_seconds, "duration_seconds"))
        if latency_seconds is not None:
            self.latency.labels(tool).observe(_check_nonneg(latency_seconds, "latency_seconds"))
        if replay:
            self.replayed_calls.labels(tool).inc()
