"""Live progress display of ``asyncrl train``: one rich panel, or plain lines without a terminal.

The display is fed the same metrics records every role writes (see :mod:`asyncrl.metrics.tracking`):
the controller passes each record it reads or logs to :meth:`Progress.update`, which keeps the
latest value of every metric (per role for idle ratios), and calls :meth:`Progress.refresh`
from its loop. Nothing runs in a background thread (rich's ``Live`` with ``auto_refresh``
off), so the controller's child processes are always forked from a single-threaded parent.

Shown: step / total, policy version (and lineage), train reward, held-out accuracy, rollout
tokens/s, partial ratio, staleness (max of the last batch and the bound), buffer depth by group
state and sample state, the trainer's phase timings, each role's idle ratio, drops/restarts,
and role restarts. When stdout is not a terminal (CI, ``nohup``, a pipe) a plain one-line
summary is printed when the step advances (at most every ``plain_interval_seconds``) or an
evaluation result arrives.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["Progress"]

_PHASES = ("wait_batch", "forward_backward", "optim_step", "publish_weights", "step")


def _f(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


class Progress:
    """Latest-value view of a run's metrics, rendered live or as plain lines.

    Args:
        total_steps: the run's ``run.total_steps``.
        run_name: shown in the title.
        max_staleness: the bound η shown next to the staleness.
        stream: where to draw (default: stdout).
        live: force live (True) or plain (False); None: live iff ``stream`` is a terminal.
        plain_interval_seconds: minimum seconds between two plain lines for step changes.
    """

    def __init__(
        self,
        total_steps: int,
        run_name: str = "asyncrl",
        max_staleness: int | None = None,
        stream: TextIO | None = None,
        live: bool | None = None,
        plain_interval_seconds: float = 5.0,
    ) -> None:
        from rich.console import Console

        self.total_steps = total_steps
        self.run_name = run_name
        self.max_staleness = max_staleness
        self.stream = stream or sys.stdout
        self.console = Console(file=self.stream)
        self.live_mode = self.console.is_terminal if live is None else live
        self.plain_interval_seconds = plain_interval_seconds
        self.values: dict[str, Any] = {}
        self.idle: dict[str, float] = {}
        self.step = 0
        self.wall_seconds = 0.0
        self.status = "starting"
        self._live = None
        self._last_plain = float("-inf")
        self._plain_step = -1
        self._eval_pending = False
        self._stopped = False

    # -- feeding -------------------------------------------------------------------------------

    def update(self, record: dict[str, Any]) -> None:
        """Merge one metrics record (``step``, ``wall_seconds``, ``role`` and ``group/name`` keys)."""
        self.step = max(self.step, int(record.get("step", 0)))
        self.wall_seconds = max(self.wall_seconds, float(record.get("wall_seconds", 0.0)))
        for key, value in record.items():
            if "/" not in key or value is None:
                continue
            if key.startswith("idle_ratio/"):
                self.idle[key.split("/", 1)[1]] = float(value)
            else:
                self.values[key] = value
            if key == "eval/accuracy_sampled":
                self._eval_pending = True

    def set_status(self, status: str) -> None:
        """A short phase word shown in the title (``starting``, ``training``, ``evaluating``, ``stopping``)."""
        self.status = status

    # -- rendering -----------------------------------------------------------------------------

    def _by_prefix(self, prefix: str) -> dict[str, Any]:
        return {k[len(prefix):]: v for k, v in sorted(self.values.items()) if k.startswith(prefix)}

    def render(self):
        """The rich renderable (a panel holding a two-column grid)."""
        from rich.panel import Panel
        from rich.table import Table

        v = self.values
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", justify="right")
        grid.add_column()
        grid.add_row("step", f"{self.step}/{self.total_steps}   wall {self.wall_seconds / 60:.1f} min "
                              f"(eval excluded; eval {_f((v.get('time/eval_seconds') or 0) / 60, '.1f')} min)")
        grid.add_row("policy version", f"{_f(v.get('policy/version'))}   lineage {_f(v.get('policy/lineage'))}")
        grid.add_row("reward", f"mean {_f(v.get('reward/mean'))}   std {_f(v.get('reward/std'))}")
        grid.add_row("held-out accuracy", f"sampled {_f(v.get('eval/accuracy_sampled'))}   "
                                          f"greedy {_f(v.get('eval/accuracy_greedy'))}   "
                                          f"(n={_f(v.get('eval/num_problems'))})")
        grid.add_row("rollout", f"{_f(v.get('rollout/tokens_per_second'), '.1f')} tokens/s   "
                                f"partial ratio {_f(v.get('buffer/partial_ratio'), '.2f')}")
        grid.add_row("staleness", f"max {_f(v.get('staleness/max'))}   mean {_f(v.get('staleness/mean'))}   "
                                  f"bound {_f(self.max_staleness)}")
        groups = self._by_prefix("buffer/groups_")
        samples = self._by_prefix("buffer/samples_")
        grid.add_row("groups by state", "  ".join(f"{k} {n}" for k, n in groups.items()) or "—")
        grid.add_row("samples by state", "  ".join(f"{k} {n}" for k, n in samples.items()) or "—")
        phases = [(p, v.get(f"time/{p}_seconds")) for p in _PHASES]
        grid.add_row("trainer phases (s)", "  ".join(f"{p} {_f(t, '.2f')}" for p, t in phases if t is not None) or "—")
        grid.add_row("idle ratio", "  ".join(f"{r} {x:.2f}" for r, x in sorted(self.idle.items())) or "—")
        grid.add_row("drops / restarts", f"{_f(v.get('buffer/drops'))} / {_f(v.get('buffer/restarts'))}   "
                                         f"role restarts {_f(v.get('supervisor/restarts'))}")
        return Panel(grid, title=f"asyncrl train · {self.run_name} · {self.status}", expand=False)

    def plain_line(self) -> str:
        """The one-line summary used without a terminal."""
        v = self.values
        idle = " ".join(f"{r}={x:.2f}" for r, x in sorted(self.idle.items()))
        groups = " ".join(f"{k}={n}" for k, n in self._by_prefix("buffer/groups_").items())
        return (
            f"[{self.status}] step {self.step}/{self.total_steps} wall {self.wall_seconds:.0f}s "
            f"v{_f(v.get('policy/version'))} reward {_f(v.get('reward/mean'))} "
            f"acc {_f(v.get('eval/accuracy_sampled'))} tok/s {_f(v.get('rollout/tokens_per_second'), '.1f')} "
            f"partial {_f(v.get('buffer/partial_ratio'), '.2f')} stale {_f(v.get('staleness/max'))}"
            f"/{_f(self.max_staleness)} groups[{groups}] idle[{idle}]"
        )

    def refresh(self, force: bool = False) -> None:
        """Redraw the live panel, or print a plain line when it is due (or ``force``)."""
        if self.live_mode:
            if self._live is not None:
                self._live.update(self.render(), refresh=True)
            return
        now = time.monotonic()
        due = self.step != self._plain_step and now - self._last_plain >= self.plain_interval_seconds
        if force or due or self._eval_pending:
            print(self.plain_line(), file=self.stream, flush=True)
            self._last_plain, self._plain_step, self._eval_pending = now, self.step, False

    def start(self) -> "Progress":
        """Begin the live display (no-op in plain mode)."""
        if self.live_mode and self._live is None:
            from rich.live import Live

            self._live = Live(self.render(), console=self.console, auto_refresh=False, transient=False)
            self._live.start()
        return self

    def stop(self) -> None:
        """Draw the final state and end the live display (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        if self._live is not None:
            self._live.update(self.render(), refresh=True)
            self._live.stop()
            self._live = None
        else:
            self.refresh(force=True)

    def __enter__(self) -> "Progress":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
