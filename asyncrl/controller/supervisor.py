"""Process supervision for ``asyncrl train``: start roles as child processes and keep them honest.

Each role (rollout server, trainer, feeder) runs as its own OS process, exactly as it would on
a cluster, described by a :class:`RoleSpec`: a name, a command line, environment, the CPU cores
(and GPUs) it may use, where its log goes, whether it is safe to restart, and when it stops
relative to the others.

What the supervisor does:

* **Start.** ``subprocess.Popen`` in a new session (so a terminal's Ctrl-C reaches only the
  controller, which then stops the children *in order*), stdout+stderr appended to
  ``<log_dir>/<name>.log`` (mode 0600). In the child, before ``exec``: umask 077 (its files
  are private to the run's user), ``sched_setaffinity`` to the
  assigned cores and ``PR_SET_PDEATHSIG`` = SIGTERM (a child never outlives a controller that
  was SIGKILLed). ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` = number of assigned cores (torch
  reads them for its intra-op pool), ``CUDA_VISIBLE_DEVICES`` = the assigned GPUs.
* **Monitor.** :meth:`Supervisor.poll` reaps exited children and runs optional health checks
  (e.g. a rollout server's ``/health``); a child whose check fails ``health_failures`` times in
  a row is treated as hung and SIGKILLed. An exit is reported as a :class:`ChildExit` with the
  last lines of the child's log. A restartable role (``restart=True``) that exits non-zero is
  started again (up to ``max_restarts`` times, after ``restart_delay_seconds``); anything else
  is left for the controller to act on (it stops the run).
* **Stop.** :meth:`Supervisor.stop_all` stops children group by group in ascending
  ``stop_order``: SIGTERM to the role's main process (it drains: rollout servers park their
  partials, the trainer checkpoints), wait up to ``stop_grace_seconds``, then SIGKILL the
  whole process group (torchrun ranks, engine subprocesses) so nothing is left behind.
* **Pause.** :meth:`Supervisor.pause`/:meth:`resume` SIGSTOP/SIGCONT every child's process
  group, so held-out evaluation can use all cores without being counted as training time.
* **Outages.** :meth:`Supervisor.excuse_exits`: while a dependency (Redis) is restarting, a
  role that fails is restarted without counting against its ``max_restarts``.

Simplified: health is liveness plus an optional callable; there is no resource accounting
beyond affinity and thread counts, and no cgroups (a role can still exceed its memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = [
    "RoleSpec",
    "ChildExit",
    "Supervisor",
    "SupervisorError",
    "http_health_check",
    "resume_roles",
    "role_command",
    "split_cores",
    "tail_lines",
]

_PR_SET_PDEATHSIG = 1


class SupervisorError(RuntimeError):
    """A role could not be started (bad command, unknown core, duplicate name)."""


@dataclass
class RoleSpec:
    """How to run one role as a child process.

    Attributes:
        name: unique role name, also the log file's stem (``rollout-0``, ``trainer``, ``feeder``).
        argv: command line; ``argv[0]`` is resolved on PATH.
        env: variables added to (overriding) the controller's environment.
        cores: CPU core ids the process (and its threads and children) may run on; None: all.
        gpus: GPU ids exported as ``CUDA_VISIBLE_DEVICES``; None leaves the variable alone,
            ``[]`` hides every GPU.
        restart: restart the role when it exits non-zero or is found hung (safe for rollout
            servers: the buffer reclaims their claimed work; and for the trainer: it resumes from
            its checkpoint and the buffer rewinds).
        max_restarts: restarts allowed over the run; one more failure is final.
        fatal_exit_codes: exit statuses that are never restarted (e.g. 2: bad configuration,
            which a restart cannot fix).
        restart_delay_seconds: wait before a restart (lets ports and leases clear).
        stop_order: children stop in ascending order (equal values stop together).
        stop_grace_seconds: how long a child may drain after SIGTERM before SIGKILL.
        health_check: callable returning True when the role is healthy (called from
            :meth:`Supervisor.poll` at most every ``health_interval_seconds``); None: liveness only.
        health_interval_seconds: minimum seconds between health checks.
        health_failures: consecutive failed checks, after the role was healthy once, that mark it
            hung (SIGKILL, then the restart policy applies).
        cwd: working directory (None: the controller's).
        nice: added to the child's nice value (0-19; at 19 the kernel's fair scheduler gives it
            weight 15 against 1024 at nice 0: it runs on cores other roles leave idle). It also
            goes to the role's ``/proc/self/autogroup`` (sched(7)): each role is its own session,
            and with autogroups on a nice value only ranks a process inside its session's group.
    """

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cores: list[int] | None = None
    gpus: list[int] | None = None
    restart: bool = False
    max_restarts: int = 3
    fatal_exit_codes: tuple[int, ...] = ()
    restart_delay_seconds: float = 1.0
    stop_order: int = 0
    stop_grace_seconds: float = 30.0
    health_check: Callable[[], bool] | None = None
    health_interval_seconds: float = 5.0
    health_failures: int = 3
    cwd: str | None = None
    nice: int = 0


@dataclass
class ChildExit:
    """One child exit seen by :meth:`Supervisor.poll`.

    Attributes:
        name: the role name.
        returncode: exit status (negative: killed by that signal, as in ``Popen.returncode``).
        reason: ``exited`` or ``unhealthy`` (health checks failed; the supervisor killed it).
        restarted: True when the supervisor started the role again.
        restarts: restarts of this role so far (after this event), excused ones not counted.
        log_tail: the last lines of the role's log file.
        excused: why the exit did not count against ``max_restarts`` (a dependency's outage,
            :meth:`Supervisor.excuse_exits`); empty when it counted.
    """

    name: str
    returncode: int
    reason: str
    restarted: bool
    restarts: int
    log_tail: str
    excused: str = ""

    @property
    def failed(self) -> bool:
        """True for a non-zero exit or a hung child."""
        return self.returncode != 0 or self.reason != "exited"

    def describe(self) -> str:
        """A human-readable report: what happened and the log's last lines."""
        rc = self.returncode
        how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
        if self.reason == "unhealthy":
            how = "stopped answering its health check and was killed"
        action = f"restarted (restart {self.restarts})" if self.restarted else "not restarted"
        if self.restarted and self.excused:
            action = f"restarted; not counted as a crash ({self.excused})"
        return f"role {self.name!r} {how}; {action}. Last log lines:\n{self.log_tail}"


