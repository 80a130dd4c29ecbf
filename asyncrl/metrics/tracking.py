"""Experiment tracking: metrics as JSONL (always), TensorBoard and Weights & Biases (when enabled).

Every role logs through :class:`MetricsLogger`. Each process writes its own file,
``<run_dir>/metrics-<role>.jsonl`` (``metrics-trainer.jsonl``, ``metrics-controller.jsonl``,
``metrics-rollout-0.jsonl``…), appending one JSON object per line with a single ``write``, so
no two processes ever share a file and a crash loses at most the line being written. A run
resumed with ``--resume`` appends to the same files.

Record format (one line)::

    {"step": 12, "wall_seconds": 314.2, "time_unix": 1763750000.1, "role": "trainer",
     "reward/mean": 0.41, "time/forward_backward_seconds": 3.2, ...}

``step`` is the trainer's optimizer step the record belongs to (the latest one for roles that
do not step), ``wall_seconds`` the run's *training* wall clock (see :class:`RunClock`: it
continues across ``--resume`` and excludes held-out evaluation pauses), ``time_unix`` the
host clock. Non-finite values are written as ``null``.

Metric naming scheme: ``<group>/<name>``, lower case, the unit as a suffix (``_seconds``,
``_tokens``, ``_bytes``, ``_per_second``; ratios in [0, 1] end in ``ratio`` or are named
``*_ratio``). Groups:

==================  ==========================================================================
``reward/``         ``mean``, ``std``, ``max``, ``min``, ``format_mean`` (train-batch rewards)
``eval/``           ``accuracy_sampled``, ``accuracy_greedy``, ``ci95_low``/``ci95_high``,
                    ``format_compliance``, ``num_problems``, ``eval_seconds``
``rollout/``        ``tokens_per_second`` (appended tokens per training wall second over whole
                    trainer steps, at least 60 s: generation is bursty), ``generated_tokens``,
                    ``samples_per_second``, ``response_len_mean_tokens``
``buffer/``         ``partial_ratio`` (partial samples / samples in flight), ``depth_<state>``
                    (prompt groups or samples by state), ``drops``, ``restarts``, ``fed_groups``,
                    ``appended_tokens`` (model tokens the rollout servers flushed, run total),
                    ``restart_discarded_tokens`` (of those, the ones restarts threw away)
``staleness/``      ``max``, ``mean`` (policy versions, of the train batch)
``policy/``         ``version`` (the version clock), ``lineage``
``time/``           phase timings: ``wait_batch_seconds``, ``forward_backward_seconds``,
                    ``optim_step_seconds``, ``publish_weights_seconds``, ``step_seconds``
                    (evaluation stops left out; ``eval_stopped_seconds``: how much was),
                    ``eval_seconds`` (cumulative evaluation time, excluded from wall time)
``idle_ratio/``     ``trainer``, ``rollout`` (fraction of wall time the role waited for work)
``cpu_share/``      ``<role>`` (trainer, rollout-0, ...: the role's CPU seconds per wall second over
                    all the run's cores, 0..1; logged by the controller, asyncrl/controller/cpu_share.py)
``train/``          ``loss``, ``grad_norm``, ``lr``, ``kl``, ``entropy``, ``clip_fraction``,
                    ``importance_weight_max``
``supervisor/``     ``restarts`` (role restarts so far)
==================  ==========================================================================

TensorBoard event files go to ``<run_dir>/tensorboard/<role>/``; W&B logs to one run per run
directory (its id is kept in ``<run_dir>/wandb_id`` so ``--resume`` continues it), in offline
mode unless ``WANDB_MODE`` says otherwise or an API key is configured. Under ``asyncrl train``
only the controller writes TensorBoard/W&B: it sets ``ASYNCRL_TRACKING_SINKS=jsonl`` for its
children and forwards their records (one W&B run, no duplicated series).

Simplified: no buffering or background thread; a record is written when logged.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "MetricsLogger",
    "MetricsTail",
    "RunClock",
    "TrackingError",
    "read_metrics",
    "metrics_files",
    "SINKS_ENV",
]

#: Environment variable restricting the sinks of a process, e.g. ``jsonl`` (comma-separated).
SINKS_ENV = "ASYNCRL_TRACKING_SINKS"
_RESERVED = ("step", "wall_seconds", "time_unix", "role")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)+$")
_ROLE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class TrackingError(ValueError):
    """Bad metric names or values, or an enabled sink whose package is missing."""


class RunClock:
    """The run's training wall clock, shared by every process of a run through ``clock.json``.

    ``wall_seconds() = now − start_unix − paused_seconds``, where the controller writes
    ``start_unix`` (shifted back by the wall time of earlier sessions on ``--resume``) and adds
    each evaluation pause to ``paused_seconds``. A process reads the file again when it changes.
    Without a ``clock.json`` (a role run on its own) the clock starts when it is created.

    Each pause is also kept as an interval of ``CLOCK_MONOTONIC`` seconds (``time.monotonic()``,
    one system-wide clock for every process of the machine): the controller records it after
    the evaluation and *before* it sends SIGCONT, so a process that was stopped reads it as soon
    as it runs again. :meth:`paused_between` gives the stopped share of any interval; the
    trainer's step timers subtract it (:class:`trainer.loop.PhaseTimer`). Why not a clock that
    stops with the process: Linux has none. ``CLOCK_MONOTONIC``/``CLOCK_BOOTTIME`` keep running
    during SIGSTOP, and process CPU time also leaves out every wait (a batch, Redis, a gloo
    collective) and adds up the CPU time of several threads, so it is not wall time; a watchdog
    thread that looks for gaps cannot tell a stop from a long GIL hold. The controller, which
    sends the signals, is the one that knows.
    """

    FILE = "clock.json"
    #: pause intervals kept in the file (older ones cannot overlap a running step)
    MAX_INTERVALS = 256

    def __init__(self, run_dir: Path | str) -> None:
        self.path = Path(run_dir) / self.FILE
        self._mtime_ns = -1
        self._start_unix = time.time()
        self._paused_seconds = 0.0
        self._intervals: list[tuple[float, float]] = []
        self._refresh()

    @classmethod
    def start(cls, run_dir: Path | str, previous_wall_seconds: float = 0.0) -> "RunClock":
        """Write a new clock for a (resumed) run whose earlier sessions used ``previous_wall_seconds``."""
        clock = cls.__new__(cls)
        clock.path = Path(run_dir) / cls.FILE
        clock._mtime_ns = -1
        clock._start_unix = time.time() - previous_wall_seconds
        clock._paused_seconds = 0.0
        clock._intervals = []
        clock._write()
        return clock

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"start_unix": self._start_unix, "paused_seconds": self._paused_seconds,
                                   "pause_intervals_monotonic": [list(iv) for iv in self._intervals]}))
        os.replace(tmp, self.path)

    def _refresh(self) -> None:
        try:
            st = self.path.stat()
        except OSError:
            return
        if st.st_mtime_ns == self._mtime_ns:
            return
        try:
            data = json.loads(self.path.read_text())
            self._start_unix = float(data["start_unix"])
            self._paused_seconds = float(data.get("paused_seconds", 0.0))
            self._intervals = [(float(a), float(b)) for a, b in data.get("pause_intervals_monotonic", [])]
            self._mtime_ns = st.st_mtime_ns
        except (OSError, ValueError, KeyError, TypeError):
            pass  # being replaced right now; keep the previous values

    def add_pause(self, seconds: float, start_monotonic: float | None = None,
                  end_monotonic: float | None = None) -> None:
        """Exclude ``seconds`` (an evaluation pause) from the wall clock of every process.

        Args:
            seconds: length of the pause (>= 0; negative values count as 0).
            start_monotonic, end_monotonic: the pause as ``time.monotonic()`` readings, kept
                for :meth:`paused_between` (both or neither).

        Raises:
            ValueError: only one bound given, or ``end_monotonic < start_monotonic``.
        """
        if (start_monotonic is None) != (end_monotonic is None):
            raise ValueError("add_pause needs both start_monotonic and end_monotonic, or neither")
        if start_monotonic is not None and end_monotonic < start_monotonic:
            raise ValueError(f"pause ends ({end_monotonic}) before it starts ({start_monotonic})")
        self._refresh()
        self._paused_seconds += max(0.0, float(seconds))
        if start_monotonic is not None:
            self._intervals = (self._intervals + [(float(start_monotonic), float(end_monotonic))])[-self.MAX_INTERVALS:]
        self._write()

    def paused_between(self, start_monotonic: float, end_monotonic: float) -> float:
        """Seconds of ``[start_monotonic, end_monotonic]`` (``time.monotonic()`` readings) that
        overlap a recorded pause: the time a role stopped for evaluation spent stopped in it."""
        self._refresh()
        total = 0.0
        for a, b in self._intervals:
            total += max(0.0, min(b, end_monotonic) - max(a, start_monotonic))
        return total

    @property
    def paused_seconds(self) -> float:
        """Seconds excluded so far in this session."""
        self._refresh()
        return self._paused_seconds

    def wall_seconds(self, now_unix: float | None = None) -> float:
        """Training wall seconds at ``now_unix`` (default: now)."""
        self._refresh()
        now = time.time() if now_unix is None else now_unix
        return max(0.0, now - self._start_unix - self._paused_seconds)


def _clean_value(name: str, value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        value = value.item()
    if not isinstance(value, (int, float)):
        raise TrackingError(f"metric {name!r} must be a number, got {type(value).__name__} {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def validate_metrics(metrics: dict[str, Any]) -> dict[str, float | int | None]:
    """Check names against the naming scheme and values are numbers; returns cleaned values.

    Raises:
        TrackingError: a name is reserved or not ``group/name``, or a value is not a number.
    """
    out: dict[str, float | int | None] = {}
    for name, value in metrics.items():
        if name in _RESERVED:
            raise TrackingError(f"metric name {name!r} is reserved (pass it as an argument of log())")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise TrackingError(
                f"metric name {name!r} must look like 'group/name' (e.g. 'reward/mean', 'time/step_seconds')"
            )
        out[name] = _clean_value(name, value)
    return out


class MetricsLogger:
    """Writes one role's metrics to JSONL, TensorBoard and W&B.

    Args:
        run_dir: the run directory (created).
        monitoring: the ``monitoring`` config section (``jsonl``, ``tensorboard``, ``wandb``);
            None: JSONL only.
        role: the writing role, file stem ``metrics-<role>.jsonl``.
        run_name: W&B run name (default: the run directory's name).
        config: the resolved config as a dict (stored in W&B).

    Raises:
        TrackingError: a bad role name, or TensorBoard/W&B enabled without its package
            (``pip install 'asyncrl[tracking]'``).
    """

    def __init__(
        self,
        run_dir: Path | str,
        monitoring: Any = None,
        role: str = "controller",
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        if not _ROLE_RE.match(role):
            raise TrackingError(f"role name {role!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.role = role
        self.clock = RunClock(self.run_dir)
        want = {
            "jsonl": True if monitoring is None else bool(monitoring.jsonl),
            "tensorboard": False if monitoring is None else bool(monitoring.tensorboard),
            "wandb": False if monitoring is None else bool(monitoring.wandb),
        }
        allowed = os.environ.get(SINKS_ENV)
        if allowed is not None:
            names = {s.strip() for s in allowed.split(",") if s.strip()}
            want = {k: v and k in names for k, v in want.items()}
        self.sinks = [k for k, v in want.items() if v]
        self.path = self.run_dir / f"metrics-{role}.jsonl"
        self._fd: int | None = None
        self._tb = None
        self._wandb_run = None
        try:
            if want["tensorboard"]:
                self._tb = self._open_tensorboard()
            if want["wandb"]:
                self._wandb_run = self._open_wandb(run_name or self.run_dir.name, config)
            if want["jsonl"]:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_role(cls, cfg: Any, default_role: str) -> "MetricsLogger":
        """The logger a role process opens: ``cfg.run.run_dir``, ``cfg.monitoring``, and the role
        name from ``ASYNCRL_ROLE`` (set by ``asyncrl train``'s supervisor: ``rollout-0``, ``trainer``)
        or ``default_role``."""
        return cls(cfg.run.run_dir, cfg.monitoring, role=os.environ.get("ASYNCRL_ROLE") or default_role,
                   run_name=cfg.run.name)

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TrackingError(
                "monitoring.tensorboard is on but the tensorboard package is missing: "
                "pip install 'asyncrl[tracking]' (or set monitoring.tensorboard false)"
            ) from exc
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard" / self.role))

    def _open_wandb(self, run_name: str, config: dict[str, Any] | None):
        try:
            import wandb
        except ImportError as exc:
            raise TrackingError(
                "monitoring.wandb is on but the wandb package is missing: "
                "pip install 'asyncrl[tracking]' (or set monitoring.wandb false)"
            ) from exc
        id_file = self.run_dir / "wandb_id"
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            import secrets

            run_id = secrets.token_hex(8)
            id_file.write_text(run_id)
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "asyncrl"),
            name=run_name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            mode=mode,
            config=config,
        )
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run

    def log(self, step: int, metrics: dict[str, Any], wall_seconds: float | None = None,
            role: str | None = None) -> dict[str, Any]:
        """Write one record to every enabled sink; returns the record.

        Args:
            step: the trainer optimizer step this record belongs to (int >= 0).
            metrics: flat ``group/name -> number`` (see the module docstring).
            wall_seconds: training wall seconds; None reads the run clock.
            role: the role the record describes (default: this logger's; the controller passes
                its children's roles when forwarding).

        Raises:
            TrackingError: a bad step, name or value; nothing is written then.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TrackingError(f"step must be an int >= 0, got {step!r}")
        values = validate_metrics(metrics)
        wall = self.clock.wall_seconds() if wall_seconds is None else float(wall_seconds)
        record: dict[str, Any] = {
            "step": step,
            "wall_seconds": round(wall, 3),
            "time_unix": round(time.time(), 3),
            "role": role or self.role,
            **values,
        }
        if self._fd is not None:
            os.write(self._fd, (json.dumps(record) + "\n").encode())
        self.forward(record, jsonl=False)
        return record

    def forward(self, record: dict[str, Any], jsonl: bool = False) -> None:
        """Send an existing record (e.g. read from a child's JSONL) to TensorBoard and W&B.

        The record is not written to this logger's JSONL unless ``jsonl`` is True: a child's
        record already is in its own role's file, and :func:`read_metrics` merges every file.
        """
        if jsonl and self._fd is not None:
            os.write(self._fd, (json.dumps(record) + "\n").encode())
        values = {k: v for k, v in record.items() if k not in _RESERVED and v is not None}
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, global_step=record["step"], walltime=record.get("time_unix"))
        if self._wandb_run is not None:
            self._wandb_run.log({**values, "step": record["step"], "wall_seconds": record["wall_seconds"]})

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def metrics_files(run_dir: Path | str) -> list[Path]:
    """The run's ``metrics-*.jsonl`` files (and a plain ``metrics.jsonl`` if present), sorted."""
    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("metrics-*.jsonl"))
    plain = run_dir / "metrics.jsonl"
    return ([plain] if plain.exists() else []) + files


def _parse_lines(text: str, path: Path, final: bool) -> list[dict[str, Any]]:
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if final and i == len(lines) - 1:
                break  # a line cut short by a crash
            raise TrackingError(f"{path}: line {i + 1} is not JSON ({exc.msg}); the file is corrupt") from None
        if not isinstance(rec, dict) or "step" not in rec or "wall_seconds" not in rec:
            raise TrackingError(f"{path}: line {i + 1} is not a metrics record (needs step and wall_seconds)")
        out.append(rec)
    return out


def read_metrics(run_dir: Path | str) -> list[dict[str, Any]]:
    """Every record of a run, all roles, sorted by ``wall_seconds`` (then step).

    A last line cut short by a crash is ignored.

    Raises:
        TrackingError: no metrics files in ``run_dir``, or a corrupt line elsewhere.
    """
    files = metrics_files(run_dir)
    if not files:
        raise TrackingError(f"no metrics-*.jsonl in {run_dir}: is it a run directory (monitoring.jsonl on)?")
    records: list[dict[str, Any]] = []
    for path in files:
        records += _parse_lines(path.read_text(errors="replace"), path, final=True)
    records.sort(key=lambda r: (r["wall_seconds"], r["step"]))
    return records


@dataclass
class MetricsTail:
    """Incremental reader of a run's metrics files (the controller's view of its children).

    :meth:`read_new` returns the complete lines appended since the previous call, across every
    ``metrics-*.jsonl`` (files that appear later are picked up). ``skip_roles`` are ignored
    (the controller's own file).
    """

    run_dir: Path
    skip_roles: Iterable[str] = ()
    _offsets: dict[Path, int] = field(default_factory=dict)

    def seek_to_end(self) -> None:
        """Ignore what the files hold now (on ``--resume``: earlier sessions were forwarded already)."""
        for path in metrics_files(self.run_dir):
            self._offsets[path] = path.stat().st_size

    def read_new(self) -> list[dict[str, Any]]:
        """New complete records since the last call, in file order per file."""
        skip = {f"metrics-{r}.jsonl" for r in self.skip_roles}
        out: list[dict[str, Any]] = []
        for path in metrics_files(self.run_dir):
            if path.name in skip:
                continue
            start = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            chunk = data[: end + 1].decode("utf-8", errors="replace")
            self._offsets[path] = start + end + 1
            out += _parse_lines(chunk, path, final=False)
        return out
