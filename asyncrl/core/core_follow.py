"""Cores that follow the work: a rollout server takes the trainer's cores while the trainer waits.

One job: the ``resources.core_sharing: follow`` handshake between the trainer and the rollout
servers of one machine. Every role may run on every core; each starts with the torch threads
of its half of the machine (as ``split``). While the trainer waits for a batch it holds an idle
flag — a file that exists only then (:class:`IdleFlag`); each rollout server's engine checks the
file between engine steps (one ``stat`` call) and runs with all its wide threads while it
exists, its own threads otherwise (:class:`ThreadFollower`). The thread count changes between
steps, never inside one, so an OpenMP team is never resized mid-operation.

The file is the whole protocol: the controller places it in ``<run_dir>/cores/`` and passes its
path in the environment (:data:`FLAG_ENV`, :data:`WIDE_ENV`); a trainer killed while waiting
leaves the file behind, and the next trainer removes it when it starts (:meth:`IdleFlag.clear`).
A rollout server that widens late or narrows one step late costs at most one engine step with
more threads than cores. Measured in docs/concepts.md#cores-that-follow-the-work.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["FLAG_ENV", "WIDE_ENV", "IdleFlag", "ThreadFollower", "follower_from_env", "idle_flag_from_env"]

#: Environment variable naming the trainer's idle-flag file (set on the trainer and rollout servers).
FLAG_ENV = "ASYNCRL_FOLLOW_IDLE_FLAG"
#: Environment variable with the rollout server's torch threads while the trainer waits.
WIDE_ENV = "ASYNCRL_FOLLOW_WIDE_THREADS"


class IdleFlag:
    """The trainer's side: a file that exists while the trainer waits for a batch.

    Args:
        path: the flag file; its folder is created. Creating and removing it are atomic on
            POSIX file systems, so a reader sees it either present or absent.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def set(self, idle: bool) -> None:
        """Create the file (``idle``) or remove it; errors of the file system are not raised
        (a missed handshake only costs speed, never a step)."""
        with contextlib.suppress(OSError):
            if idle:
                self.path.touch()
            else:
                self.path.unlink(missing_ok=True)

    def clear(self) -> None:
        """Remove a flag a previous, killed trainer left behind."""
        self.set(False)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Hold the flag for the duration of the block (the trainer's ``wait_batch`` phase)."""
        self.set(True)
        try:
            yield
        finally:
            self.set(False)


class ThreadFollower:
    """The rollout engine's side: torch threads that follow the trainer's idle flag.

    Args:
        flag: the trainer's idle-flag file.
        own_threads: threads while the trainer works (the server's half of the cores), ≥ 1.
        wide_threads: threads while the trainer waits (every core the roles share), ≥ own_threads.
        set_threads: the setter, ``torch.set_num_threads`` (called from the engine thread).

    Raises:
        ValueError: thread counts below 1, or ``wide_threads < own_threads``.
    """

    def __init__(self, flag: str | os.PathLike[str], own_threads: int, wide_threads: int,
                 set_threads: Callable[[int], None]):
        if own_threads < 1 or wide_threads < own_threads:
            raise ValueError(f"follow threads: own {own_threads} must be >= 1 and <= wide {wide_threads}")
        self.flag = str(flag)
        self.own_threads = int(own_threads)
        self.wide_threads = int(wide_threads)
        self._set = set_threads
        self.threads = self.own_threads
        #: how many times the thread count changed (``engine.stats["follow_switches_total"]``)
        self.switches = 0

    def poll(self) -> int:
        """Check the flag once and change the thread count if it should; returns the count in use."""
        want = self.wide_threads if os.path.exists(self.flag) else self.own_threads
        if want != self.threads:
            self._set(want)
            self.threads = want
            self.switches += 1
        return self.threads


def idle_flag_from_env(environ: dict[str, str] | None = None) -> IdleFlag | None:
    """The trainer's :class:`IdleFlag` when the controller asked for it (:data:`FLAG_ENV`), else None."""
    env = os.environ if environ is None else environ
    path = env.get(FLAG_ENV)
    return IdleFlag(path) if path else None


def follower_from_env(own_threads: int | None, set_threads: Callable[[int], None],
                      environ: dict[str, str] | None = None) -> ThreadFollower | None:
    """The engine's :class:`ThreadFollower` when :data:`FLAG_ENV` and :data:`WIDE_ENV` are set, else None.

    Raises:
        ValueError: :data:`WIDE_ENV` is not a whole number, or the counts are inconsistent.
    """
    env = os.environ if environ is None else environ
    path, wide = env.get(FLAG_ENV), env.get(WIDE_ENV)
    if not path or not wide:
        return None
    try:
        wide_n = int(wide)
    except ValueError:
        raise ValueError(f"{WIDE_ENV}={wide!r} must be a whole number of threads") from None
    return ThreadFollower(path, int(own_threads or 1), wide_n, set_threads)
