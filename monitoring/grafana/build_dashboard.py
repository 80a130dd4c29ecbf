"""Generate ``dashboards/asyncrl-overview.json``, the Grafana overview of an asyncrl run.

Why a generator: the dashboard has ~20 panels with the same datasource/run boilerplate;
writing them as data keeps the JSON consistent (every target uses the ``${datasource}``
variable, every query filters ``run=~"$run"``). The JSON is committed (Grafana provisioning
reads files, not Python); ``tests/test_monitoring.py`` checks that the committed file equals
this script's output, that every expression parses (promtool) and that every metric it names
exists in asyncrl's registries (asyncrl/metrics/) or is an SGLang engine metric.

Classic dashboard model (Grafana's "Dashboard JSON model",
https://grafana.com/docs/grafana/latest/dashboards/build-dashboards/view-dashboard-json-model/):
stable ``uid``, ``id: null``, no ``__inputs``, a ``datasource`` template variable.
Run: ``python monitoring/grafana/build_dashboard.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

UID = "asyncrl-overview"
DS = {"type": "prometheus", "uid": "${datasource}"}
R = 'run=~"$run"'
OUT = Path(__file__).resolve().parent / "dashboards" / "asyncrl-overview.json"


def _rate(metric: str, sel: str = "", by: str = "") -> str:
    labels = R + ("," + sel if sel else "")
    agg = f"sum by ({by}) " if by else "sum "
    return f"{agg}(rate({metric}{{{labels}}}[$__rate_interval]))"


def _quantile(q: float, metric: str, by: str = "", sel: str = "") -> str:
    labels = R + ("," + sel if sel else "")
    keep = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({keep}) (rate({metric}_bucket{{{labels}}}[$__rate_interval])))"


def _mean(metric: str, by: str = "") -> str:
    agg = f"sum by ({by}) " if by else "sum "
    return (
        f"{agg}(rate({metric}_sum{{{R}}}[$__rate_interval])) / "
        f"{agg}(rate({metric}_count{{{R}}}[$__rate_interval]))"
    )


def _panel(title: str, targets: list[tuple[str, str]], unit: str, description: str, kind: str = "timeseries", stack: bool = False, minmax: tuple | None = None) -> dict:
    defaults: dict = {"unit": unit}
    if minmax:
        defaults["min"], defaults["max"] = minmax
    if kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if stack else 0, "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi", "sort": "none"}}
        if kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "value", "graphMode": "area"},
        "targets": [
            {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i), "range": True}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def _row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def rows() -> list[list[dict]]:
    """Panels grouped by row; each inner list is laid out left to right, 24 columns wide."""
    return [
        [_row("Run overview")],
        [
            _panel("Policy version", [(f"max({'asyncrl_buffer_policy_version'}{{{R}}})", "clock (Redis)")], "none", "Newest published policy version (the version clock).", kind="stat"),
            _panel("Trainer step", [(f"max(asyncrl_trainer_step{{{R}}})", "step")], "none", "Last completed optimizer step.", kind="stat"),
            _panel("Run progress", [(f"max(asyncrl_controller_run_progress_ratio{{{R}}})", "progress")], "percentunit", "Steps done / run.total_steps.", kind="stat", minmax=(0, 1)),
            _panel("Lineage", [(f"max(asyncrl_buffer_lineage{{{R}}})", "lineage")], "none", "Increases when a recovery rewinds the trainer to an older checkpoint.", kind="stat"),
            _panel("Roles up", [(f"count by (role) (asyncrl_build_info{{{R}}})", "{{role}}")], "none", "Processes exporting metrics, by role.", kind="stat"),
            _panel("Held-out accuracy", [(f"max(asyncrl_controller_eval_accuracy_ratio{{{R}}})", "eval")], "percentunit", "Accuracy of the last periodic evaluation.", kind="stat", minmax=(0, 1)),
        ],
        [_row("Throughput")],
        [
            _panel("Tokens per second", [
                (_rate("asyncrl_rollout_generated_tokens_total"), "generated (rollout)"),
                (_rate("asyncrl_trainer_response_tokens_total"), "trained response tokens"),
                (_rate("asyncrl_trainer_tokens_total"), "trained tokens (prompt+response)"),
            ], "short", "Generation vs training throughput; a persistent gap means one side waits."),
            _panel("Requests by finish reason", [(_rate("asyncrl_rollout_requests_total", by="finish_reason"), "{{finish_reason}}")], "reqps", "Engine requests (segments) per second; budget/abort end as partial samples.", stack=True),
            _panel("Steps per minute", [(f"60 * {_rate('asyncrl_trainer_steps_total')}", "steps/min")], "short", "Optimizer steps per minute."),
        ],
        [_row("Versions, staleness and partial rollouts")],
        [
            _panel("Policy versions", [
                (f"max(asyncrl_buffer_policy_version{{{R}}})", "clock"),
                (f"max(asyncrl_trainer_policy_version{{{R}}})", "trainer published"),
                (f"asyncrl_rollout_policy_version{{{R}}}", "engine {{instance}}"),
            ], "none", "Each engine should follow the clock within a weight sync."),
            _panel("Sample staleness", [
                (_quantile(0.5, "asyncrl_buffer_sample_staleness"), "p50"),
                (_quantile(0.95, "asyncrl_buffer_sample_staleness"), "p95"),
                (f"max(asyncrl_trainer_batch_staleness_max{{{R}}})", "batch max"),
                (f"max(asyncrl_buffer_max_staleness{{{R}}})", "bound (max_staleness)"),
            ], "none", "Policy versions between a sample's oldest token and the version it is trained at."),
            _panel("Partial ratio", [
                (f"sum(rate(asyncrl_rollout_requests_total{{{R},finish_reason=~\"budget|abort\"}}[$__rate_interval])) / {_rate('asyncrl_rollout_requests_total')}", "segments ending partial"),
            ], "percentunit", "Share of engine requests that ended with the sample parked (budget or weight-update abort).", minmax=(0, 1)),
            _panel("Partials parked and resumed", [
                (_rate("asyncrl_rollout_partial_parked_total", by="reason"), "parked: {{reason}}"),
                (_rate("asyncrl_rollout_partial_resumes_total"), "resumed"),
            ], "ops", "Partial samples parked (by reason) and resumed per second."),
        ],
        [_row("Buffer")],
        [
            _panel("Samples by state", [(f"max by (state) (asyncrl_buffer_samples{{{R}}})", "{{state}}")], "short", "Samples in the Redis replay buffer.", stack=True),
            _panel("Groups by state", [
                (f"max by (state) (asyncrl_buffer_groups{{{R}}})", "{{state}}"),
                (f"max(asyncrl_buffer_group_capacity{{{R}}})", "capacity (R)"),
            ], "short", "Prompt groups in flight, READY, claimed by the trainer, acknowledged."),
            _panel("Drops and restarts", [
                (_rate("asyncrl_buffer_samples_dropped_total", by="reason"), "samples dropped: {{reason}}"),
                (_rate("asyncrl_buffer_groups_dropped_total", by="reason"), "groups dropped: {{reason}}"),
                (_rate("asyncrl_buffer_samples_restarted_total", by="reason"), "samples restarted: {{reason}}"),
                (_rate("asyncrl_buffer_groups_restarted_total", by="reason"), "groups restarted: {{reason}}"),
                (_rate("asyncrl_buffer_work_reclaimed_total"), "work reclaimed"),
            ], "ops", "Work thrown away or regenerated, by reason."),
            _panel("Admission control", [
                (_quantile(0.95, "asyncrl_buffer_admission_wait_seconds"), "wait p95"),
                (_rate("asyncrl_buffer_admission_blocked_total"), "blocked checks/s"),
                (_rate("asyncrl_buffer_groups_admitted_total"), "groups admitted/s"),
            ], "s", "Time new groups wait for the staleness bound to admit them."),
        ],
        [_row("Reward and accuracy")],
        [
            _panel("Reward", [
                (f"avg(asyncrl_trainer_reward_mean{{{R}}})", "train batch mean"),
                (_quantile(0.5, "asyncrl_rollout_reward"), "scored samples median"),
            ], "none", "Mean reward of train batches; median reward of freshly scored samples (a histogram with negative buckets has no _sum, so no mean)."),
            _panel("Accuracy", [
                (f"avg(asyncrl_trainer_accuracy_ratio{{{R}}})", "train batch"),
                (f"sum(rate(asyncrl_rollout_samples_scored_total{{{R},outcome=\"correct\"}}[$__rate_interval])) / sum(rate(asyncrl_rollout_samples_scored_total{{{R},outcome=~\"correct|incorrect\"}}[$__rate_interval]))", "rollouts"),
                (f"max(asyncrl_controller_eval_accuracy_ratio{{{R}}})", "held-out eval"),
            ], "percentunit", "Share of correct samples.", minmax=(0, 1)),
            _panel("Rollout duration and length", [
                (_quantile(0.5, "asyncrl_rollout_duration_seconds"), "duration p50"),
                (_quantile(0.95, "asyncrl_rollout_duration_seconds"), "duration p95"),
            ], "s", "Wall time of whole samples (all segments)."),
            _panel("Response length", [
                (_quantile(0.5, "asyncrl_rollout_response_length_tokens"), "p50"),
                (_quantile(0.95, "asyncrl_rollout_response_length_tokens"), "p95"),
            ], "short", "Response tokens of completed samples."),
        ],
        [_row("Trainer")],
        [
            _panel("Step phases (mean seconds)", [(_mean("asyncrl_trainer_step_duration_seconds", by="phase"), "{{phase}}")], "s", "wait_batch -> forward_backward -> optim_step -> publish_weights.", stack=True),
            _panel("Idle ratio", [
                (f"avg(rate(asyncrl_rollout_idle_seconds_total{{{R}}}[$__rate_interval]))", "rollout workers"),
                (f"avg(rate(asyncrl_trainer_idle_seconds_total{{{R}}}[$__rate_interval]))", "trainer"),
            ], "percentunit", "Share of time with nothing to do (rollout: no request in flight; trainer: waiting for a batch).", minmax=(0, 1)),
            _panel("Loss and KL", [
                (f"avg(asyncrl_trainer_loss{{{R}}})", "loss"),
                (f"avg(asyncrl_trainer_behaviour_kl{{{R}}})", "KL(behaviour || policy)"),
                (f"avg(asyncrl_trainer_entropy{{{R}}})", "entropy"),
            ], "none", "Policy loss, behaviour-vs-trainer KL (k3) and entropy of the last step."),
            _panel("Clipping and importance weights", [
                (f"avg(asyncrl_trainer_clip_ratio{{{R}}})", "clip ratio"),
                (f"avg(asyncrl_trainer_importance_weight_mean{{{R}}})", "IW mean"),
                (f"max(asyncrl_trainer_importance_weight_max{{{R}}})", "IW max"),
                (f"avg(asyncrl_trainer_importance_weight_capped_ratio{{{R}}})", "IW capped ratio"),
            ], "none", "PPO clip fraction and behaviour importance weights pi_prox/pi_behav."),
        ],
        [_row("Weight sync")],
        [
            _panel("Publish and load time", [
                (_quantile(0.95, "asyncrl_trainer_weight_publish_duration_seconds", by="transport"), "publish p95 {{transport}}"),
                (_quantile(0.95, "asyncrl_rollout_weight_load_duration_seconds", by="transport"), "load p95 {{transport}}"),
                (_quantile(0.95, "asyncrl_rollout_weight_sync_lag_seconds"), "publish-to-live lag p95"),
            ], "s", "Trainer publish time, engine pause-to-continue time, and end-to-end lag."),
            _panel("Weight updates", [(_rate("asyncrl_rollout_weight_updates_total", by="result"), "{{result}}")], "ops", "Weight updates applied by engines, by result."),
            _panel("Checkpoints", [(_quantile(0.95, "asyncrl_trainer_checkpoint_duration_seconds"), "checkpoint p95")], "s", "Checkpoint write time (must stay below the pods' termination grace period)."),
        ],
        [_row("Engine load (SGLang metric names; the embedded engine exports the same)")],
        [
            _panel("Running and queued requests", [
                (f"sum by (instance) (sglang:num_running_reqs{{{R}}})", "running {{instance}}"),
                (f"sum by (instance) (sglang:num_queue_reqs{{{R}}})", "queued {{instance}}"),
            ], "short", "Engine batch occupancy."),
            _panel("Engine generation throughput", [(f"sum by (instance) (sglang:gen_throughput{{{R}}})", "{{instance}}")], "short", "Tokens per second reported by each engine."),
            _panel("KV cache usage", [(f"max by (instance) (sglang:token_usage{{{R}}})", "{{instance}}")], "percentunit", "Share of the KV cache in use.", minmax=(0, 1)),
            _panel("In-flight requests (worker)", [(f"sum by (instance) (asyncrl_rollout_inflight_requests{{{R}}})", "{{instance}}")], "short", "Requests each rollout worker keeps in flight."),
        ],
        [_row("Agent episodes (multi-turn workflows, docs/agents.md)")],
        [
            _panel("Episodes by termination", [(_rate("asyncrl_rollout_episodes_total", by="termination"), "{{termination}}")],
                   "ops", "Episodes finished per second, by why they ended (env_done, turn_limit, token_limit, timeout, error).", stack=True),
            _panel("Turns and tool calls per episode", [
                (_mean("asyncrl_rollout_episode_turns"), "turns (mean)"),
                (_mean("asyncrl_rollout_episode_tool_calls"), "tool calls (mean)"),
            ], "short", "Model calls and tool calls per finished episode."),
            _panel("Replayed calls and restarts", [
                (_rate("asyncrl_rollout_episode_replayed_calls_total"), "replayed calls"),
                (_rate("asyncrl_rollout_episode_restarts_total", by="reason"), "restarts {{reason}}"),
            ], "ops", "Model calls of resumed episodes answered from the buffer's record; episodes restarted because a replay differed."),
        ],
    ]


def build() -> dict:
    """The dashboard as a dict (classic model)."""
    panels: list[dict] = []
    y = 0
    pid = 1
    for row in rows():
        if row[0]["type"] == "row":
            p = dict(row[0], id=pid, gridPos={"h": 1, "w": 24, "x": 0, "y": y})
            panels.append(p)
            pid += 1
            y += 1
            continue
        h = 4 if row[0]["type"] == "stat" else 8
        w = 24 // len(row)
        for i, p in enumerate(row):
            panels.append(dict(p, id=pid, gridPos={"h": h, "w": w, "x": i * w, "y": y}))
            pid += 1
        y += h
    return {
        "id": None,
        "uid": UID,
        "title": "asyncrl — run overview",
        "description": "Asynchronous partial-rollout RL: throughput, versions and staleness, partial rollouts, buffer, reward, trainer phases, weight sync, engine load.",
        "tags": ["asyncrl", "rl", "llm"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 41,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "links": [],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "hide": 0, "current": {}, "refresh": 1, "regex": "", "options": []},
            {"name": "run", "label": "Run", "type": "query", "datasource": DS, "query": {"query": "label_values(asyncrl_build_info, run)", "refId": "run"},
             "definition": "label_values(asyncrl_build_info, run)", "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "hide": 0, "sort": 1, "options": []},
        ]},
        "panels": panels,
    }


def render() -> str:
    """The dashboard JSON text exactly as committed."""
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
