"""The controller's metric catalogue (``asyncrl_controller_*``): :class:`ControllerMetrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrl.metrics.labels import PHASE_DURATION_BUCKETS_SECONDS, ROLES, _check


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
