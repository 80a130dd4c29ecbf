"""How the roles feed the metric catalogue (issue 7): the trainer's checkpoint metrics (success
and failure), the trainer's batch former observing sample staleness, and the controller turning
the buffer's Redis counters into Prometheus counters. The live end-to-end check is
tests/test_monitoring_e2e.py; these pin the parts a tiny run rarely exercises (failures, drops,
restarts, reclaims).
"""

from __future__ import annotations

import copy
import re
import threading

import pytest
from prometheus_client import CollectorRegistry

from asyncrl import metrics as M
from tests.test_trainer import make_cfg, make_groups, tiny_model  # noqa: F401  (module fixture)
from trainer.loop import ListBatchSource, train_loop


def _value(registry: CollectorRegistry, sample: str) -> float:
    """Value of one sample (``name{labels}`` as exposed) in ``registry``'s text exposition; 0 if absent."""
    text = M.exposition(registry)[0].decode()
    m = re.search(r"^" + re.escape(sample) + r" (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_checkpoints_are_timed_and_a_failed_write_is_counted(tmp_path, tiny_model_dir, tiny_model):  # noqa: F811
    from trainer.trainer import Trainer

    cfg = make_cfg(tmp_path, tiny_model_dir, checkpoint_interval=2)
    reg = CollectorRegistry()
    metrics = M.TrainerMetrics(reg)
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model))
    try:
        vocab = tiny_model.config.vocab_size
        source = ListBatchSource([make_groups(2, vocab, seed=s, versions=s) for s in range(3)])
        train_loop(trainer, source, metrics=metrics, max_steps=2)
        assert _value(reg, "asyncrl_trainer_checkpoint_duration_seconds_count") == 1
        assert _value(reg, "asyncrl_trainer_checkpoint_duration_seconds_sum") > 0
        assert _value(reg, 'asyncrl_trainer_checkpoints_total{result="ok"}') == 1
        assert _value(reg, 'asyncrl_trainer_checkpoints_total{result="error"}') == 0

        # the checkpoint directory cannot be created (a file is in the way): counted, re-raised
        blocker = tmp_path / "not_a_dir"
        blocker.write_text("")
        trainer.checkpoint_dir = blocker / "checkpoints"
        stop = threading.Event()
        stop.set()  # SIGTERM semantics: checkpoint now
        with pytest.raises(OSError):
            train_loop(trainer, source, metrics=metrics, stop=stop)
        assert _value(reg, 'asyncrl_trainer_checkpoints_total{result="error"}') == 1
        assert _value(reg, 'asyncrl_trainer_checkpoints_total{result="ok"}') == 1
        assert _value(reg, "asyncrl_trainer_checkpoint_duration_seconds_count") == 1  # failures are not timed
    finally:
        trainer.close()


def test_batch_former_observes_the_staleness_of_every_sample():
    from asyncrl.core.types import Batch, BatchGroup, PromptGroup, Sample
    from trainer.sources import BufferBatchSource

    reg = CollectorRegistry()
    source = BufferBatchSource(buf=None)
    source.buffer_metrics = M.BufferMetrics(reg)

    def group(gid, versions_per_sample):
        samples = [Sample(f"{gid}/{i}", gid, i, response_ids=[5] * len(v), versions=v)
                   for i, v in enumerate(versions_per_sample)]
        oldest = min(min(v) for v in versions_per_sample)
        return BatchGroup(PromptGroup(gid, [1, 2]), samples, oldest_version=oldest, staleness=7 - oldest)

    batch = Batch("b1", step=3, version=7, lineage=2,
                  groups=[group("g1", [[7, 7], [5, 6]]), group("g2", [[4, 7], [6]])])
    source._observe(batch)
    assert _value(reg, "asyncrl_buffer_sample_staleness_count") == 4
    assert _value(reg, "asyncrl_buffer_sample_staleness_sum") == 0 + 2 + 3 + 1
    assert _value(reg, 'asyncrl_buffer_sample_staleness_bucket{le="0.0"}') == 1
    assert _value(reg, 'asyncrl_buffer_sample_staleness_bucket{le="2.0"}') == 3
    assert _value(reg, "asyncrl_buffer_groups_trained_total") == 2
    assert _value(reg, "asyncrl_buffer_policy_version") == 7 and _value(reg, "asyncrl_buffer_lineage") == 2


