"""The Prometheus metric catalogue of every asyncrl role, and how each role serves it.

Why one package: dashboards, alert rules and tests refer to metric *names*; keeping every
name, type, unit, label set and bucket layout in one place means a rename breaks a test here
(``tests/test_monitoring.py`` checks every dashboard/rule expression against these
registries) instead of silently emptying a Grafana panel.

Layout (import everything from ``asyncrl.metrics``; the modules are one job each):
``labels`` (closed label sets, bucket layouts, label checks), ``idle`` (:class:`IdleTracker`),
one catalogue per role (``rollout``, ``buffer``, ``trainer``, ``controller``, ``reward_model``), ``serving``
(build info, registries, exposition, HTTP servers) and ``lint`` (:func:`lint_exposition`).
Beside the catalogue, not re-exported: ``tracking`` (the metrics-*.jsonl records, TensorBoard
and W&B sinks) and ``report`` (``asyncrl report``: curves and a summary drawn from those records).

Conventions (prometheus.io "Metric and label naming", https://prometheus.io/docs/practices/naming/):

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
the controller exports :class:`ControllerMetrics`; the reward-model server exports
:class:`RewardModelMetrics`; the environment server exports :class:`EnvServerMetrics`.
:class:`BufferMetrics` counts replay-buffer
events and may be instantiated in any process that performs them (counters add up across
processes with ``sum``); its state gauges (samples by state, the version clock) are set only
by the process that polls the buffer's stats (the controller).

Simplifications: the trainer exports only from rank 0 (no multiprocess collector); idle
time is measured by the role itself with :class:`IdleTracker` (busy/idle transitions), not
sampled by an external profiler. docs/metrics.md lists every metric.
"""

from __future__ import annotations

from asyncrl.metrics.buffer import BufferMetrics
from asyncrl.metrics.controller import ControllerMetrics
from asyncrl.metrics.idle import IdleTracker
from asyncrl.metrics.labels import (
    DROP_REASONS,
    FINISH_REASONS,
    GROUP_STATES,
    PARK_REASONS,
    PHASE_DURATION_BUCKETS_SECONDS,
    REQUEST_DURATION_BUCKETS_SECONDS,
    RESPONSE_LENGTH_BUCKETS_TOKENS,
    RESTART_REASONS,
    RESULTS,
    REWARD_BUCKETS,
    ROLES,
    ROLLOUT_DURATION_BUCKETS_SECONDS,
    SAMPLE_STATES,
    SCORE_OUTCOMES,
    SGLANG_ENGINE_METRICS,
    STALENESS_BUCKETS,
    TRAINER_PHASES,
    WEIGHT_SYNC_BUCKETS_SECONDS,
    WEIGHT_TRANSPORTS,
    exponential_buckets,
)
from asyncrl.metrics.lint import lint_exposition
from asyncrl.metrics.env_server import EnvServerMetrics
from asyncrl.metrics.reward_model import RewardModelMetrics
from asyncrl.metrics.rollout import RolloutMetrics
from asyncrl.metrics.serving import (
    build_info,
    exposition,
    git_sha,
    metrics_app_handler,
    role_registry,
    start_metrics_server,
    stop_metrics_server,
)
from asyncrl.metrics.trainer import TrainerMetrics

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
    "RewardModelMetrics",
    "EnvServerMetrics",
    "build_info",
    "git_sha",
    "role_registry",
    "metrics_app_handler",
    "start_metrics_server",
    "stop_metrics_server",
    "exposition",
    "lint_exposition",
]
