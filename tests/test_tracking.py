"""Metrics logging: JSONL format and append safety, run clock, TensorBoard and W&B offline."""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import time

import pytest

from asyncrl.core.config import MonitoringConfig
from asyncrl.metrics.tracking import (
    SINKS_ENV,
    MetricsLogger,
    MetricsTail,
    RunClock,
    TrackingError,
    read_metrics,
)


def test_jsonl_record_format_and_naming(tmp_path):
    with MetricsLogger(tmp_path, MonitoringConfig(), role="trainer") as log:
        rec = log.log(3, {"reward/mean": 0.5, "time/forward_backward_seconds": 1.25, "train/loss": float("nan"),
                          "buffer/depth_ready": 4, "train/skipped": True}, wall_seconds=12.0)
    lines = (tmp_path / "metrics-trainer.jsonl").read_text().splitlines()
    assert len(lines) == 1
    got = json.loads(lines[0])
    assert got == rec
    assert got["step"] == 3 and got["wall_seconds"] == 12.0 and got["role"] == "trainer"
    assert got["reward/mean"] == 0.5 and got["buffer/depth_ready"] == 4 and got["train/skipped"] == 1
    assert got["train/loss"] is None  # non-finite -> null
    assert abs(got["time_unix"] - time.time()) < 60


@pytest.mark.parametrize("metrics, match", [
    ({"loss": 1.0}, "group/name"),
    ({"step": 1.0}, "reserved"),
    ({"reward/mean": "high"}, "must be a number"),
    ({"reward/mean": [1]}, "must be a number"),
])
def test_bad_metrics_are_rejected_and_nothing_written(tmp_path, metrics, match):
    with MetricsLogger(tmp_path, role="trainer") as log:
        with pytest.raises(TrackingError, match=match):
            log.log(1, {"reward/ok": 1.0, **metrics})
        with pytest.raises(TrackingError, match="step must be"):
            log.log(-1, {"reward/mean": 1.0})
    assert (tmp_path / "metrics-trainer.jsonl").read_text() == ""


def test_bad_role_name(tmp_path):
    with pytest.raises(TrackingError, match="role name"):
        MetricsLogger(tmp_path, role="a/b")


def _writer(run_dir, role, n):
    with MetricsLogger(run_dir, role=role) as log:
        for i in range(n):
            log.log(i, {"rollout/tokens_per_second": float(i), "rollout/payload": 1.0}, wall_seconds=float(i))


def test_processes_write_their_own_files_and_read_metrics_merges(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), f"rollout-{k}", 200)) for k in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    # a second session (resume) appends to the same file
    _writer(str(tmp_path), "rollout-0", 5)
    recs = read_metrics(tmp_path)
    assert len(recs) == 405
    assert [r["wall_seconds"] for r in recs] == sorted(r["wall_seconds"] for r in recs)
    assert {r["role"] for r in recs} == {"rollout-0", "rollout-1"}


def test_read_metrics_tolerates_a_cut_last_line_but_not_corruption(tmp_path):
    with MetricsLogger(tmp_path, role="trainer") as log:
        log.log(1, {"reward/mean": 0.1}, wall_seconds=1)
    path = tmp_path / "metrics-trainer.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 2, "wall_sec')
    assert len(read_metrics(tmp_path)) == 1
    path.write_text('garbage\n{"step": 1, "wall_seconds": 1}\n')
    with pytest.raises(TrackingError, match="line 1 is not JSON"):
        read_metrics(tmp_path)
    path.write_text('{"x": 1}\n')
    with pytest.raises(TrackingError, match="not a metrics record"):
        read_metrics(tmp_path)
    with pytest.raises(TrackingError, match="no metrics"):
        read_metrics(tmp_path / "empty")