def test_controller_exports_buffer_counters_by_their_increase():
    from asyncrl.core.config import load_config
    from asyncrl.controller.run_watch import PrometheusExport

    cfg = load_config([], overrides={"monitoring": {"controller_metrics_port": 0}})
    export = PrometheusExport(cfg)
    try:
        reg = export.registry
        stats = {"version": 3, "lineage": 1, "dataset_cursor": 8, "admitted_groups": 6,
                 "samples_by_state": {"partial": 2, "running": 3, "pending": 4, "complete": 1, "scored": 6},
                 "groups_by_state": {"ready": 1, "generating": 5, "batched": 2, "acked": 3, "pending": 9},
                 "counters": {"dropped_groups:stale_resume": 1, "restarted_groups:stale_batch": 2,
                              "restarted_samples:stale_batch": 8, "reclaimed_leases": 3,
                              "restarted_samples:abandoned_version": 4, "parked_budget": 10,
                              "dropped_groups:some_future_code": 5, "restart_discarded_tokens": 96}}
        export.update(stats, trainer_step=2, running=["rollout-0", "trainer"])
        assert _value(reg, 'asyncrl_buffer_groups_dropped_total{reason="stale"}') == 1
        assert _value(reg, 'asyncrl_buffer_groups_restarted_total{reason="stale"}') == 2
        assert _value(reg, 'asyncrl_buffer_samples_restarted_total{reason="stale"}') == 8
        assert _value(reg, 'asyncrl_buffer_samples_restarted_total{reason="lineage"}') == 4
        assert _value(reg, "asyncrl_buffer_work_reclaimed_total") == 3
        assert _value(reg, "asyncrl_buffer_restart_discarded_tokens_total") == 96
        assert _value(reg, "asyncrl_buffer_groups_admitted_total") == 6
        assert _value(reg, "asyncrl_buffer_policy_version") == 3
        # the buffer's own state names are exported under the catalogue's labels (docs/metrics.md)
        for state, n in {"in_flight": 5, "ready": 1, "claimed": 2, "acknowledged": 3}.items():
            assert _value(reg, f'asyncrl_buffer_groups{{state="{state}"}}') == n
        for state, n in {"queued": 4, "generating": 3, "partial": 2, "scoring": 1, "complete": 6, "failed": 0}.items():
            assert _value(reg, f'asyncrl_buffer_samples{{state="{state}"}}') == n
        group_lines = [ln for ln in M.exposition(reg)[0].decode().splitlines() if ln.startswith("asyncrl_buffer_groups{")]
        assert len(group_lines) == 4 and not any('"generating"' in ln or '"pending"' in ln for ln in group_lines)
        # an unknown buffer reason code is not exported under a made-up label
        assert "some_future_code" not in M.exposition(reg)[0].decode()

        # the next poll adds only the increase; unchanged counters stay put
        stats["counters"] = {**stats["counters"], "dropped_groups:stale_resume": 4, "reclaimed_leases": 3}
        stats["admitted_groups"] = 7
        export.update(stats, trainer_step=3, running=["rollout-0", "trainer"])
        assert _value(reg, 'asyncrl_buffer_groups_dropped_total{reason="stale"}') == 4
        assert _value(reg, "asyncrl_buffer_work_reclaimed_total") == 3
        assert _value(reg, "asyncrl_buffer_groups_admitted_total") == 7
        assert _value(reg, 'asyncrl_buffer_samples_restarted_total{reason="stale"}') == 8
        assert M.lint_exposition(M.exposition(reg)[0].decode()) == []
    finally:
        M.stop_metrics_server(export.port)
