"""Faults, one at a time, with real processes and a real redis-server (issue #18 item 10).

* a Redis outage is waited out (backoff, one WARNING line), not a crash: :class:`OutageGuard`,
  the feeder and the trainer's batch source keep going across a ``kill -9`` + restart of
  redis-server on its AOF; past the deadline the wait fails naming the role and what it waited
  for;
* no silent hang: the trainer's wait for a batch has a deadline;
* the supervisor does not count failures during a Redis restart against a role's restart limit;
* a port whose previous server's connections linger in TIME_WAIT is not "busy";
* the engine does not log a client that dropped its stream as an ERROR with a traceback;
* orphans: the Redis guardian outlives its dead parent until the roles have exited, then stops
  Redis; a resumed session waits for the previous session's processes.

The whole-run versions (SIGKILL of each role, of redis-server and of the controller) are in
tests/test_chaos.py.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from asyncrl.core.outage import DependencyOutage, OutageGuard
from asyncrl.controller.redis_server import RedisServer

pytestmark = pytest.mark.integration


def _restart(server: RedisServer) -> RedisServer:
    return RedisServer(server.data_dir, port=server.port, password=server.password).start()


# ----------------------------------------------------------------------------------------------
# waiting out a Redis outage


async def test_outage_guard_waits_out_a_redis_restart_with_one_warning(redis_server):
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    out = io.StringIO()
    guard = OutageGuard("feeder", deadline_seconds=30, out=out, max_backoff_seconds=0.5)
    await guard.call(lambda: client.set("k", "v"), "writing k")
    redis_server.kill()
    restarted: list[RedisServer] = []

    async def restart_later():
        await asyncio.sleep(1.5)
        restarted.append(await asyncio.get_running_loop().run_in_executor(None, _restart, redis_server))

    try:
        task = asyncio.create_task(restart_later())
        value = await guard.call(lambda: client.get("k"), "reading k")  # many failed attempts, one line
        await task
        assert value == b"v"  # the AOF kept it
        lines = out.getvalue().splitlines()
        assert len(lines) == 2, lines
        assert lines[0].startswith("WARNING asyncrl feeder: Redis unreachable while reading k")
        assert lines[1].startswith("asyncrl feeder: Redis is back after")
        assert guard.outages == 1 and not guard.down
    finally:
        await client.aclose()
        for s in restarted:
            s.kill()


async def test_outage_guard_fails_loudly_past_its_deadline(redis_server):
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_server.url)
    redis_server.kill()
    guard = OutageGuard("trainer", deadline_seconds=1.0, out=io.StringIO(), max_backoff_seconds=0.2)
    t0 = time.monotonic()
    with pytest.raises(DependencyOutage, match=r"asyncrl trainer: Redis has been unreachable for \d+ s .* while "
                                               r"waiting for the batch of step 7"):
        await guard.call(lambda: client.get("k"), "waiting for the batch of step 7")
    assert 1.0 <= time.monotonic() - t0 < 5
    with pytest.raises(DependencyOutage, match="stopped while Redis was unreachable"):
        await guard.call(lambda: client.get("k"), "x", give_up=lambda: True)
    # a request error is not an outage: it propagates at once
    with pytest.raises(ValueError):
        await guard.call(lambda: (_ for _ in ()).throw(ValueError("bad")), "y")  # type: ignore[arg-type]
    await client.aclose()


def test_outage_guard_rejects_a_non_positive_deadline():
    with pytest.raises(ValueError, match="deadline_seconds"):
        OutageGuard("x", 0)


@pytest.fixture
def feed_cfg(tiny_model_dir):
    from asyncrl.core.config import load_config

    return load_config(["--model_path", str(tiny_model_dir), "--rollout_batch_size", "3",
                        "--n_samples_per_prompt", "2", "--run_name", "faults",
                        "--data.num_train_prompts", "50", "--max_response_len", "64", "--max_budget", "64"])


async def test_feeder_rides_out_a_redis_restart(feed_cfg, redis_server, tiny_model_dir):
    """Before: the feeder died with ConnectionError at every Redis restart (and used up a restart)."""
    from asyncrl.feeder.feeder import Feeder
    from asyncrl.models import load_tokenizer
    from asyncrl.tasks.tasks import TrainPromptStream
    from buffers import BufferSettings, ReplayBuffer

    buf = await ReplayBuffer.open(redis_server.url, run="faults", settings=BufferSettings.from_config(feed_cfg))
    stream = TrainPromptStream(feed_cfg.data, load_tokenizer(tiny_model_dir), seed=0)
    feeder = Feeder(buf, stream, 2, target_pending=3)
    out = io.StringIO()
    guard = OutageGuard("feeder", deadline_seconds=30, out=out, max_backoff_seconds=0.3)
    stop = asyncio.Event()
    task = asyncio.create_task(feeder.run(stop, poll_seconds=0.05, guard=guard))
    restarted = None
    try:
        await asyncio.sleep(0.5)
        assert await buf.pending_groups() == 3
        cursor = await buf.dataset_cursor()
        redis_server.kill()
        await asyncio.sleep(1.0)
        assert not task.done(), "the feeder died with Redis"
        restarted = await asyncio.get_running_loop().run_in_executor(None, _restart, redis_server)
        await asyncio.sleep(1.5)
        assert not task.done()
        # nothing fed twice or skipped across the outage (the cursor survived on the AOF)
        assert await buf.pending_groups() == 3 and await buf.dataset_cursor() == cursor
        assert "WARNING asyncrl feeder: Redis unreachable while feeding prompt groups" in out.getvalue()
        assert out.getvalue().count("WARNING") == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await buf.close()
        if restarted is not None:
            restarted.kill()


async def test_a_rollout_worker_logs_one_warning_per_redis_outage(redis_server, tiny_model_dir, caplog):
    """Before: one WARNING per in-flight sample (and one per second of failed claims) at every
    Redis restart. Now: one line when the outage begins, one with the count when it ends."""
    from asyncrl.models import load_tokenizer
    from asyncrl.tasks.rewards import RewardScorer
    from asyncrl.core.types import PromptGroup
    from buffers import BufferSettings, ReplayBuffer
    from rollout_server.client import EngineClient
    from rollout_server.testing import start_embedded_server
    from rollout_server.worker import RolloutWorker, WorkerOptions

    tok = load_tokenizer(tiny_model_dir)
    settings = BufferSettings(rollout_batch_size=4, train_batch_groups=2, n_samples_per_prompt=2,
                              max_budget=400, max_response_len=400, max_staleness=1, lease_seconds=3.0,
                              flush_tokens=4)
    srv = await asyncio.get_running_loop().run_in_executor(
        None, lambda: start_embedded_server(tiny_model_dir, "--weight-version", "0"))
    buf = await ReplayBuffer.open(redis_server.url, run="outage-worker", settings=settings)
    groups = [PromptGroup(f"g{i}", list(tok(f"count {i}")["input_ids"]), {}, n_samples=2) for i in range(4)]
    await buf.feed(groups, await buf.dataset_cursor())
    opts = WorkerOptions("w0", temperature=1.0, max_inflight_requests=8, version_poll_seconds=0.1)
    worker = RolloutWorker(buf, EngineClient(srv.url), RewardScorer("rollout_worker_rewards:length_reward"), tok, opts)
    stop = asyncio.Event()
    caplog.set_level(logging.WARNING, logger="rollout_server.worker")
    task = asyncio.create_task(worker.run(stop))
    restarted = None
    try:
        deadline = time.monotonic() + 60
        while len(worker._active) < 4:  # samples streaming
            assert time.monotonic() < deadline and not task.done(), "the worker did not start its samples"
            await asyncio.sleep(0.05)
        redis_server.kill()
        await asyncio.sleep(3.0)  # flushes fail, claims fail for a few seconds
        assert not task.done(), "the worker died with Redis"
        restarted = await asyncio.get_running_loop().run_in_executor(None, _restart, redis_server)
        deadline = time.monotonic() + 60
        while not any("reachable again" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline and not task.done(), "no recovery line"
            await asyncio.sleep(0.1)
        warnings = [r.getMessage() for r in caplog.records if r.name == "rollout_server.worker"
                    and r.levelno == logging.WARNING]
        assert len(warnings) == 2, warnings
        assert warnings[0].startswith("redis unreachable: ")
        interrupted = int(warnings[1].split("; ")[1].split()[0])
        assert warnings[1].startswith("redis reachable again") and interrupted >= 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await buf.close()
        srv.stop()
        if restarted is not None:
            restarted.kill()


async def test_trainer_batch_wait_has_a_deadline(feed_cfg, redis_server):
    """Before: ``next_batch`` polled forever when no rollout server produced a batch (a silent hang)."""
    from buffers import BufferSettings, ReplayBuffer
    from trainer.sources import BatchWaitTimeout, BufferBatchSource

    buf = await ReplayBuffer.open(redis_server.url, run="faults", settings=BufferSettings.from_config(feed_cfg))
    src = BufferBatchSource(buf, batch_wait_seconds=1.0)
    t0 = time.monotonic()
    with pytest.raises(BatchWaitTimeout, match=r"batch of step 4 .*groups by state: .*rollout servers"):
        await src.next_batch(4)
    assert time.monotonic() - t0 < 10
    await buf.close()


async def test_trainer_source_rides_out_an_outage_and_stops_when_asked(feed_cfg, redis_server):
    import threading

    from buffers import BufferSettings, ReplayBuffer
    from trainer.sources import BufferBatchSource

    buf = await ReplayBuffer.open(redis_server.url, run="faults", settings=BufferSettings.from_config(feed_cfg))
    stop = threading.Event()
    src = BufferBatchSource(buf, stop, outage_seconds=60)
    src.guard.out = io.StringIO()
    redis_server.kill()
    task = asyncio.create_task(src.next_batch(1))
    await asyncio.sleep(1.0)
    assert not task.done(), "the trainer's batch wait crashed on the outage"
    stop.set()  # SIGTERM while Redis is down: the wait ends, no batch
    assert await asyncio.wait_for(task, 10) is None
    assert "WARNING asyncrl trainer: Redis unreachable while waiting for the batch of step 1" in src.guard.out.getvalue()
    await buf.close()


async def test_a_stopping_trainer_source_gives_up_on_redis_after_its_stop_grace(feed_cfg, redis_server):
    """Before: told to stop (its controller died) while Redis was down for good, the trainer's
    final checkpoint waited buffer.outage_seconds (300 s) for the dataset cursor and the commit.
    Now, once stopping, each waits at most ``stop_outage_seconds``; not stopping, the full deadline."""
    import threading

    from buffers import BufferSettings, ReplayBuffer
    from trainer.sources import BufferBatchSource

    buf = await ReplayBuffer.open(redis_server.url, run="faults", settings=BufferSettings.from_config(feed_cfg))
    stop = threading.Event()
    src = BufferBatchSource(buf, stop, outage_seconds=60)
    src.stop_outage_seconds = 0.5
    src.guard.out = io.StringIO()
    redis_server.kill()
    waiting = asyncio.create_task(src.commit(3))
    await asyncio.sleep(1.5)
    assert not waiting.done(), "not stopping: the commit must wait the outage out"
    stop.set()
    with pytest.raises(DependencyOutage, match="stopped while Redis was unreachable .*committing step 3"):
        await asyncio.wait_for(waiting, 10)
    t0 = time.monotonic()
    with pytest.raises(DependencyOutage, match="reading the dataset cursor"):
        await src.state_dict()
    assert time.monotonic() - t0 < 5
    await buf.close()


def test_a_stop_checkpoint_is_written_without_an_unreachable_redis(feed_cfg, redis_server, tmp_path, capsys):
    """The loop's stop checkpoint (real Trainer, real DeepSpeed on CPU): Redis down for good, the
    checkpoint of the step is still written, and the trainer says what it left for later."""
    import threading

    from buffers import BufferSettings, ReplayBuffer
    from trainer.loop import _checkpoint
    from trainer.sources import BufferBatchSource
    from trainer.trainer import Trainer

    from asyncrl.core.config import load_config

    cfg = load_config(["--model_path", feed_cfg.model.path, "--run_name", "faults", "--output_dir", str(tmp_path)])
    trainer = Trainer(cfg)
    try:
        trainer.step = 4
        stop = threading.Event()
        src = BufferBatchSource(trainer.run_async(ReplayBuffer.open(redis_server.url, run="faults",
                                                                    settings=BufferSettings.from_config(cfg))), stop)
        src.stop_outage_seconds = 0.2
        src.guard.out = io.StringIO()
        redis_server.kill()
        stop.set()
        t0 = time.monotonic()
        _checkpoint(trainer, src, stopping=True)
        assert time.monotonic() - t0 < 60
        assert (tmp_path / "faults" / "checkpoints" / "step00000004").is_dir()
        err = capsys.readouterr().err
        assert "written without the dataset cursor" in err and "step 4 is checkpointed but not committed" in err
        stop.clear()  # not stopping: the same outage is not swallowed (here: past a 1 s deadline)
        src.guard.deadline_seconds = 1.0
        with pytest.raises(DependencyOutage):
            _checkpoint(trainer, src, stopping=False)
    finally:
        trainer.close()


# ----------------------------------------------------------------------------------------------
# the supervisor's restart accounting


def test_failures_during_a_redis_restart_do_not_use_up_restarts(tmp_path):
    """Before: each Redis restart cost every role one restart, so a second fault stopped the run."""
    from asyncrl.controller.supervisor import RoleSpec, Supervisor

    with Supervisor(tmp_path / "logs") as sup:
        sup.start(RoleSpec("flaky", [sys.executable, "-c", "import sys; sys.exit(1)"], restart=True, max_restarts=1,
                           restart_delay_seconds=0.05))
        sup.excuse_exits(30, "Redis restarted")
        excused = []
        deadline = time.monotonic() + 20
        while len(excused) < 3 and time.monotonic() < deadline:
            excused += [ev for ev in sup.poll() if ev.name == "flaky"]
            time.sleep(0.05)
        assert len(excused) == 3 and all(ev.restarted and ev.excused == "Redis restarted" for ev in excused)
        assert sup.restarts("flaky") == 0
        assert "not counted as a crash (Redis restarted)" in excused[0].describe()
        sup._excuse_until = 0.0  # the window is over: its own crashes count again
        counted = []
        while len(counted) < 2 and time.monotonic() < deadline + 20:
            counted += [ev for ev in sup.poll() if ev.name == "flaky"]
            time.sleep(0.05)
        assert [ev.restarted for ev in counted] == [True, False] and sup.restarts("flaky") == 1
        assert not counted[1].excused


def test_a_signal_death_during_an_outage_still_counts(tmp_path):
    """A SIGKILLed (or OOM-killed) role crashed on its own, outage or not."""
    from asyncrl.controller.supervisor import RoleSpec, Supervisor

    with Supervisor(tmp_path / "logs") as sup:
        sup.start(RoleSpec("killed", [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                           restart=True, max_restarts=3, restart_delay_seconds=0.05))
        sup.excuse_exits(30, "Redis restarted")
        deadline = time.monotonic() + 20
        events = []
        while not events and time.monotonic() < deadline:
            events = sup.poll()
            time.sleep(0.05)
        assert events[0].restarted and not events[0].excused and sup.restarts("killed") == 1


def test_a_fatal_exit_stays_fatal_during_an_outage(tmp_path):
    from asyncrl.controller.supervisor import RoleSpec, Supervisor

    with Supervisor(tmp_path / "logs") as sup:
        sup.start(RoleSpec("bad", [sys.executable, "-c", "import sys; sys.exit(2)"], restart=True,
                           fatal_exit_codes=(2,)))
        sup.excuse_exits(30, "Redis restarted")
        deadline = time.monotonic() + 20
        events = []
        while not events and time.monotonic() < deadline:
            events = sup.poll()
            time.sleep(0.05)
        assert not events[0].restarted and not events[0].excused


# ----------------------------------------------------------------------------------------------
# ports


def test_a_port_in_time_wait_is_not_busy():
    """Before: a resumed run reported its own previous rollout port (connections in TIME_WAIT) as
    busy and moved its servers to other ports."""
    from asyncrl.core.net import ports_free

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.listen()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server closes first: its side of the connection goes to TIME_WAIT
    time.sleep(0.1)
    client.close()
    assert not ports_free("127.0.0.1", port, 1)  # still listening: busy
    listener.close()
    time.sleep(0.1)
    assert ports_free("127.0.0.1", port, 1)
    # what a server (aiohttp, SO_REUSEADDR) does with it: it binds
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.close()


# ----------------------------------------------------------------------------------------------
# the engine's log when the worker drops a stream


async def test_a_dropped_stream_is_one_info_line_not_an_error_traceback(caplog):
    import aiohttp
    from aiohttp import web

    from rollout_server.role import ClientDisconnectFilter, quiet_client_disconnects

    async def stream(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(200):
            await resp.write(b"data: %d\n\n" % i)
            await asyncio.sleep(0.02)
        return resp

    async def run_once() -> list[logging.LogRecord]:
        caplog.clear()
        app = web.Application()
        app.router.add_get("/generate", stream)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        async with aiohttp.ClientSession() as s:
            resp = await s.get(f"http://127.0.0.1:{port}/generate")
            await resp.content.readline()
            resp.close()  # the worker drops the sample mid-stream
        await asyncio.sleep(0.5)
        await runner.cleanup()
        return [r for r in caplog.records if r.name == "aiohttp.server"]

    logger = logging.getLogger("aiohttp.server")
    for f in [f for f in logger.filters if isinstance(f, ClientDisconnectFilter)]:
        logger.removeFilter(f)
    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        before = await run_once()
        assert any(r.levelno == logging.ERROR and r.exc_info for r in before), "the reproduction must show the ERROR"
        f = quiet_client_disconnects()
        assert quiet_client_disconnects() is f  # installed once
        try:
            after = await run_once()
        finally:
            logger.removeFilter(f)
    assert after and all(r.levelno == logging.INFO and not r.exc_info for r in after), after
    assert "the client closed the connection mid-response" in after[0].getMessage()


# ----------------------------------------------------------------------------------------------
# orphans and the previous session


def _alive(pid: int) -> bool:
    from asyncrl.core.process_guard import alive

    return alive(pid)


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out: {what}")


def test_redis_guardian_outlives_a_dead_controller_until_the_roles_exit(tmp_path):
    """Before: redis-server died with the controller (PDEATHSIG), so the draining trainer could not
    acknowledge or commit its last step and trained it again after --resume."""
    from asyncrl.core.process_guard import guarded_command, write_pids

    pids_file = tmp_path / "pids.json"
    role = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    write_pids(pids_file, {"trainer": role.pid})
    child_pid_file = tmp_path / "child.pid"
    # a stand-in for the controller: starts the guardian (around a long sleep), then is SIGKILLed
    guarded = guarded_command([sys.executable, "-c", f"import os, time; open({str(child_pid_file)!r}, 'w')"
                               f".write(str(os.getpid())); time.sleep(120)"], pids_file, grace_seconds=60)
    controller = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                   f"subprocess.Popen({guarded!r}); time.sleep(120)"])
    try:
        _wait(lambda: child_pid_file.exists() and child_pid_file.read_text(), 20, "the guarded child started")
        child = int(child_pid_file.read_text())
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait()
        time.sleep(1.5)
        assert _alive(child), "the guarded process died with its controller while a role was still draining"
        role.terminate()
        role.wait()
        _wait(lambda: not _alive(child), 10, "the guardian stopping its child once the roles exited")
    finally:
        for p in (role, controller):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_guardian_passes_on_its_childs_death(tmp_path):
    from asyncrl.core.process_guard import guarded_command

    proc = subprocess.run(guarded_command([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "none.json", 5),
                          timeout=30)
    assert proc.returncode == 3


def test_resume_waits_for_the_previous_sessions_processes(tmp_path):
    from asyncrl.core.process_guard import wait_previous_session, write_pids

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    draining = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)", str(run_dir)])
    stubborn = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(run_dir)],
                                start_new_session=True)
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        write_pids(run_dir / "pids.json", {"rollout-0": draining.pid, "unrelated": unrelated.pid})
        out = io.StringIO()
        t0 = time.monotonic()
        assert wait_previous_session(run_dir / "pids.json", str(run_dir), 30, out=out) == []
        assert 1.0 < time.monotonic() - t0 < 20
        assert "previous session's rollout-0 (pid" in out.getvalue() and "unrelated" not in out.getvalue()
        assert unrelated.poll() is None  # a reused pid is not ours
        write_pids(run_dir / "pids.json", {"trainer": stubborn.pid})
        out = io.StringIO()
        assert wait_previous_session(run_dir / "pids.json", str(run_dir), 1.0, out=out) == ["trainer"]
        assert "WARNING" in out.getvalue() and stubborn.wait(10) == -signal.SIGKILL
        assert wait_previous_session(tmp_path / "missing.json", str(run_dir), 1.0) == []
    finally:
        for p in (draining, stubborn, unrelated):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_rollout_server_started_while_redis_is_down_waits_for_it(tmp_path, tiny_model_dir):
    """Before: ``asyncrl rollout-server`` exited 1 (ConnectionError) when Redis was restarting as it
    started, and its supervisor counted a crash."""
    import yaml

    from asyncrl.core.net import free_port

    port = free_port()
    password = "p" * 16
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    config = tmp_path / "rollout.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "late-redis", "output_dir": str(tmp_path / "runs")}, "model": {"path": str(tiny_model_dir)},
        "rollout": {"base_port": 0, "n_samples_per_prompt": 2, "rollout_batch_size": 2, "max_budget": 32,
                    "max_response_len": 32, "max_inflight_requests": 2, "engine_threads": 1},
        "buffer": {"redis_url": url, "outage_seconds": 120}}))
    log = tmp_path / "server.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "rollout-server", "--config", str(config)],
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    server = None
    try:
        _wait(lambda: "Redis unreachable while opening the run's buffer" in log.read_text() or proc.poll() is not None,
              180, "the rollout server waiting for Redis")
        assert proc.poll() is None, log.read_text()[-3000:]
        server = RedisServer(tmp_path / "redis", port=port, password=password).start()
        _wait(lambda: "requests in flight" in log.read_text() or proc.poll() is not None, 60, "the worker starting")
        assert proc.poll() is None, log.read_text()[-3000:]
        text = log.read_text()
        assert text.count("WARNING asyncrl rollout-server") == 1 and "Redis is back after" in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server is not None:
            server.kill()


def test_a_held_out_evaluation_past_its_deadline_is_killed_and_training_goes_on(tmp_path, tiny_model_dir, capsys):
    """Before: the controller waited for ``asyncrl eval`` without a bound, every role paused."""
    from asyncrl.controller.resources import assign_resources
    from asyncrl.metrics.tracking import read_metrics
    from tests.test_controller_eval import _controller

    ctl = _controller(tmp_path, tiny_model_dir)
    ctl.cfg.monitoring.eval_timeout_seconds = 1.0
    t0 = time.monotonic()
    asyncio.run(ctl._evaluate(None, None, assign_resources(ctl.cfg)))
    ctl.logger.close()
    assert time.monotonic() - t0 < 15
    assert "did not finish within 1 s (monitoring.eval_timeout_seconds): killed" in capsys.readouterr().err
    [rec] = [r for r in read_metrics(ctl.run_dir) if "eval/eval_seconds" in r]
    assert rec["eval/failed"] == 1
