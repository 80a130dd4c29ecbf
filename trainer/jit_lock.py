"""Recover from a stale JIT-build lock that would otherwise hang the trainer forever.

On CPU, every DeepSpeed process group JIT-loads DeepSpeed's shared-memory collective op
(``deepspeed_shm_comm``) through ``torch.utils.cpp_extension.load``. Torch guards each build
directory with a ``FileBaton``: the first process creates ``<build dir>/lock``, runs ninja and
deletes the lock; every other process waits, polling, **with no timeout**, until the file is
gone. The lock carries no owner. A process killed while it holds the lock (Ctrl-C or SIGKILL
during a user's first ``asyncrl train``, a supervisor's restart, a test's timeout) leaves the
file behind, and from then on every trainer on the machine hangs silently at start-up. Torch
takes the baton on every load, also when the library is already built and ninja has nothing
to do, so a stale lock blocks even machines that built the op long ago (the
``pytorch/pytorch`` issue "cpp_extension.load hangs with a stale lock" is the same trap).

:func:`clear_stale_jit_lock` decides, before DeepSpeed is initialised, whether a lock is live:
a build in progress always has a ninja (or compiler) process whose working directory is the
build directory (torch runs ninja with ``cwd=build_directory``). A lock with no such process,
older than ``min_age_s`` (the short window in which the owner holds the lock before it starts
ninja or after ninja ends), is stale: it is removed and the removal is logged with its path. A
live build is left alone and torch's own wait does the rest.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

__all__ = ["extension_build_dir", "builders_in", "clear_stale_jit_lock"]

log = logging.getLogger(__name__)


def extension_build_dir(name: str) -> Path:
    """The directory torch builds the JIT extension ``name`` in.

    ``$TORCH_EXTENSIONS_DIR/<name>`` when set, else torch's default root
    (``~/.cache/torch_extensions/py<major><minor>_<cpu|cu…>/<name>``), as
    ``torch.utils.cpp_extension.load`` computes it.
    """
    from torch.utils import cpp_extension

    getter = getattr(cpp_extension, "_get_build_directory", None)
    if getter is not None:
        return Path(getter(name, False))
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / name


def builders_in(build_dir: Path) -> list[int]:
    """PIDs of the processes whose working directory is ``build_dir`` (a live ninja build).

    Processes that cannot be inspected (another user's, or gone meanwhile) are skipped.
    """
    import psutil

    target = os.path.realpath(build_dir)
    pids = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.path.realpath(proc.cwd()) == target:
                pids.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return pids


def clear_stale_jit_lock(name: str, *, min_age_s: float = 20.0, poll_s: float = 1.0,
                         build_dir: Path | None = None) -> bool:
    """Remove ``<build dir of name>/lock`` if no build holds it; wait out a young lock first.

    Args:
        name: the JIT extension's name (``deepspeed_shm_comm``).
        min_age_s: a lock younger than this (seconds, by its mtime) may belong to a process that
            has taken it and not yet started ninja; it is re-checked until it is this old, so the
            call can wait up to ``min_age_s``.
        poll_s: seconds between re-checks.
        build_dir: the build directory (default :func:`extension_build_dir`).

    Returns:
        True when a stale lock was removed, False when there was none, it went away by itself,
        or a live build holds it (then torch waits for that build).
    """
    lock = (build_dir or extension_build_dir(name)) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return False
        if builders_in(lock.parent):
            log.info("JIT build of %s in progress (lock %s); waiting for it", name, lock)
            return False
        if age >= min_age_s:
            try:
                lock.unlink()
            except FileNotFoundError:
                return False
            log.warning("removed a stale JIT-build lock %s (%.0f s old, no build running): a build "
                        "of %s was interrupted earlier; torch would have waited for it forever",
                        lock, age, name)
            return True
        time.sleep(min(poll_s, max(0.05, min_age_s - age)))
