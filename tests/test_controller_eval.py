"""Periodic held-out evaluation in the controller: real ``asyncrl eval`` on the tiny model, roles paused."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from asyncrl.core.config import load_config
from asyncrl.controller.controller import Controller
from asyncrl.controller.progress import Progress
from asyncrl.controller.resources import assign_resources
from asyncrl.controller.supervisor import RoleSpec, Supervisor
from asyncrl.metrics.tracking import MetricsLogger, read_metrics

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _controller(tmp_path, tiny_model_dir) -> Controller:
    cfg = load_config(["--config", str(REPO / "configs" / "tiny.yaml"), "--output_dir", str(tmp_path),
                       "--model_path", str(tiny_model_dir), "--monitoring.eval_interval", "2",
                       "--monitoring.eval_num_problems", "4", "--max_response_len", "8", "--max_budget", "8"])
    ctl = Controller(cfg, resumed=False)
    ctl._prepare_run_dir()
    ctl.logger = MetricsLogger(ctl.run_dir, cfg.monitoring, role="controller")
    ctl.progress = Progress(cfg.run.total_steps, live=False)
    ctl.redis_url = ""
    return ctl


def test_eval_pauses_roles_and_is_excluded_from_wall_time(tmp_path, tiny_model_dir):
    ctl = _controller(tmp_path, tiny_model_dir)
    ctl.cfg.monitoring.eval_batch_size = 3  # rows decoded together: passed to `asyncrl eval`, kept in its record
    assignment = assign_resources(ctl.cfg)
    with Supervisor(tmp_path / "logs") as sup:
        busy = sup.start(RoleSpec("rollout-0", [sys.executable, "-c", "while True: pass"]))
        time.sleep(0.5)
        wall_before = ctl.clock.wall_seconds()
        ticks_before = _cpu_ticks(busy.pid)
        t0 = time.monotonic()
        ctl.trainer_step = 2
        asyncio.run(ctl._evaluate(None, sup, assignment))
        eval_seconds = time.monotonic() - t0
        ticks_after = _cpu_ticks(busy.pid)
        # the busy role got (almost) no CPU while the evaluation ran
        assert ticks_after - ticks_before < 30, (ticks_before, ticks_after, eval_seconds)
        assert sup.paused is False
        assert ctl.clock.wall_seconds() - wall_before < 2.0  # the pause is not training time
        assert ctl.clock.paused_seconds == pytest.approx(eval_seconds, abs=1.0)
        time.sleep(0.3)
        assert _cpu_ticks(busy.pid) > ticks_after  # resumed
    ctl.logger.close()
    [rec] = [r for r in read_metrics(ctl.run_dir) if "eval/eval_seconds" in r]
    assert rec["step"] == 2 and rec["eval/policy_version"] == 0
    assert rec["eval/num_problems"] == 4 and 0.0 <= rec["eval/accuracy_sampled"] <= 1.0
    assert rec["eval/ci95_low"] <= rec["eval/accuracy_sampled"] <= rec["eval/ci95_high"]
    assert "eval/accuracy_greedy" in rec and rec["time/eval_seconds"] == pytest.approx(rec["eval/eval_seconds"])
    saved = json.loads((ctl.run_dir / "eval" / "step-2.json").read_text())
    assert saved["model"] == str(tiny_model_dir) and {r["mode"] for r in saved["results"]} == {"greedy", "sampled"}
    assert {r["batch_size"] for r in saved["results"]} == {3}


TRAINER_PHASE = """
import json, sys, time
from asyncrl.metrics.tracking import RunClock
from trainer.loop import PhaseTimer

run_dir, out = sys.argv[1], sys.argv[2]
timer = PhaseTimer(None, RunClock(run_dir))
t0 = time.perf_counter()
with timer.phase("forward_backward"):
    c0 = time.process_time()
    open(out + ".started", "w").close()
    while time.process_time() - c0 < 1.5:  # 1.5 s of CPU: still running when the evaluation stops it
        pass
    cpu = time.process_time() - c0
raw = time.perf_counter() - t0
json.dump({"seconds": timer.seconds["forward_backward"], "raw": raw, "cpu": cpu, "stopped": timer.stopped_seconds},
          open(out, "w"))
