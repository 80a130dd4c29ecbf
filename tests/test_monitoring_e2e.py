"""Issue 7 item 3 end to end: a real Prometheus server (1 s scrapes, asyncrl's rules) scraping a
real ``asyncrl train --config configs/tiny.yaml`` run — the controller's and trainer rank 0's
metrics ports and the rollout server's ``/metrics`` — answers every dashboard panel's query.

Then (issue 7 item 4, the controller as PID 1 of its pod) the controller gets SIGTERM alone, as
Kubernetes sends it, and must drain the roles in order and exit 0: the rollout server parks its
in-flight samples, the trainer checkpoints.

The controller and trainer metrics servers listen on ``127.0.0.2`` (``monitoring.metrics_host``),
so a role that ignored the setting and bound 127.0.0.1 would not be scraped. The run is longer
than ``configs/tiny.yaml`` (``run.total_steps`` 200) only so that it is still live while the
queries run; it is stopped as soon as they pass. Simplified: the admission-wait histogram has
no producer yet (the feeder does not time admission), so its panel answers NaN, which counts as
data here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.core.net import free_port

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"
METRICS_HOST = "127.0.0.2"  # any 127/8 address is loopback on Linux


def _free_port_on(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _positive(result: list[dict]) -> bool:
    return bool(result) and float(result[0]["value"][1]) > 0


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prometheus_scrapes_a_real_tiny_run_and_every_panel_has_data(tmp_path, tiny_model_dir, prometheus_server):
    controller_port, trainer_port = _free_port_on(METRICS_HOST), _free_port_on(METRICS_HOST)
    rollout_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "--config", str(TINY), "--output_dir", str(tmp_path),
           "--model_path", str(tiny_model_dir), "--run.total_steps", "200", "--rollout.base_port", str(rollout_port),
           "--monitoring.progress", "false", "--monitoring.metrics_host", METRICS_HOST,
           "--monitoring.controller_metrics_port", str(controller_port),
           "--monitoring.trainer_metrics_port", str(trainer_port)]
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    run_dir = tmp_path / "tiny"

    def logs() -> str:
        roles = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        return log_path.read_text()[-4000:] + "\n" + roles

    try:
        prom = prometheus_server({"rollout": [f"127.0.0.1:{rollout_port}"],
                                  "trainer": [f"{METRICS_HOST}:{trainer_port}"],
                                  "controller": [f"{METRICS_HOST}:{controller_port}"]}, run="tiny")
        try:
            prom.wait_for('count(up{run="tiny"} == 1) == 3', timeout=120)
            # live values the issue names: policy version, resumed partials, generated tokens
            prom.wait_for('max(asyncrl_buffer_policy_version{run="tiny"})', timeout=90, predicate=_positive)
            prom.wait_for('sum(rate(asyncrl_rollout_partial_resumes_total{run="tiny"}[10s]))', timeout=60, predicate=_positive)
            prom.wait_for('sum(rate(asyncrl_rollout_generated_tokens_total{run="tiny"}[10s]))', timeout=60, predicate=_positive)
            prom.wait_for('max(asyncrl_trainer_checkpoint_duration_seconds_count{run="tiny"})', timeout=60, predicate=_positive)
            prom.wait_for('sum(asyncrl_buffer_sample_staleness_count{run="tiny"})', timeout=30, predicate=_positive)
            assert proc.poll() is None, "the run ended before the checks:\n" + logs()
            values = prom.assert_dashboard_has_data(timeout=60)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{logs()}") from None
        assert values['max(asyncrl_buffer_policy_version{run=~"$run"})'] > 0
        assert values['max(asyncrl_trainer_policy_version{run=~"$run"})'] > 0
        assert values['sum (rate(asyncrl_rollout_partial_resumes_total{run=~"$run"}[$__rate_interval]))'] > 0
        assert values['sum (rate(asyncrl_rollout_generated_tokens_total{run=~"$run"}[$__rate_interval]))'] > 0
        # every role is up and announces itself
        roles = {r["metric"]["role"] for r in prom.query('asyncrl_build_info{run="tiny"}')}
        assert roles == {"rollout", "trainer", "controller"}
        bad_rules = [r for r in prom.rule_health() if r[1] == "err"]
        assert not bad_rules, bad_rules

        # ---- SIGTERM to the controller alone (what the kubelet sends PID 1 via tini)
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = logs()
    assert rc == 0, out
    text = log_path.read_text()
    assert "SIGTERM received: stopping the roles in order" in text, out
    assert re.search(r"stopped: SIGTERM received\. step \d+/200", text), out
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "stopped because stopped" in trainer_log, out  # finished its step, checkpointed
    step = int(re.search(r"stopped because stopped; step (\d+)", trainer_log).group(1))
    assert (run_dir / "checkpoints" / f"step{step:08d}").is_dir(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert re.search(r"drained \S+: parked \d+ in-flight samples", (run_dir / "logs" / "rollout-0.log").read_text()), out
