"""End to end: ``asyncrl train --config configs/tiny.yaml`` through the real CLI.

Real redis-server (embedded, AOF in the run directory), real HTTP between the rollout worker and
its embedded engine, real DeepSpeed trainer, every role a separate process. Session 1 runs the
tiny config to the end; session 2 resumes it with more steps and is stopped with Ctrl-C (SIGINT to its process group);
the checks are the acceptance list of issue 6 (the run finishes, the policy version advances,
partial samples are parked and resumed across a version change, checkpoints and metrics exist,
``--resume`` continues without repeating or skipping a prompt, Ctrl-C stops cleanly).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.core.net import free_port
from asyncrl.metrics.tracking import read_metrics

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _last(records, key, role=None):
    vals = [r[key] for r in records if r.get(key) is not None and (role is None or r["role"] == role)]
    return vals[-1] if vals else None


def _max(records, key):
    vals = [r[key] for r in records if r.get(key) is not None]
    return max(vals) if vals else None


def _children_of(run_dir: Path) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run_dir) in cmdline.read_bytes().decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except (OSError, ValueError):
            continue
    return pids


def test_tiny_run_end_to_end_then_resume_and_sigterm(tmp_path, tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true")  # no WANDB_MODE/API key: W&B runs offline
    train = [sys.executable, "-m", "asyncrl.cli", "train"]
    flags = ["--config", str(TINY), "--output_dir", str(tmp_path), "--model_path", str(tiny_model_dir),
             "--rollout.base_port", str(free_port()), "--monitoring.progress", "false",
             "--monitoring.eval_interval", "6", "--monitoring.eval_num_problems", "4",
             "--monitoring.tensorboard", "true", "--monitoring.wandb", "true"]
    run_dir = tmp_path / "tiny"

    # ---- session 1: the whole tiny run
    t0 = time.monotonic()
    proc = subprocess.run(train + flags, env=env, capture_output=True, text=True, timeout=600)
    session1_seconds = time.monotonic() - t0
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stderr[-4000:] + logs
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] == "finished" and state["step"] == 6, state
    # no sample lost: fed = trained + in the buffer + dropped; the staleness bound held at every step
    assert state["groups_reconcile"] is True and "groups reconcile: fed" in proc.stderr, state
    assert 0 <= state["max_staleness_seen"] <= state["max_staleness"] == 2
    recs = read_metrics(run_dir)
    trainer = [r for r in recs if r["role"] == "trainer"]
    assert [r["step"] for r in trainer] == [1, 2, 3, 4, 5, 6]
    assert all("reward/mean" in r and "time/forward_backward_seconds" in r for r in trainer)
    assert _max(recs, "policy/version") >= 6  # weights published every step (weight_sync.interval 1)
    assert _max(recs, "staleness/max") <= 2  # the bound eta = 2 held at every step
    assert _last(recs, "buffer/parked_budget") > 0  # samples reached max_budget = 16 and were parked
    assert _last(recs, "buffer/multi_version_samples") > 0  # ... and resumed under a newer policy version
    assert (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    assert (run_dir / "config.yaml").exists() and (run_dir / "metrics-controller.jsonl").exists()
    assert "the trainer finished" in proc.stderr
    assert not _children_of(run_dir), "roles left running after the run"
    cursor_after_1 = _last(recs, "buffer/dataset_cursor", role="controller")
    assert cursor_after_1 >= 4
    # held-out evaluation: the base model, then every 6 steps (the pause itself: test_controller_eval.py)
    evals = [r for r in recs if "eval/eval_seconds" in r]
    assert [r["step"] for r in evals] == [0, 6], evals
    assert all(0.0 <= r["eval/accuracy_sampled"] <= 1.0 and r["eval/num_problems"] == 4 for r in evals)
    assert [r["eval/policy_version"] for r in evals][0] == 0 and evals[-1]["eval/policy_version"] >= 6
    assert state["eval_seconds"] > 0 and state["wall_seconds"] + state["eval_seconds"] <= session1_seconds + 1.0
    # TensorBoard and W&B (offline) got the controller's and the trainer's series
    assert list((run_dir / "tensorboard" / "controller").glob("events.out.tfevents.*"))
    run_id = (run_dir / "wandb_id").read_text()
    [wandb_file] = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    deadline = time.monotonic() + 60  # wandb-core may still be flushing its file
    while b"eval/accuracy_sampled" not in (blob := wandb_file.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert b"reward/mean" in blob and b"buffer/partial_ratio" in blob and b"eval/accuracy_sampled" in blob

    # ---- session 2: --resume with more steps, then Ctrl-C once it has trained a few
    p2 = subprocess.Popen(train + ["--resume", str(run_dir), "--total_steps", "200", "--monitoring.progress", "false",
                                   "--monitoring.controller_metrics_port", "0"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)  # its own process group, like a terminal job
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert p2.poll() is None, p2.stderr.read()
            steps = [r["step"] for r in read_metrics(run_dir) if r["role"] == "trainer"]
            if steps and max(steps) >= 8:
                break
            time.sleep(1.0)
        else:
            pytest.fail("the resumed run did not train 2 more steps in 300 s")
        # the controller's Prometheus endpoint: buffer state, clock, role processes, progress
        import urllib.request

        url = json.loads((run_dir / "run_state.json").read_text())["controller_metrics_url"]
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        for needle in ('asyncrl_buffer_groups{state="', "asyncrl_buffer_policy_version ", 'asyncrl_buffer_max_staleness 2.0',
                       'asyncrl_controller_role_processes{role="trainer"} 1.0',
                       'asyncrl_controller_role_processes{role="rollout"} 1.0', "asyncrl_controller_run_progress_ratio"):
            assert needle in body, needle
        os.killpg(p2.pid, signal.SIGINT)  # Ctrl-C in a terminal: SIGINT to the whole foreground group
        out, err = p2.communicate(timeout=300)
    finally:
        if p2.poll() is None:
            p2.kill()
    assert p2.returncode == 0, err[-4000:]
    assert "SIGINT received" in err
    # Redis was out of the terminal's reach and stopped last, by the controller (SIGTERM)
    redis_log = (run_dir / "redis" / "redis.log").read_text()
    assert "Received SIGINT" not in redis_log and redis_log.count("Received SIGTERM") == 2
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] == "stopped" and state["sessions"] == 2 and state["step"] >= 8
    assert state["groups_reconcile"] is True, state  # parked partials and all: nothing lost on Ctrl-C
    assert state["wall_seconds"] > session1_seconds * 0.3  # the training clock continued
    recs = read_metrics(run_dir)
    steps = [r["step"] for r in recs if r["role"] == "trainer"]
    assert steps[:6] == [1, 2, 3, 4, 5, 6] and steps[6] == 7  # continued from the checkpoint of step 6
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    feeder_log = (run_dir / "logs" / "feeder.log").read_text()
    starts = re.findall(r"feeding run 'tiny' from cursor (\d+)", feeder_log)
    assert starts[0] == "0" and int(starts[-1]) == cursor_after_1  # no prompt repeated or skipped
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "stopped because stopped" in trainer_log  # the trainer checkpointed on the controller's SIGTERM
    assert "parked" in (run_dir / "logs" / "rollout-0.log").read_text()  # the rollout server drained
    assert not _children_of(run_dir), "roles left running after Ctrl-C"
