"""SGLang's ``sglang:`` engine gauges and counters of the embedded server, from the engine's statistics."""

from __future__ import annotations

from typing import Any

__all__ = ["EngineCollector"]


def metric_model_name(name: str | None) -> str:
    """The ``model_name`` label of /metrics: the served name's last path component, so that a
    model path (the default served name) never puts a filesystem path in a label (docs/security.md)."""
    text = str(name or "")
    return text.rstrip("/").rsplit("/", 1)[-1] or text


class EngineCollector:
    """Exports SGLang's ``sglang:`` engine gauges and counters from the engine's statistics."""

    def __init__(self, server: Any):
        self.server = server

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        eng = self.server.engine
        name = metric_model_name(self.server.opts.served_model_name)
        load = eng.load()
        gauges = {
            "num_running_reqs": ("Running requests.", load["num_running_reqs"]),
            "num_queue_reqs": ("Requests waiting in the queue.", load["num_waiting_reqs"]),
            "num_used_tokens": ("Tokens held by running requests.", load["num_used_tokens"]),
            "token_usage": ("Used share of max_total_num_tokens.", load["token_usage"]),
            "gen_throughput": ("Generation throughput, tokens per second.", load["gen_throughput"]),
            "num_paused_reqs": ("Requests paused by a weight-sync pause.", load["num_paused_reqs"]),
            "max_total_num_tokens": ("Token capacity.", load["max_total_num_tokens"]),
        }
        for key, (doc, value) in gauges.items():
            g = GaugeMetricFamily(f"sglang:{key}", doc, labels=["model_name"])
            g.add_metric([name], float(value))
            yield g
        counters = {
            "prompt_tokens": ("Prefilled prompt tokens.", "prompt_tokens_total"),
            "generation_tokens": ("Generated tokens.", "generation_tokens_total"),
            "num_requests": ("Requests received.", "num_requests_total"),
            "num_aborted_requests": ("Requests aborted.", "num_aborted_requests_total"),
            "num_retracted_reqs": ("Requests retracted.", "num_retractions_total"),
        }
        for key, (doc, stat) in counters.items():
            c = CounterMetricFamily(f"sglang:{key}", doc, labels=["model_name"])
            c.add_metric([name], float(eng.stats[stat]))
            yield c
