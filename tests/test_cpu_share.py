"""Per-role CPU share (asyncrl/controller/cpu_share.py) measured on real processes."""

import subprocess
import sys
import time

import pytest

from asyncrl.controller.cpu_share import CpuShareSampler

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 30: pass\n"
# a parent that sleeps while its child spins: the share must count the descendant
PARENT = ("import subprocess, sys, time\n"
          f"p = subprocess.Popen([sys.executable, '-c', {BUSY!r}])\n"
          "p.wait()\n")
IDLE = "import time\ntime.sleep(30)\n"


def _spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_busy_tree_vs_idle_role():
    procs = {"busy": _spawn(PARENT), "idle": _spawn(IDLE)}
    try:
        sampler = CpuShareSampler(num_cores=1)
        time.sleep(0.5)  # the child is started
        pids = {name: p.pid for name, p in procs.items()}
        assert sampler.sample(pids) == {}  # first sight: baselines only
        time.sleep(1.5)
        shares = sampler.sample(pids)
        assert set(shares) == {"cpu_share/busy", "cpu_share/idle"}
        # one core: a spinning descendant holds most of it even on a loaded machine
        assert shares["cpu_share/busy"] > 0.3
        assert shares["cpu_share/idle"] < 0.05
        # over 8 cores the same work is an eighth of the machine (the denominator)
        eight = CpuShareSampler(num_cores=8)
        eight.sample(pids)
        time.sleep(1.0)
        assert eight.sample(pids)["cpu_share/busy"] <= 1 / 8 + 0.02
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_restart_gone_and_not_running():
    p1 = _spawn(IDLE)
    sampler = CpuShareSampler(num_cores=2)
    try:
        sampler.sample({"role": p1.pid, "stopped": None})
        assert "cpu_share/role" in sampler.sample({"role": p1.pid}, now=time.monotonic() + 1)
        p2 = _spawn(IDLE)
        try:  # a restarted role (new pid) gets a fresh baseline, not a difference across processes
            assert sampler.sample({"role": p2.pid}) == {}
        finally:
            p2.kill()
            p2.wait()
        assert sampler.sample({"role": p2.pid}) == {}  # gone: dropped, no error
    finally:
        p1.kill()
        p1.wait()


def test_num_cores_checked():
    with pytest.raises(ValueError, match="num_cores must be >= 1"):
        CpuShareSampler(num_cores=0)
