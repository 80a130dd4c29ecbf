"""Each role's share of the machine's CPU over time (the ``cpu_share/<role>`` metrics).

The controller samples, every stats interval, the CPU time (user + system, in seconds) of each
supervised role: its process and every live descendant (torchrun's ranks, engine helper
processes). A role's share over an interval is

    cpu_share = Δ cpu seconds / (Δ wall seconds · cores available to the run)

so 1.0 means the role kept every core of the run busy and the roles' shares sum to at most 1
(plus the controller's own few percent, not counted). ``asyncrl report`` plots the series next
to the idle ratios: together they show whether an idle role gives its cores to the busy one
(``resources.core_sharing``, docs/concepts.md). CPU times come from psutil (``/proc`` on Linux).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import psutil


def _tree_cpu_seconds(pid: int) -> float | None:
    """Sum of user + system CPU seconds of ``pid`` and its live descendants, in seconds.

    A descendant that exits between two samples takes its last interval's time with it, which
    undercounts that interval only (and a negative difference is read as 0). Returns None when
    ``pid`` itself is gone.
    """
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system
    return total


class CpuShareSampler:
    """Per-role CPU share between consecutive :meth:`sample` calls.

    Args:
        num_cores: cores available to the run (default: this process's affinity); the share's
            denominator. Must be ≥ 1.

    Raises:
        ValueError: ``num_cores`` < 1.
    """

    def __init__(self, num_cores: int | None = None):
        n = num_cores if num_cores is not None else len(os.sched_getaffinity(0))
        if n < 1:
            raise ValueError(f"num_cores must be >= 1, got {n}")
        self.num_cores = n
        self._last: dict[str, tuple[int, float, float]] = {}  # role -> (pid, cpu seconds, monotonic time)

    def sample(self, pids: Mapping[str, int | None], now: float | None = None) -> dict[str, float]:
        """``{"cpu_share/<role>": share}`` for every role sampled before under the same pid.

        Args:
            pids: role name → current pid (None: not running; dropped from the output).
            now: ``time.monotonic()`` of the sample (default: read here).

        Returns:
            Shares in [0, 1] (clamped: CPU accounting ticks may overshoot by a tick). A role seen
            for the first time, or restarted under a new pid, gets its baseline now and a value
            from the next sample on.
        """
        now = time.monotonic() if now is None else now
        out: dict[str, float] = {}
        for role, pid in pids.items():
            if pid is None:
                self._last.pop(role, None)
                continue
            total = _tree_cpu_seconds(pid)
            if total is None:
                self._last.pop(role, None)
                continue
            prev = self._last.get(role)
            self._last[role] = (pid, total, now)
            if prev is None or prev[0] != pid or now <= prev[2]:
                continue
            share = max(0.0, total - prev[1]) / ((now - prev[2]) * self.num_cores)
            out[f"cpu_share/{role}"] = min(1.0, share)
        return out