@dataclass
class _Child:
    spec: RoleSpec
    proc: subprocess.Popen
    log_path: Path
    started_at: float
    restarts: int = 0
    done: bool = False
    healthy_once: bool = False
    health_failures_in_row: int = 0
    last_health_check: float = 0.0
    restart_at: float | None = None
    killed_unhealthy: bool = False


def tail_lines(path: Path, n: int = 20, max_bytes: int = 65536) -> str:
    """The last ``n`` lines of a text file (reads at most ``max_bytes`` from its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return "(no log)"
    lines = data.decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:]) if lines else "(log is empty)"


def http_health_check(url: str, timeout_seconds: float = 2.0) -> Callable[[], bool]:
    """A health check for :class:`RoleSpec`: True when ``GET url`` answers 2xx within the timeout."""

    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=timeout_seconds) as resp:  # noqa: S310 (loopback URL from config)
                return 200 <= resp.status < 300
        except (urllib.error.URLError, OSError, ValueError):
            return False

    return check


def split_cores(cores: list[int], n: int) -> list[list[int]]:
    """Split ``cores`` into ``n`` contiguous, near-equal, non-empty groups.

    With fewer cores than groups, groups share cores round-robin (each gets one core).

    Raises:
        ValueError: ``cores`` is empty or ``n < 1``.
    """
    if n < 1 or not cores:
        raise ValueError(f"cannot split {cores!r} into {n} groups: need at least one core and one group")
    if len(cores) < n:
        return [[cores[i % len(cores)]] for i in range(n)]
    base, extra = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(cores[start : start + size])
        start += size
    return out


def _make_preexec(cores: list[int] | None, nice: int = 0) -> Callable[[], None]:
    # Resolve libc.prctl in the parent: the child (after fork) must not import or dlopen.
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        prctl = None
    core_set = set(cores) if cores else None

    def preexec() -> None:
        os.umask(0o077)  # what a role writes (logs, checkpoints, weights) is its owner's only (docs/security.md)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if core_set is not None:
            os.sched_setaffinity(0, core_set)
        if nice:
            os.nice(nice)
            # the role's own autogroup gets the nice too (raising it needs no privilege); without
            # autogroup support (another kernel or OS) the nice value alone applies
            with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as fh:
                fh.write(str(nice))

    return preexec


#: torch.distributed / torchrun variables a child must not inherit from the supervisor.
DIST_ENV_VARS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
})


class Supervisor:
    """Starts, watches, restarts, pauses and stops role processes.

    Args:
        log_dir: directory of the per-role log files (created).
        base_env: environment the children start from (default: ``os.environ``).

    Not thread-safe: call every method from the controller's main thread (``PR_SET_PDEATHSIG``
    fires when the *thread* that forked the child exits).
    """

    def __init__(self, log_dir: Path | str, base_env: dict[str, str] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self._children: dict[str, _Child] = {}
        self.paused = False
        self._excuse_until = 0.0
        self._excuse_reason = ""

    # -- start ---------------------------------------------------------------------------------

    def child_env(self, spec: RoleSpec) -> dict[str, str]:
        """The environment a role starts with (base + thread counts + GPUs + ``spec.env``).

        torch.distributed rendezvous variables of the supervisor's own environment
        (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...) are never inherited: a role that needs
        them gets its own through ``spec.env`` or its launcher (torchrun). Inheriting them made a
        one-rank trainer rendezvous on a port its parent still held (EADDRINUSE).
        """
        env = {k: v for k, v in self.base_env.items() if k not in DIST_ENV_VARS}
        if spec.cores:
            threads = str(len(spec.cores))
            env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
        if spec.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
        env["ASYNCRL_ROLE"] = spec.name
        env["PYTHONUNBUFFERED"] = "1"
        env.update(spec.env)
        return env

    def start(self, spec: RoleSpec) -> subprocess.Popen:
        """Start a role; returns its process.

        Raises:
            SupervisorError: the name is taken, a core does not exist on this machine, or the
                command cannot be executed (the message says which).
        """
        if spec.name in self._children and not self._children[spec.name].done:
            raise SupervisorError(f"a role named {spec.name!r} is already running")
        if not 0 <= spec.nice <= 19:
            raise SupervisorError(f"role {spec.name!r}: nice {spec.nice} is outside 0..19")
        if spec.cores is not None:
            available = os.sched_getaffinity(0)
            missing = sorted(set(spec.cores) - available)
            if not spec.cores or missing:
                raise SupervisorError(
                    f"role {spec.name!r}: cores {missing or spec.cores} are not available to this process "
                    f"(available: {sorted(available)}); fix resources.*_cores"
                )
        proc, log_path = self._spawn(spec, attempt=0)
        self._children[spec.name] = _Child(spec=spec, proc=proc, log_path=log_path, started_at=time.monotonic())
        return proc

    def _spawn(self, spec: RoleSpec, attempt: int) -> tuple[subprocess.Popen, Path]:
        log_path = self.log_dir / f"{spec.name}.log"
        log = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(
            f"=== asyncrl supervisor: starting {spec.name} (attempt {attempt + 1}) at {stamp}; "
            f"cores={spec.cores} gpus={spec.gpus}; cmd: {' '.join(spec.argv)}\n".encode()
        )
        log.flush()
        try:
            proc = subprocess.Popen(
                spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.child_env(spec),
                cwd=spec.cwd,
                start_new_session=True,
                preexec_fn=_make_preexec(spec.cores, spec.nice),
                close_fds=True,
            )
        except OSError as exc:
            raise SupervisorError(f"role {spec.name!r}: cannot execute {spec.argv[0]!r}: {exc}") from exc
        finally:
            log.close()
        return proc, log_path

    # -- queries -------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Names of every role started, in start order."""
        return list(self._children)

    def pid(self, name: str) -> int | None:
        """Current pid of a role (None once it has finished for good)."""
        child = self._children[name]
        return None if child.done else child.proc.pid

    def is_running(self, name: str) -> bool:
        """True while the role's current process is alive (or a restart is pending)."""
        child = self._children[name]
        return not child.done and (child.proc.poll() is None or child.restart_at is not None)

    def running(self) -> list[str]:
        """Names of roles not finished for good."""
        return [n for n in self._children if self.is_running(n)]

    def restarts(self, name: str) -> int:
        """How many times a role was restarted."""
        return self._children[name].restarts

    def log_path(self, name: str) -> Path:
        """The role's log file."""
        return self._children[name].log_path

    def log_tail(self, name: str, n: int = 20) -> str:
        """The last ``n`` lines of a role's log."""
        return tail_lines(self._children[name].log_path, n)

    # -- monitoring ----------------------------------------------------------------------------

    def poll(self) -> list[ChildExit]:
        """Reap exits, run due health checks, perform due restarts; returns the exits seen now.

        A restartable role that exits non-zero (or is killed as hung) with restarts left is
        scheduled to start again after its delay (``ChildExit.restarted`` is True); every other
        exit is final and left to the caller.
        """
        events: list[ChildExit] = []
        now = time.monotonic()
        for name, child in self._children.items():
            if child.done:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at and not self.paused:
                    child.restart_at = None
                    child.proc, _ = self._spawn(child.spec, attempt=child.restarts)
                    child.started_at = now
                    child.healthy_once = False
                    child.health_failures_in_row = 0
                continue
            rc = child.proc.poll()
            if rc is None:
                self._check_health(child, now)
                continue
            self._kill_group(child.proc.pid)
            reason = "unhealthy" if child.killed_unhealthy else "exited"
            child.killed_unhealthy = False
            failed = rc != 0 or reason != "exited"
            # an outage makes a role exit with an error status; a signal (SIGKILL, OOM) or a hang is its own
            excused = self._excuse_reason if now < self._excuse_until and rc > 0 and reason == "exited" else ""
            restartable = failed and child.spec.restart and rc not in child.spec.fatal_exit_codes
            restart = restartable and (bool(excused) or child.restarts < child.spec.max_restarts)
            if restart:
                if not excused:
                    child.restarts += 1
                child.restart_at = now + child.spec.restart_delay_seconds
            else:
                child.done = True
                excused = ""
            events.append(
                ChildExit(
                    name=name,
                    returncode=rc,
                    reason=reason,
                    restarted=restart,
                    restarts=child.restarts,
                    log_tail=tail_lines(child.log_path),
                    excused=excused,
                )
            )
        return events

    def excuse_exits(self, seconds: float, reason: str) -> None:
        """For the next ``seconds``, a restartable role's failure is restarted without counting
        against its ``max_restarts`` (``ChildExit.excused`` says why).

        For a dependency's outage (the controller restarting Redis): roles wait an outage out
        (:mod:`asyncrl.core.outage`), but one that fails during it anyway must not use up the restarts
        meant for its own crashes. Only an exit with an error status is excused: a death by a
        signal (SIGKILL, the OOM killer) or a hang is the role's own. Fatal exit codes stay fatal.
        """
        self._excuse_until = max(self._excuse_until, time.monotonic() + seconds)
        self._excuse_reason = reason

    def _check_health(self, child: _Child, now: float) -> None:
        spec = child.spec
        if spec.health_check is None or self.paused:
            return
        if now - child.last_health_check < spec.health_interval_seconds:
            return
        child.last_health_check = now
        if spec.health_check():
            child.healthy_once = True
            child.health_failures_in_row = 0
            return
        if not child.healthy_once:
            return  # still starting up; wait_healthy() bounds the start-up time
        child.health_failures_in_row += 1
        if child.health_failures_in_row >= spec.health_failures:
            child.killed_unhealthy = True
            self._kill_group(child.proc.pid)

    def wait_healthy(self, name: str, timeout_seconds: float, poll_seconds: float = 0.2) -> None:
        """Block until a role's health check passes.

        Raises:
            SupervisorError: the role exited first, or did not pass within the timeout (with the
                end of its log).
        """
        child = self._children[name]
        check = child.spec.health_check
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                raise SupervisorError(
                    f"role {name!r} exited with status {child.proc.returncode} while starting. "
                    f"Last log lines:\n{tail_lines(child.log_path)}"
                )
            if check is None or check():
                child.healthy_once = True
                return
            time.sleep(poll_seconds)
        raise SupervisorError(
            f"role {name!r} did not become healthy within {timeout_seconds:.0f}s. "
            f"Last log lines:\n{tail_lines(child.log_path)}"
        )

    # -- pause / stop --------------------------------------------------------------------------

    def _signal_group(self, pid: int, sig: int) -> None:
        try:
            os.killpg(pid, sig)  # start_new_session: the child's pid is its process group id
        except (ProcessLookupError, PermissionError):
            pass

    def _kill_group(self, pid: int) -> None:
        self._signal_group(pid, signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP every running role's process group (all its processes stop using CPU)."""
        for child in self._children.values():
            if not child.done and child.proc.poll() is None:
                self._signal_group(child.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT every role's process group after :meth:`pause`."""
        for child in self._children.values():
            if not child.done and child.proc.poll() is None:
                self._signal_group(child.proc.pid, signal.SIGCONT)
        self.paused = False

    def stop(self, names: list[str], grace_seconds: float | None = None) -> dict[str, int]:
        """Stop some roles together: SIGTERM, wait, SIGKILL the stragglers' process groups.

        Args:
            names: roles to stop (finished ones are skipped).
            grace_seconds: override of each role's ``stop_grace_seconds``.

        Returns:
            ``{name: returncode}`` of the roles stopped now.
        """
        live = [self._children[n] for n in names if not self._children[n].done]
        for child in live:
            child.restart_at = None
            if child.proc.poll() is None:
                self._signal_group(child.proc.pid, signal.SIGCONT)  # a paused child cannot drain
                try:
                    child.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = {
            id(c): time.monotonic() + (c.spec.stop_grace_seconds if grace_seconds is None else grace_seconds)
            for c in live
        }
        while any(c.proc.poll() is None and time.monotonic() < deadline[id(c)] for c in live):
            time.sleep(0.05)
        out = {}
        for child in live:
            if child.proc.poll() is None:
                self._kill_group(child.proc.pid)
                child.proc.wait()
            self._kill_group(child.proc.pid)  # leftovers of the group (engine subprocesses)
            child.done = True
            out[child.spec.name] = child.proc.returncode
        return out

    def stop_all(self, grace_seconds: float | None = None) -> dict[str, int]:
        """Stop every role, group by group in ascending ``stop_order``; returns exit statuses."""
        out: dict[str, int] = {}
        orders = sorted({c.spec.stop_order for c in self._children.values()})
        for order in orders:
            names = [n for n, c in self._children.items() if c.spec.stop_order == order]
            out.update(self.stop(names, grace_seconds))
        self.paused = False
        return out

    def kill_all(self) -> None:
        """SIGKILL every role's process group now (second Ctrl-C, or cleanup after an error)."""
        for child in self._children.values():
            if child.proc.poll() is None:
                self._kill_group(child.proc.pid)
                child.proc.wait()
            child.done = True
            child.restart_at = None

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()


def resume_roles(sup: Any, clock: Any, start_monotonic: float) -> float:
    """End an evaluation pause begun at ``start_monotonic`` (``time.monotonic()``, read before
    ``sup.pause()``): record it in the run clock, then SIGCONT every role.

    The order matters: the interval is in ``clock.json`` before any role runs again, so a
    trainer phase that spans the pause subtracts it (:class:`trainer.loop.PhaseTimer`) and
    every process's training wall clock leaves it out.

    Args:
        sup: the :class:`asyncrl.controller.supervisor.Supervisor` whose roles were paused, or None (nothing
            was running, e.g. the evaluation of the base model before training).
        clock: the run's :class:`asyncrl.metrics.tracking.RunClock`.
        start_monotonic: when the pause began.

    Returns:
        The pause's length in seconds.
    """
    end = time.monotonic()
    clock.add_pause(end - start_monotonic, start_monotonic, end)
    if sup is not None:
        sup.resume()
    return end - start_monotonic


def role_command(role: str, *args: str) -> list[str]:
    """``[python, -m, asyncrl.cli, role, *args]``: run an ``asyncrl`` subcommand with this interpreter."""
    return [sys.executable, "-m", "asyncrl.cli", role, *args]
