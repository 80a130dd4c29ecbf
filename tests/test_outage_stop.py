"""A role never outlives its controller inside a Redis outage (issue #31 item 5).

A controller stand-in process starts the trainer's buffer source (the real
``trainer.sources.BufferBatchSource`` on a real redis-server, with the trainer's SIGTERM handler
and ``PR_SET_PDEATHSIG`` as ``asyncrl train`` gives its roles). Redis is killed while the trainer
is inside one of its waits (batch, ack, commit, cursor); once the trainer prints its outage
WARNING, the controller is killed with SIGKILL. Every process of the run must be gone 20 s later
(before the fix, the acknowledge wait ignored the stop and lasted ``buffer.outage_seconds``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.core.process_guard import alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TRAINER = r"""
import asyncio, sys, threading
from buffers import BufferSettings, ReplayBuffer, UnknownItem
from trainer.loop import install_signal_handlers
from trainer.sources import BufferBatchSource

url, wait = sys.argv[1], sys.argv[2]
stop = threading.Event()
install_signal_handlers(stop)

async def main():
    buf = await ReplayBuffer.open(url, run="outage", settings=BufferSettings(
        rollout_batch_size=2, train_batch_groups=1, n_samples_per_prompt=1, max_budget=8, max_response_len=8))
    src = BufferBatchSource(buf, stop, outage_seconds=300.0, batch_wait_seconds=3600.0)
    src._batch_id = "batch-1"
    call = {"batch": lambda: src.next_batch(1), "ack": lambda: src.acknowledge(1),
            "commit": lambda: src.commit(1), "cursor": src.state_dict}[wait]
    print("ready", flush=True)
    while True:  # each wait, again and again, until the outage makes it wait
        try:
            await call()
        except UnknownItem:
            pass  # "batch-1" is a stand-in: while Redis is still up, the buffer says it never handed it out
        except Exception as exc:
            print(f"ended: {type(exc).__name__}", file=sys.stderr, flush=True)
            return
        if stop.is_set():
            return
        await asyncio.sleep(0.05)

asyncio.run(main())
"""

CONTROLLER = r"""
import subprocess, sys, time
from asyncrl.core.process_guard import pdeathsig_preexec
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], stdout=sys.stdout,
                         stderr=open(sys.argv[4], "w"), preexec_fn=pdeathsig_preexec())
print(child.pid, flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize("wait", ["batch", "ack", "commit", "cursor"])
def test_controller_killed_during_an_outage_wait_leaves_no_process(redis_server, tmp_path, wait):
    log = tmp_path / "trainer.err"
    ctl = subprocess.Popen([sys.executable, "-c", CONTROLLER, TRAINER, redis_server.url, wait, str(log)],
                           stdout=subprocess.PIPE, text=True)
    try:
        trainer_pid = int(ctl.stdout.readline())
        assert ctl.stdout.readline().strip() == "ready"
        redis_server.kill()  # the outage: the trainer's next call waits for Redis to come back
        deadline = time.monotonic() + 60
        while "unreachable" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, f"the trainer never waited for Redis: {log.read_text()[-500:]}"
            time.sleep(0.1)
        assert alive(trainer_pid)
        os.kill(ctl.pid, signal.SIGKILL)
        ctl.wait(10)
        t0 = time.monotonic()
        while alive(trainer_pid) and time.monotonic() - t0 < 20:
            time.sleep(0.1)
        assert not alive(trainer_pid), f"the trainer is alive 20 s after its controller died ({wait} wait)"
    finally:
        for pid in (ctl.pid,) + ((trainer_pid,) if "trainer_pid" in locals() else ()):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        ctl.wait(10)
