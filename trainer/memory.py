"""The trainer process's heap: give the memory of freed activations back to the system.

On CPU, torch's tensors come from glibc's ``malloc``. A training step allocates and frees
gigabytes of activations (about 2 MB per processed token for SmolLM2-135M fp32: everything the
forward pass saves for backward, bench/trainer_memory.py). glibc serves a block of at least
``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and unmaps it on ``free``; smaller blocks come
from the heap, whose free space glibc keeps for reuse instead of returning it. The threshold is
dynamic by default: each time a mapped block is freed, it rises to that block's size, up to 32 MiB
on 64-bit (mallopt(3), ``M_MMAP_THRESHOLD``). After the first step nearly every activation (a few
MB each) is therefore a heap block, and the heap keeps the step's high-water mark, fragmented,
for the rest of the run: with LoRA on the main job, 3.9 GB held free against 0.3 GB in use between
steps (docs/trainer.md#lora). Fixing the threshold (any ``mallopt`` of it turns the dynamic
adjustment off) makes every block at or above it a mapping of its own, unmapped when the tensor
dies.

:func:`fix_mmap_threshold` does that (a no-op returning False where the C library is not glibc:
musl, macOS); :func:`malloc_stats` reads glibc's accounting. ``malloc_trim(0)`` once per step
would also return the free heap, but not the fragmentation inside a step (the LoRA step's peak
held 1.5 GB free during its forward pass).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

__all__ = ["fix_mmap_threshold", "malloc_stats", "MallocStats", "reset_peak_resident", "resident_memory"]

log = logging.getLogger("asyncrl.trainer")

#: mallopt(3)'s parameter number of ``M_MMAP_THRESHOLD`` (glibc's malloc.h).
M_MMAP_THRESHOLD = -3
#: The largest threshold glibc accepts on 64-bit (``HEAP_MAX_SIZE / 2``, 32 MiB).
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024


class MallocStats(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (mallinfo(3)), all fields in bytes or counts (``size_t``).

    ``uordblks``: bytes in use in the heaps; ``fordblks``: bytes free in the heaps (held by
    malloc); ``hblkhd``: bytes in mmapped blocks; ``hblks``: their number.
    """

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    """The process's glibc, or None on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("mallopt", "mallinfo2", "gnu_get_libc_version")):
        return None
    libc.mallinfo2.restype = MallocStats
    return libc


def fix_mmap_threshold(threshold_bytes: int) -> bool:
    """Serve every ``malloc`` of ``threshold_bytes`` or more with its own mapping, for the rest of the process.

    Args:
        threshold_bytes: the fixed ``M_MMAP_THRESHOLD``, 4 KiB to 32 MiB (glibc's range on
            64-bit). For ``trainer.heap_mmap_threshold_bytes`` (off by default) 1 MiB is
            suggested: an activation row of 1,000 tokens x 576 fp32 features is 2.3 MB.

    Returns:
        True when glibc took the setting; False on another C library (nothing changed).

    Raises:
        ValueError: ``threshold_bytes`` outside [4096, 32 MiB].
    """
    if not 4096 <= threshold_bytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"the mmap threshold must be 4096..{MAX_MMAP_THRESHOLD} bytes (mallopt(3)), "
                         f"got {threshold_bytes}")
    libc = _glibc()
    if libc is None:
        log.info("not glibc: the trainer's freed activations stay with the C library's allocator")
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)))


def malloc_stats() -> MallocStats | None:
    """glibc's ``mallinfo2()`` summed over all arenas; None on another C library."""
    libc = _glibc()
    return libc.mallinfo2() if libc is not None else None


def _status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (proc(5)), or None where there is no procfs."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak_resident() -> bool:
    """Reset the process's peak resident memory (``VmHWM``) to its current resident memory.

    Writes ``5`` to ``/proc/self/clear_refs`` (proc(5), Linux >= 4.0), so that
    :func:`resident_memory`'s peak is the peak since this call: the trainer loop calls it at the
    start of every step, making ``memory_peak_resident_gb`` the step's own peak.

    Returns:
        True when the kernel took it; False where it cannot (no procfs, not Linux): the peak is
        then the peak since the process started.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def resident_memory() -> tuple[float, float] | None:
    """The process's resident memory now and its peak, in GB (10^9 bytes).

    Returns:
        ``(resident_gb, peak_resident_gb)`` from ``VmRSS`` and ``VmHWM`` of ``/proc/self/status``
        (the peak since the process started or since :func:`reset_peak_resident`); None where
        there is no procfs (not Linux).

    What the kernel's OOM killer weighs is this resident memory (docs/trainer.md, "Memory"): on the
    24 GB machine a trainer at 15.9 GB was killed during a step of long answers (docs/results.md,
    section P).
    """
    rss, hwm = _status_kib("VmRSS"), _status_kib("VmHWM")
    if rss is None or hwm is None:
        return None
    return rss * 1024 / 1e9, hwm * 1024 / 1e9
