"""Process lifetimes across a controller's death: no orphans, Redis outlives the roles' drain,
and a resumed session waits for the previous one's processes.

Orphans. Every role of ``asyncrl train`` is started with ``PR_SET_PDEATHSIG`` = SIGTERM
(:func:`parent_death_signal`, ``prctl(2)`` through ctypes, Linux): when the controller dies, even
by SIGKILL, the kernel sends each child SIGTERM and it drains as on Ctrl-C (rollout servers park
their partial samples, the trainer finishes its step and checkpoints). We chose the kernel's
signal over a parent-pid watchdog thread because it needs no polling and also covers a child
stopped in C code; its one caveat — the signal fires when the *thread* that forked the child
exits — is why the supervisor forks from the controller's main thread only.

Redis last. Those drains need the buffer: the trainer acknowledges its step, publishes and
commits. If the embedded redis-server died with the controller too, the trainer's orderly stop
failed and the step was trained again after ``--resume``. So the embedded Redis runs under a
guardian (``python -m asyncrl.core.process_guard``, :func:`guarded_command`): the guardian gets
SIGTERM when the controller dies, then waits until every role listed in the run's pid file has
exited (at most ``grace`` seconds), and only then stops redis-server (SIGTERM: it fsyncs its
AOF). When redis-server dies on its own, the guardian exits with its status, so the controller
sees the outage and restarts it.

Resume. ``asyncrl train --resume`` first waits for the processes the previous session recorded
in ``<run_dir>/pids.json`` that are still alive (:func:`wait_previous_session`): draining roles
still hold the rollout ports and the guardian still holds the AOF. Past the deadline they are
SIGKILLed, with a WARNING naming them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["PidRecord", "alive", "guard", "guarded_command", "parent_death_signal", "pdeathsig_preexec", "read_pids",
           "wait_previous_session", "write_pids"]

_PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) dies; True if set.

    Linux only (``prctl(PR_SET_PDEATHSIG)``); returns False elsewhere.
    """
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        return False


def pdeathsig_preexec(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for ``subprocess.Popen`` that sets :func:`parent_death_signal` in the child.

    ``prctl`` is resolved here, in the parent: after ``fork`` the child must not ``dlopen``.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        prctl = None

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return preexec


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an unreaped corpse holds no port or file)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def write_pids(path: Path, pids: dict[str, int]) -> None:
    """Record ``{name: pid}`` atomically (rename) in ``path``."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(pids))
    os.replace(tmp, path)


def read_pids(path: Path) -> dict[str, int]:
    """The ``{name: pid}`` recorded in ``path``; empty when missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): int(v) for k, v in data.items() if isinstance(v, int)} if isinstance(data, dict) else {}


def wait_previous_session(pids_file: Path, identity: str, timeout_seconds: float, out=None) -> list[str]:
    """Wait until the processes recorded in ``pids_file`` by an earlier session have exited.

    Only a process whose command line contains ``identity`` (the run directory) counts: a pid
    reused by an unrelated process is ignored. One line is printed when there is something to
    wait for; after ``timeout_seconds`` the stragglers' process groups are SIGKILLed (WARNING).

    Returns:
        the names that had to be killed (empty when all exited in time or none was alive).
    """
    out = out or sys.stderr
    waiting = {n: p for n, p in read_pids(pids_file).items()
               if p != os.getpid() and alive(p) and identity in _cmdline(p)}
    if not waiting:
        return []
    names = ", ".join(f"{n} (pid {p})" for n, p in sorted(waiting.items()))
    print(f"asyncrl train: waiting up to {timeout_seconds:.0f} s for the previous session's {names} to exit "
          "(they drain after their controller died)", file=out, flush=True)
    deadline = time.monotonic() + timeout_seconds
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)
        waiting = {n: p for n, p in waiting.items() if alive(p)}
    for p in waiting.values():
        for kill in (lambda: os.killpg(p, signal.SIGKILL), lambda: os.kill(p, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass
    if waiting:
        print(f"WARNING asyncrl train: the previous session's {', '.join(sorted(waiting))} did not exit within "
              f"{timeout_seconds:.0f} s; killed", file=out, flush=True)
    return sorted(waiting)


def guarded_command(cmd: list[str], pids_file: Path, grace_seconds: float, ignore: str = "redis") -> list[str]:
    """``cmd`` under the guardian (module docstring): it outlives the controller until the roles
    recorded in ``pids_file`` (all but ``ignore``) have exited, at most ``grace_seconds``."""
    return [sys.executable, "-m", "asyncrl.core.process_guard", "--pids-file", str(pids_file),
            "--grace", str(float(grace_seconds)), "--ignore", ignore, "--", *cmd]


def guard(server, pids_file: Path, grace_seconds: float):
    """Wrap a :class:`asyncrl.controller.redis_server.RedisServer`'s command line in the guardian
    (:func:`guarded_command`) before it starts; returns the server."""
    inner = server.command_line
    server.command_line = lambda: guarded_command(inner(), pids_file, grace_seconds)
    return server


class PidRecord:
    """``pids.json`` of a run: ``{role: pid}`` of the supervisor's roles plus ``redis`` (the
    guardian), rewritten when a pid changes. The guardian waits for these roles; a ``--resume``
    waits for all of them (:func:`wait_previous_session`)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.last: dict[str, int] = {}

    def update(self, sup, redis) -> None:
        """Record the current pids of ``sup``'s roles and of ``redis.proc`` (either may be None)."""
        pids: dict[str, int] = {}
        if sup is not None:
            pids.update({n: pid for n in sup.names if (pid := sup.pid(n)) is not None})
        if redis is not None and redis.proc is not None:
            pids["redis"] = redis.proc.pid
        if pids != self.last:
            write_pids(self.path, pids)
            self.last = pids


def main(argv: list[str]) -> int:
    """The guardian: run ``cmd``; on SIGTERM (the controller's stop, or its death) wait for the
    roles, then SIGTERM ``cmd``; exit with ``cmd``'s status when it ends on its own."""
    parser = argparse.ArgumentParser(prog="python -m asyncrl.core.process_guard")
    parser.add_argument("--pids-file", required=True)
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--ignore", default="redis")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given after --")
    parent = os.getppid()
    stopping = False

    def on_term(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the controller's to handle
    parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the controller died before prctl took effect
        stopping = True
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=pdeathsig_preexec(signal.SIGTERM))
    while child.poll() is None and not stopping:
        time.sleep(0.1)
    if child.poll() is not None:
        rc = child.returncode
        return 128 - rc if rc < 0 else rc
    deadline = time.monotonic() + args.grace
    while time.monotonic() < deadline:
        roles = {n: p for n, p in read_pids(Path(args.pids_file)).items() if n != args.ignore}
        if not any(alive(p) for p in roles.values()) or child.poll() is not None:
            break
        time.sleep(0.1)
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(20)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
