"""SIGTERM per role as Kubernetes delivers it (issue 7 item 4), where the other tests do not
already cover it:

- rollout server: ``tests/test_rollout_worker.py::test_sigterm_parks_every_in_flight_sample_and_exits_0``
  (the real ``asyncrl rollout-server`` process parks exactly its in-flight samples);
- trainer as a plain process: ``tests/test_trainer_distributed.py::test_sigterm_finishes_the_step_checkpoints_and_exits_0``;
- controller: ``tests/test_monitoring_e2e.py`` (SIGTERM to ``asyncrl train`` alone: ordered
  drain, exit 0, trainer checkpoint, rollout partials parked);
- here: the trainer **under torchrun**, the command of the Kubernetes trainer Job
  (``tini -- torchrun --shutdown-timeout=... -m asyncrl.cli trainer``). tini forwards SIGTERM
  to torchrun, torchrun forwards it to the rank, and the rank must finish its step and write a
  checkpoint before torchrun's shutdown timeout.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.test_trainer import make_groups
from tests.test_trainer_distributed import launch_setup  # noqa: F401  (module fixture)

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_sigterm_to_torchrun_reaches_the_rank_which_checkpoints(launch_setup, tmp_path):  # noqa: F811
    root, env, repo = launch_setup
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps(make_groups(2, 700, seed=s)) + "\n" for s in range(200)))
    env = dict(env, ASYNCRL_TRAINER_BATCHES=str(path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--shutdown-timeout=60",
           "-m", "asyncrl.cli", "trainer", "--config", str(root / "cfg.yaml"), "--run.name", "torchrun_term",
           "--run.total_steps", "200", "--trainer.checkpoint_interval", "1000"]
    proc = subprocess.Popen(cmd, env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        for line in proc.stdout:
            if line.startswith("step step=2"):
                break
            assert time.time() < deadline, "trainer did not reach step 2"
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # to torchrun only, as tini does for PID 1's child
        rest = proc.communicate(timeout=90)[0]
        drain_seconds = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # torchrun re-raises the signal as its own failure (exit code != 0 is fine for a pod being
    # deleted); what matters is that the rank stopped normally after a checkpoint, in time
    assert "stopped because stopped" in rest, rest[-3000:]
    last = [ln for ln in rest.splitlines() if ln.startswith("step step=")]
    final_step = int(float(last[-1].split()[1].split("=")[1])) if last else 2
    ckpt = root / "runs" / "torchrun_term" / "checkpoints"
    assert (ckpt / "latest").read_text() == f"step{final_step:08d}", rest[-3000:]
    meta = json.loads((ckpt / f"step{final_step:08d}" / "asyncrl.json").read_text())
    assert meta["extra_state"] == {"cursor": final_step}
    assert drain_seconds < 60, f"the rank needed {drain_seconds:.0f} s, beyond torchrun's --shutdown-timeout"