def test_tail_reads_only_complete_new_lines(tmp_path):
    tail = MetricsTail(tmp_path, skip_roles=["controller"])
    assert tail.read_new() == []
    with MetricsLogger(tmp_path, role="trainer") as t, MetricsLogger(tmp_path, role="controller") as c:
        t.log(1, {"reward/mean": 0.1})
        c.log(1, {"buffer/depth_ready": 1})
        assert [r["role"] for r in tail.read_new()] == ["trainer"]
        assert tail.read_new() == []
        with open(tmp_path / "metrics-trainer.jsonl", "a") as f:
            f.write('{"step": 2, "wall_seconds": 1')
        assert tail.read_new() == []
        with open(tmp_path / "metrics-trainer.jsonl", "a") as f:
            f.write(', "role": "trainer"}\n')
        assert [r["step"] for r in tail.read_new()] == [2]
        t.log(3, {"reward/mean": 0.3})
        tail2 = MetricsTail(tmp_path)
        tail2.seek_to_end()
        assert tail2.read_new() == []


def test_run_clock_excludes_pauses_and_continues_on_resume(tmp_path):
    clock = RunClock.start(tmp_path, previous_wall_seconds=100.0)
    reader = RunClock(tmp_path)  # another process's view
    assert 100.0 <= reader.wall_seconds() < 101.0
    clock.add_pause(30.0)
    assert 70.0 <= reader.wall_seconds() < 71.0
    with MetricsLogger(tmp_path, role="trainer") as log:
        rec = log.log(1, {"reward/mean": 1.0})
    assert 70.0 <= rec["wall_seconds"] < 71.0
    assert RunClock(tmp_path / "no-clock").wall_seconds() < 1.0


def test_sinks_env_restricts_child_sinks(tmp_path, monkeypatch):
    monkeypatch.setenv(SINKS_ENV, "jsonl")
    log = MetricsLogger(tmp_path, MonitoringConfig(tensorboard=True, wandb=True), role="trainer")
    assert log.sinks == ["jsonl"]
    log.close()
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tracking extra (tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, MonitoringConfig(tensorboard=True), role="controller") as log:
        log.log(1, {"reward/mean": 0.25})
        log.log(2, {"reward/mean": 0.75})
        log.forward({"step": 2, "wall_seconds": 3.0, "role": "trainer", "time_unix": time.time(),
                     "train/loss": 1.5, "train/kl": None})
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "controller"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert [e.value for e in acc.Scalars("train/loss")] == [1.5]
    # forward() does not copy the child's record into the controller's JSONL (no duplicates)
    assert [r["role"] for r in read_metrics(tmp_path)] == ["controller", "controller"]


def test_wandb_offline_without_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs the tracking extra (wandb)")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # any network use would fail
    with MetricsLogger(tmp_path, MonitoringConfig(wandb=True), role="controller", config={"seed": 1}) as log:
        log.log(1, {"eval/accuracy_sampled": 0.125})
        log.log(2, {"eval/accuracy_sampled": 0.375})
    run_id = (tmp_path / "wandb_id").read_text()
    [data] = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    deadline = time.monotonic() + 60  # wandb-core may still be flushing its file after finish()
    while True:
        blob = open(data, "rb").read()
        if (b"eval/accuracy_sampled" in blob and b"0.375" in blob) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert b"eval/accuracy_sampled" in blob and b"0.375" in blob
    # resume continues the same W&B run id
    with MetricsLogger(tmp_path, MonitoringConfig(wandb=True), role="controller"):
        pass
    assert (tmp_path / "wandb_id").read_text() == run_id


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(TrackingError, match=r"pip install 'asyncrl\[tracking\]'"):
        MetricsLogger(tmp_path, MonitoringConfig(wandb=True, tensorboard=True))
    assert not (tmp_path / "metrics-controller.jsonl").exists()  # nothing half-opened


def test_for_role_uses_the_supervisor_role_name(tmp_path, monkeypatch):
    from asyncrl.core.config import load_config

    cfg = load_config(["--output_dir", str(tmp_path), "--run_name", "r"])
    monkeypatch.setenv("ASYNCRL_ROLE", "rollout-1")
    with MetricsLogger.for_role(cfg, "rollout") as log:
        log.log(1, {"rollout/tokens_per_second": 5.0})
    assert (tmp_path / "r" / "metrics-rollout-1.jsonl").exists()
    monkeypatch.delenv("ASYNCRL_ROLE")
    with MetricsLogger.for_role(cfg, "rollout") as log:
        assert log.path == tmp_path / "r" / "metrics-rollout.jsonl"
