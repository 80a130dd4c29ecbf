"""Supervisor tests with real child processes (small ``python -c`` scripts), real signals and /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncrl.controller.supervisor import RoleSpec, Supervisor, SupervisorError, http_health_check, split_cores, tail_lines

PY = sys.executable


def py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def wait_for(pred, timeout=10.0, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return False


def poll_until_event(sup: Supervisor, timeout=10.0):
    events = []
    assert wait_for(lambda: bool(events.extend(sup.poll()) or events), timeout), "no child event"
    return events


def test_death_is_reported_with_last_log_lines(tmp_path):
    with Supervisor(tmp_path / "logs") as sup:
        sup.start(RoleSpec("worker", py("""
            import sys
            for i in range(30):
                print(f"line {i}")
            print("fatal: out of cheese", file=sys.stderr)
            sys.exit(3)
        """)))
        [ev] = poll_until_event(sup)
        assert ev.name == "worker" and ev.returncode == 3 and ev.failed and not ev.restarted
        assert "fatal: out of cheese" in ev.log_tail and "line 29" in ev.log_tail
        assert "line 0\n" not in ev.log_tail  # only the tail
        text = ev.describe()
        assert "exited with status 3" in text and "not restarted" in text
        assert not sup.is_running("worker")
        assert (tmp_path / "logs" / "worker.log").read_text().count("=== asyncrl supervisor: starting worker") == 1


def test_killed_child_is_described_by_signal(tmp_path):
    with Supervisor(tmp_path) as sup:
        proc = sup.start(RoleSpec("w", py("import time; time.sleep(60)")))
        os.kill(proc.pid, signal.SIGKILL)
        [ev] = poll_until_event(sup)
        assert ev.returncode == -signal.SIGKILL and "killed by SIGKILL" in ev.describe()


def test_restartable_role_is_restarted_then_gives_up(tmp_path):
    counter = tmp_path / "count"
    code = f"""
        import pathlib, sys
        p = pathlib.Path({str(counter)!r})
        n = int(p.read_text()) if p.exists() else 0
        p.write_text(str(n + 1))
        print(f"attempt {{n}}")
        sys.exit(1)
    """
    with Supervisor(tmp_path / "logs") as sup:
        sup.start(RoleSpec("rollout-0", py(code), restart=True, max_restarts=2, restart_delay_seconds=0.0))
        seen = []
        assert wait_for(lambda: bool(seen.extend(sup.poll())) or any(not e.restarted for e in seen), 20)
        assert [e.restarted for e in seen] == [True, True, False]
        assert [e.restarts for e in seen] == [1, 2, 2]
        assert counter.read_text() == "3"
        assert "attempt 2" in seen[-1].log_tail
        assert sup.restarts("rollout-0") == 2 and not sup.is_running("rollout-0")
        log = (tmp_path / "logs" / "rollout-0.log").read_text()
        assert "(attempt 3)" in log and "attempt 0" in log  # restarts append to the same log


def test_fatal_exit_code_is_not_restarted(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start(RoleSpec("trainer", py("import sys; print('bad config'); sys.exit(2)"), restart=True,
                           fatal_exit_codes=(2,)))
        [ev] = poll_until_event(sup)
        assert ev.returncode == 2 and not ev.restarted and "bad config" in ev.log_tail


def test_clean_exit_is_not_restarted(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start(RoleSpec("trainer", py("print('done')"), restart=True))
        [ev] = poll_until_event(sup)
        assert ev.returncode == 0 and not ev.failed and not ev.restarted


def test_stop_all_forwards_sigterm_in_order_and_waits(tmp_path):
    order_file = tmp_path / "order"
    handler = """
        import os, signal, sys, time
        def on_term(sig, frame):
            time.sleep(0.3)  # draining: park partials / checkpoint
            with open({path!r}, "a") as f:
                f.write("{name}\\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("ready", flush=True)
        while True:
            time.sleep(0.05)
    """
    with Supervisor(tmp_path / "logs") as sup:
        for name, order in (("trainer", 2), ("rollout-0", 1), ("rollout-1", 1), ("feeder", 0)):
            sup.start(RoleSpec(name, py(handler.format(path=str(order_file), name=name)), stop_order=order))
        assert wait_for(lambda: all("ready" in sup.log_tail(n).splitlines() for n in sup.names))
        codes = sup.stop_all(grace_seconds=10)
        assert codes == {"trainer": 0, "rollout-0": 0, "rollout-1": 0, "feeder": 0}
        lines = order_file.read_text().split()
        assert lines[0] == "feeder" and lines[-1] == "trainer"
        assert sorted(lines[1:3]) == ["rollout-0", "rollout-1"]
        assert sup.running() == []


def test_stop_kills_a_child_that_ignores_sigterm_and_its_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    code = f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        g = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
        open({str(pidfile)!r}, "w").write(str(g.pid))
        time.sleep(60)
    """
    with Supervisor(tmp_path) as sup:
        sup.start(RoleSpec("stubborn", py(code), stop_grace_seconds=0.5))
        assert wait_for(lambda: pidfile.exists() and pidfile.read_text().strip())
        grandchild = int(pidfile.read_text())
        t0 = time.monotonic()
        codes = sup.stop(["stubborn"])
        assert codes["stubborn"] == -signal.SIGKILL
        assert time.monotonic() - t0 < 5
        assert wait_for(lambda: not Path(f"/proc/{grandchild}").exists() or _state(grandchild) == "Z")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


def test_affinity_threads_and_gpus_are_applied(tmp_path):
    core = sorted(os.sched_getaffinity(0))[-1]
    code = """
        import os, time
        print("OMP", os.environ["OMP_NUM_THREADS"], "CUDA", os.environ["CUDA_VISIBLE_DEVICES"], "ROLE", os.environ["ASYNCRL_ROLE"], "X", os.environ["X"], flush=True)
        time.sleep(60)
    """
    with Supervisor(tmp_path) as sup:
        proc = sup.start(RoleSpec("trainer", py(code), cores=[core], gpus=[], env={"X": "1"}))
        assert wait_for(lambda: sup.log_tail("trainer").splitlines()[-1].startswith("OMP"))
        assert _cpus_allowed(proc.pid) == str(core)
        assert "OMP 1 CUDA  ROLE trainer X 1" in sup.log_tail("trainer")
        sup.stop_all(grace_seconds=2)


def test_nice_is_applied_and_checked(tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    with Supervisor(tmp_path) as sup:
        low = sup.start(RoleSpec("rollout-0", py("import time; time.sleep(60)"), nice=19))
        plain = sup.start(RoleSpec("trainer", py("import time; time.sleep(60)")))
        assert os.getpriority(os.PRIO_PROCESS, low.pid) == min(19, base + 19)
        assert os.getpriority(os.PRIO_PROCESS, plain.pid) == base
        group = Path(f"/proc/{low.pid}/autogroup")
        if group.exists():  # each role is its own session: its scheduling group carries the nice too
            assert group.read_text().split()[-1] == "19", group.read_text()
            assert Path(f"/proc/{plain.pid}/autogroup").read_text().split()[-1] == "0"
        with pytest.raises(SupervisorError, match="nice 20 is outside 0..19"):
            sup.start(RoleSpec("x", py("pass"), nice=20))
        sup.stop_all(grace_seconds=2)


def test_unknown_core_and_bad_command_are_errors(tmp_path):
    with Supervisor(tmp_path) as sup:
        with pytest.raises(SupervisorError, match="cores .* not available"):
            sup.start(RoleSpec("x", py("pass"), cores=[4096]))
        with pytest.raises(SupervisorError, match="cannot execute"):
            sup.start(RoleSpec("y", [str(tmp_path / "no-such-binary")]))
        sup.start(RoleSpec("z", py("import time; time.sleep(30)")))
        with pytest.raises(SupervisorError, match="already running"):
            sup.start(RoleSpec("z", py("pass")))


def test_unhealthy_child_is_killed_and_restarted(tmp_path):
    flag = tmp_path / "healthy"
    flag.write_text("1")

    def check() -> bool:
        return flag.exists()

    with Supervisor(tmp_path) as sup:
        sup.start(RoleSpec("rollout-0", py("import time; time.sleep(60)"), restart=True,
                           health_check=check, health_interval_seconds=0.0, health_failures=2,
                           restart_delay_seconds=0.0))
        sup.wait_healthy("rollout-0", timeout_seconds=5)
        first = sup.pid("rollout-0")
        flag.unlink()
        [ev] = poll_until_event(sup)
        assert ev.reason == "unhealthy" and ev.restarted and ev.failed
        assert "health check" in ev.describe()
        flag.write_text("1")
        assert wait_for(lambda: not sup.poll() and sup.pid("rollout-0") != first and _state(sup.pid("rollout-0")) in "SR")


def test_wait_healthy_errors(tmp_path):
    with Supervisor(tmp_path) as sup:
        sup.start(RoleSpec("dies", py("import sys; print('bad port'); sys.exit(2)"), health_check=lambda: False))
        with pytest.raises(SupervisorError, match="exited with status 2 while starting(.|\n)*bad port"):
            sup.wait_healthy("dies", timeout_seconds=10)
        sup.start(RoleSpec("slow", py("import time; time.sleep(30)"), health_check=lambda: False))
        with pytest.raises(SupervisorError, match="did not become healthy"):
            sup.wait_healthy("slow", timeout_seconds=0.3)


def test_http_health_check_against_real_server(tmp_path):
    from asyncrl.core.net import free_port

    port = free_port()
    check = http_health_check(f"http://127.0.0.1:{port}/", timeout_seconds=0.5)
    assert check() is False
    with Supervisor(tmp_path) as sup:
        sup.start(RoleSpec("http", [PY, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                           cwd=str(tmp_path), health_check=check))
        sup.wait_healthy("http", timeout_seconds=10)


def test_pause_and_resume_stop_the_process_group(tmp_path):
    with Supervisor(tmp_path) as sup:
        proc = sup.start(RoleSpec("busy", py("import time\nwhile True: time.sleep(0.01)")))
        assert wait_for(lambda: _state(proc.pid) in "SR")
        sup.pause()
        assert wait_for(lambda: _state(proc.pid) == "T")
        sup.resume()
        assert wait_for(lambda: _state(proc.pid) in "SR")
        sup.pause()  # a paused child still stops cleanly (SIGCONT before SIGTERM)
        assert sup.stop_all(grace_seconds=5) == {"busy": -signal.SIGTERM}


def test_children_die_with_a_killed_controller(tmp_path):
    pidfile = tmp_path / "child.pid"
    controller = f"""
        import time
        from asyncrl.controller.supervisor import RoleSpec, Supervisor
        sup = Supervisor({str(tmp_path / 'logs')!r})
        p = sup.start(RoleSpec("c", [{PY!r}, "-c", "import time; time.sleep(60)"]))
        open({str(pidfile)!r}, "w").write(str(p.pid))
        time.sleep(60)
    """
    parent = subprocess.Popen(py(controller))
    try:
        assert wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=20)
        child = int(pidfile.read_text())
        parent.kill()
        parent.wait()
        assert wait_for(lambda: _state(child) in ("gone", "Z"))
    finally:
        parent.kill()


def test_split_cores_and_tail_lines(tmp_path):
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([0], 3) == [[0], [0], [0]]
    with pytest.raises(ValueError, match="at least one core"):
        split_cores([], 1)
    f = tmp_path / "log"
    f.write_text("".join(f"{i}\n" for i in range(100)))
    assert tail_lines(f, 3) == "97\n98\n99"
    assert tail_lines(tmp_path / "missing") == "(no log)"


def test_children_do_not_inherit_the_supervisors_rendezvous_variables(tmp_path):
    """A parent that is itself a torch.distributed rank (e.g. a test process that initialised a
    one-rank group) must not hand its MASTER_PORT/WORLD_SIZE to a child trainer."""
    base = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "50385"}
    sup = Supervisor(tmp_path / "logs", base_env=base)
    env = sup.child_env(RoleSpec("trainer", ["true"], env={"MASTER_PORT": "29511"}))
    assert "WORLD_SIZE" not in env and "RANK" not in env and "MASTER_ADDR" not in env
    assert env["MASTER_PORT"] == "29511"  # what the role's own spec sets still applies
    assert env["PATH"] == os.environ["PATH"]