"""


def test_trainer_phase_timer_leaves_out_the_evaluation_stop(tmp_path, tiny_model_dir):
    """A real process timing a phase with trainer.loop.PhaseTimer is SIGSTOPped by a real evaluation
    (the controller's own path); its phase seconds leave the stop out, its raw wall time does not."""
    ctl = _controller(tmp_path, tiny_model_dir)
    out = tmp_path / "phase.json"
    with Supervisor(tmp_path / "logs") as sup:
        sup.start(RoleSpec("trainer", [sys.executable, "-c", TRAINER_PHASE, str(ctl.run_dir), str(out)],
                           cwd=str(REPO)))
        deadline = time.monotonic() + 60
        while not Path(str(out) + ".started").exists():
            assert time.monotonic() < deadline, sup.log_tail("trainer")
            time.sleep(0.02)
        ctl.trainer_step = 2
        t0 = time.monotonic()
        asyncio.run(ctl._evaluate(None, sup, assign_resources(ctl.cfg)))
        eval_seconds = time.monotonic() - t0
        while not out.exists():
            assert time.monotonic() < deadline, sup.log_tail("trainer")
            time.sleep(0.05)
    ctl.logger.close()
    r = json.loads(out.read_text())
    assert eval_seconds > 2.0  # a real `asyncrl eval` subprocess ran meanwhile
    assert r["raw"] >= r["cpu"] + eval_seconds - 0.3  # a wall clock counts the stop (the bug)
    assert r["stopped"] == pytest.approx(eval_seconds, abs=0.3)
    assert r["seconds"] == pytest.approx(r["raw"] - r["stopped"], abs=0.05)
    assert r["cpu"] - 0.05 <= r["seconds"] <= r["raw"] - eval_seconds + 0.3


def test_failed_eval_is_reported_and_training_goes_on(tmp_path, tiny_model_dir, capsys):
    ctl = _controller(tmp_path, tiny_model_dir)
    ctl.cfg.model.path = str(tmp_path / "no-such-model")
    asyncio.run(ctl._evaluate(None, None, assign_resources(ctl.cfg)))
    ctl.logger.close()
    assert "held-out evaluation failed" in capsys.readouterr().err
    [rec] = [r for r in read_metrics(ctl.run_dir) if "eval/eval_seconds" in r]
    assert rec["eval/failed"] == 1 and "eval/accuracy_sampled" not in rec


def test_eval_modes_select_the_decoding_modes(tmp_path, tiny_model_dir):
    ctl = _controller(tmp_path, tiny_model_dir)
    ctl.cfg.monitoring.eval_modes = ["sampled"]
    ctl.trainer_step = 4
    asyncio.run(ctl._evaluate(None, None, assign_resources(ctl.cfg)))
    ctl.logger.close()
    [rec] = [r for r in read_metrics(ctl.run_dir) if "eval/eval_seconds" in r]
    assert "eval/accuracy_sampled" in rec and "eval/accuracy_greedy" not in rec
    saved = json.loads((ctl.run_dir / "eval" / "step-4.json").read_text())
    assert [r["mode"] for r in saved["results"]] == ["sampled"]


def test_eval_modes_are_validated():
    from pydantic import ValidationError

    from asyncrl.core.config import MonitoringConfig

    for bad in ([], ["beam"]):
        with pytest.raises(ValidationError, match="eval_modes"):
            MonitoringConfig(eval_modes=bad)


def test_eval_records_name_run_files_relative_to_the_runs_folder(tmp_path):
    """eval/step-<k>.json names the published weights and eval/model as ``<run>/...`` (no absolute path of
    the machine), and keeps a model name, a URI or a directory outside the run as given."""
    from asyncrl.controller.controller_eval import record_path

    run_dir = tmp_path / "runs" / "arith"
    (run_dir / "weights" / "v000020").mkdir(parents=True)
    (run_dir / "eval" / "model").mkdir(parents=True)
    assert record_path(str(run_dir / "weights" / "v000020"), run_dir) == "arith/weights/v000020"
    assert record_path(str(run_dir / "eval" / "model"), run_dir) == "arith/eval/model"
    outside = tmp_path / "models" / "base"
    for kept in ("smollm2-135m-instruct", "nccl://10.0.0.1:29500/v20", str(outside), "weights/v000020"):
        assert record_path(kept, run_dir) == kept


def test_latest_weights_finds_an_adapter_when_the_announcement_is_a_url(tmp_path, tiny_model_dir):
    """http and nccl announce a URL: the newest version directory is evaluated, a LoRA adapter
    (adapter_config.json, no config.json) included, not the base model at version 0."""
    from types import SimpleNamespace

    ctl = _controller(tmp_path, tiny_model_dir)
    weights = Path(ctl.cfg.weight_sync.dir or ctl.run_dir / "weights")
    for v in (1, 2):
        d = weights / f"v{v:06d}"
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text("{}")
        time.sleep(0.01)

    class Clock:
        async def latest(self):
            return SimpleNamespace(uri="http://127.0.0.1:1/weights/v000002", version=2)

    got = asyncio.run(ctl._latest_weights(SimpleNamespace(clock=Clock())))
    assert got == (str(weights / "v000002"), 2)
