"""What the controller of ``asyncrl train`` watches while the roles run, and what it exports.

One job: turn the run's raw signals into metrics. The trainer's step records
(:func:`normalize_trainer_record`, :class:`TrainerTail`), the buffer's statistics
(:class:`BufferWatcher`, with rollout tokens/s over whole trainer steps, :class:`RateWindow`),
each rollout server's ``/metrics`` (:class:`RolloutScraper`), the books of the buffer
(:func:`reconcile_groups`: every fed group trained, live or dropped) and the controller's own
Prometheus endpoint (:class:`PrometheusExport`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

__all__ = [
    "BufferWatcher",
    "PrometheusExport",
    "RateWindow",
    "RolloutScraper",
    "TrainerTail",
    "normalize_trainer_record",
    "parse_prometheus_totals",
    "reconcile_groups",
]


# ----------------------------------------------------------------------------------------------
# the trainer's step records -> the metric naming scheme of asyncrl.metrics.tracking

_PHASES = ("wait_batch", "forward_backward", "optim_step", "publish_weights", "checkpoint")


def normalize_trainer_record(rec: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """Map a trainer step record (``trainer.loop``'s flat keys) to ``group/name`` metrics.

    ``reward_*`` → ``reward/*``, ``staleness_*`` → ``staleness/*``, ``*_seconds`` →
    ``time/*_seconds``, ``version`` → ``policy/version``, the rest → ``train/*``; adds
    ``time/step_seconds`` (sum of the phases), ``idle_ratio/trainer`` (``wait_batch`` share of
    the step) and ``train/tokens_per_second`` (processed tokens per busy second).

    Returns:
        ``(step, metrics)``.
    """
    step = int(rec.get("step", 0))
    out: dict[str, float] = {}
    for key, value in rec.items():
        if key == "step" or "/" in key or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith("reward_"):
            out["reward/" + key[len("reward_"):]] = value
        elif key.startswith("staleness_"):
            out["staleness/" + key[len("staleness_"):]] = value
        elif key.endswith("_seconds"):
            out["time/" + key] = value
        elif key == "version":
            out["policy/version"] = value
        else:
            out["train/" + key] = value
    phases = [float(rec[f"{p}_seconds"]) for p in _PHASES if isinstance(rec.get(f"{p}_seconds"), (int, float))]
    if phases:
        total = sum(phases)
        out["time/step_seconds"] = total
        wait = float(rec.get("wait_batch_seconds", 0.0))
        if total > 0:
            out["idle_ratio/trainer"] = wait / total
            busy = total - wait
            if busy > 0 and isinstance(rec.get("processed_tokens"), (int, float)):
                out["train/tokens_per_second"] = float(rec["processed_tokens"]) / busy
    return step, out


class TrainerTail:
    """Reads ``<run_dir>/metrics/*.jsonl`` (the trainer's step records) incrementally.

    What has been read survives the controller: :meth:`save` records the byte offsets in
    ``<run_dir>/metrics/tail.json`` (the controller calls it right after forwarding what
    :meth:`read_new` returned), and a resumed controller's :meth:`resume` continues from there, so
    the records a trainer wrote between the old controller's last read and its death are
    forwarded by the new one instead of being skipped. A kill between forwarding and saving
    forwards that one read's records twice; nothing is lost.
    """

    STATE = "tail.json"

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "metrics"
        self.offsets: dict[Path, int] = {}

    def skip_existing(self) -> int:
        """Start at the end of every file; returns the highest step among the skipped records (0 if none)."""
        top = 0
        for path in sorted(self.dir.glob("*.jsonl")) if self.dir.exists() else []:
            self.offsets[path] = path.stat().st_size
            top = max(top, _max_step(path, self.offsets[path]))
        return top

    def resume(self) -> int:
        """Continue where the previous controller's last :meth:`save` left off (files it never
        saw: from their end, as :meth:`skip_existing`); returns the highest step among the records
        before the new offsets (the resumed controller's starting step)."""
        top = self.skip_existing()
        try:
            saved = json.loads((self.dir / self.STATE).read_text())
        except (OSError, ValueError):
            return top
        for path in list(self.offsets):
            off = saved.get(path.name) if isinstance(saved, dict) else None
            if isinstance(off, int) and 0 <= off <= self.offsets[path]:
                self.offsets[path] = off
        return top

    def save(self) -> None:
        """Record the offsets read so far (atomically: a temporary file renamed over the old one)."""
        if not self.dir.exists():
            return
        tmp = self.dir / (self.STATE + ".tmp")
        tmp.write_text(json.dumps({p.name: off for p, off in self.offsets.items()}))
        os.replace(tmp, self.dir / self.STATE)

    def read_new(self) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if not self.dir.exists():
            return out
        for path in sorted(self.dir.glob("*.jsonl")):
            start = self.offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self.offsets[path] = start + end + 1
            for line in data[: end + 1].decode("utf-8", errors="replace").splitlines():
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and "role" not in rec:
                    out.append((path.stem, rec))
        return out


def _max_step(path: Path, limit: int) -> int:
    """The highest integer ``step`` among the first ``limit`` bytes' complete JSON lines of ``path``."""
    top = 0
    with open(path, "rb") as f:
        data = f.read(limit)
    for line in data.splitlines():
        try:
            rec = json.loads(line)
            step = int(rec["step"]) if isinstance(rec, dict) and "role" not in rec else 0
        except (ValueError, KeyError, TypeError):
            continue
        top = max(top, step)
    return top


# ----------------------------------------------------------------------------------------------
# buffer observation


def reconcile_groups(stats: dict[str, Any]) -> tuple[bool, str]:
    """Check that every prompt group fed to the buffer is accounted for (no sample lost).

    ``fed = trained + in the buffer + dropped``: ``fed`` is the feeder's dataset cursor (one
    group per prompt) less the prompts skipped by the pass-rate filter or selective rollout (``skipped_prompts:*``),
    ``trained`` the groups acknowledged by the trainer and committed by a
    checkpoint (deleted from Redis then), ``in the buffer`` every live group by state (pending,
    generating, ready, batched, acked-not-yet-committed), ``dropped`` the groups dropped with a
    reason. A crash rewind replays uncommitted groups; they stay live, so the identity holds
    across restarts too.

    Args:
        stats: :meth:`buffers.ReplayBuffer.stats` output.

    Returns:
        ``(ok, text)``: whether the identity holds, and the numbers as one line.
    """
    counters = stats.get("counters", {})
    cursor = int(stats.get("dataset_cursor", 0))
    skipped = sum(int(v) for k, v in counters.items() if k.startswith("skipped_prompts:"))
    fed = cursor - skipped
    trained = int(counters.get("committed_groups", 0))
    by_state = {k: int(v) for k, v in stats.get("groups_by_state", {}).items() if int(v)}
    live = sum(by_state.values())
    dropped = sum(int(v) for v in stats.get("dropped_by_reason", {}).values())
    ok = fed == trained + live + dropped
    text = (f"fed {fed} {'=' if ok else '!='} trained and committed {trained} + in the buffer {live} {by_state} "
            f"+ dropped {dropped}")
    if skipped:
        names = {"pass_rate_filter": "by the pass-rate filter",
                 "zero_variance_predicted": "by selective rollout (predicted zero variance)"}
        parts = [f"{names.get(k.split(':', 1)[1], 'for ' + k.split(':', 1)[1])} {int(v)}"
                 for k, v in sorted(counters.items()) if k.startswith("skipped_prompts:") and int(v)]
        text += f"; dataset cursor {cursor} = fed {fed} + prompts skipped " + " + ".join(parts)
    if int(counters.get("discarded_best_of_n", 0)):
        text += f"; best-of-n discarded {int(counters['discarded_best_of_n'])} samples of trained groups"
    return ok, text


class RateWindow:
    """Rate of a growing counter over a window that spans whole trainer steps.

    Rollout generation is bursty: the engine generates right after a weight update and then
    waits while the staleness bound blocks it, for most of a trainer step (35-90 s in the main
    job). A fixed 10-second window read 0 most of the time, and always at the moment a step
    ends, when the progress line prints (the burst comes after the publish). Here the window
    starts where a trainer step started (the first observation of that step), at the newest
    such point that is at least ``min_seconds`` old and ``min_steps`` steps back; so it holds
    whole generate-then-wait cycles and reads the throughput the trainer is fed. Before such a
    point exists it starts at the first observation; a point ``max_seconds`` old is always
    enough (a stalled trainer does not stretch the window forever).

    Args:
        min_seconds, min_steps, max_seconds: see above (seconds of whatever clock ``add`` gets).

    Raises:
        ValueError: ``min_seconds`` or ``max_seconds`` not positive, ``min_steps < 0``, or
            ``max_seconds < min_seconds``.
    """

    def __init__(self, min_seconds: float = 60.0, min_steps: int = 1, max_seconds: float = 600.0) -> None:
        if min_seconds <= 0 or max_seconds < min_seconds or min_steps < 0:
            raise ValueError(f"need 0 < min_seconds <= max_seconds and min_steps >= 0 "
                             f"(got {min_seconds}, {max_seconds}, {min_steps})")
        self.min_seconds, self.min_steps, self.max_seconds = min_seconds, min_steps, max_seconds
        self.points: deque[tuple[float, float, int]] = deque()

    def clear(self) -> None:
        """Forget every observation (e.g. after a pause the clock did not leave out)."""
        self.points.clear()

    def add(self, t_seconds: float, value: float, step: int) -> float | None:
        """Record ``value`` (a counter) at time ``t_seconds`` and trainer step ``step``.

        Returns:
            ``Δvalue / Δt`` over the window (clamped at 0: a counter that went back, e.g. a
            restarted server, reads 0 until the window has passed the restart), or None with
            fewer than two observations at distinct times.
        """
        pts = self.points
        pts.append((float(t_seconds), float(value), int(step)))
        base = 0
        for i in range(len(pts) - 1, 0, -1):
            t, _, s = pts[i]
            age = t_seconds - t
            starts_step = pts[i - 1][2] != s
            if (starts_step and age >= self.min_seconds and step - s >= self.min_steps) or age >= self.max_seconds:
                base = i
                break
        for _ in range(base):
            pts.popleft()
        t0, v0, _ = pts[0]
        if t_seconds <= t0:
            return None
        return max(0.0, value - v0) / (t_seconds - t0)


class BufferWatcher:
    """Turns ``ReplayBuffer.stats()`` into controller metrics; tracks multi-version samples.

    A sample is *multi-version* when its tokens were produced under two or more policy
    versions: it was parked (budget or abort) and resumed after a weight update. The watcher
    inspects each group once it is READY or BATCHED (group ids are the feeder's ``p<cursor>``).
    """

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.tokens_window = RateWindow()
        self.inspected: set[str] = set()
        self.next_unfinished = 0
        self.multi_version_samples = 0
        self.resumed_samples = 0
        self.last_stats: dict[str, Any] = {}
        self.states_seen: dict[str, set[str]] = {"groups": set(), "samples": set()}

    async def _inspect_groups(self, cursor: int) -> None:
        from asyncrl.feeder.feeder import group_id_for
        from buffers.errors import UnknownItem

        first_open: int | None = None
        for c in range(self.next_unfinished, cursor):
            gid = group_id_for(c)
            if gid in self.inspected:
                continue
            try:
                group, samples = await self.buf.get_group(gid)
            except UnknownItem:
                self.inspected.add(gid)  # committed and deleted before we looked
                continue
            if str(getattr(group.state, "value", group.state)) in ("ready", "batched", "acked", "committed"):
                self.inspected.add(gid)
                for s in samples:
                    self.multi_version_samples += len(set(s.versions)) > 1
                    self.resumed_samples += s.num_resumes > 0
            elif first_open is None:
                first_open = c
        self.next_unfinished = first_open if first_open is not None else cursor
        self.inspected = {g for g in self.inspected if int(g[1:]) >= self.next_unfinished}

    async def poll(self, wall_seconds: float, trainer_step: int = 0) -> dict[str, float]:
        """Buffer metrics now; ``rollout/tokens_per_second`` is appended tokens per training
        wall second over a :class:`RateWindow` (whole trainer steps, at least 60 s)."""
        st = await self.buf.stats()
        self.last_stats = st
        counters = st.get("counters", {})
        m: dict[str, float] = {
            "policy/version": st["version"],
            "policy/lineage": st["lineage"],
            "buffer/dataset_cursor": st["dataset_cursor"],
            "buffer/partial_ratio": st["partial_ratio"],
            "buffer/drops": sum(st.get("dropped_by_reason", {}).values()),
            "buffer/restarts": sum(v for k, v in counters.items() if k.startswith("restarted_samples:")),
            "buffer/group_restarts": sum(v for k, v in counters.items() if k.startswith("restarted_groups:")),
            "buffer/parked_budget": counters.get("parked_budget", 0),
            "buffer/parked_abort": counters.get("parked_abort", 0),
            "buffer/idle_resumes": counters.get("idle_resumes", 0),
            "buffer/appended_tokens": counters.get("appended_tokens", 0),
            "buffer/restart_discarded_tokens": counters.get("restart_discarded_tokens", 0),
            "buffer/acked_groups": counters.get("acked_groups", 0),
        }
        # best-of-n, dynamic sampling, pass-rate filter, selective rollout (buffers.inspection.sampling_counts):
        # zero_variance_share is over every group finished so far, whether or not it was dropped
        for key, value in st.get("sampling", {}).items():
            m[f"buffer/{key}"] = value
        m["buffer/filtered_prompts"] = counters.get("filtered_prompts:pass_rate", 0)
        # states seen once keep being reported (as 0) so displays never show a stale count
        for kind in ("groups", "samples"):
            counts = st.get(f"{kind}_by_state", {})
            self.states_seen[kind].update(counts)
            for state in sorted(self.states_seen[kind]):
                m[f"buffer/{kind}_{state}"] = counts.get(state, 0)
        for reason, count in st.get("dropped_by_reason", {}).items():
            m[f"buffer/drops_{reason}"] = count
        hist = {int(k): v for k, v in st.get("staleness_histogram", {}).items()}
        if hist:
            m["staleness/max_ready"] = max(hist)
        rate = self.tokens_window.add(wall_seconds, int(counters.get("appended_tokens", 0)), trainer_step)
        if rate is not None:
            m["rollout/tokens_per_second"] = rate
        await self._inspect_groups(int(st["dataset_cursor"]))
        m["buffer/multi_version_samples"] = self.multi_version_samples
        m["buffer/resumed_samples"] = self.resumed_samples
        return m


def _role_kind(name: str) -> str:
    """Closed-set role label of a supervised process (``rollout-3`` -> ``rollout``; the feeder is the controller's)."""
    if name == "reward-model":
        return "reward_model"
    if name == "env-server":
        return "env_server"
    return "rollout" if name.startswith("rollout") else ("trainer" if name == "trainer" else "controller")


#: Buffer sample statuses -> ``asyncrl_buffer_samples{state}`` labels (asyncrl.metrics.SAMPLE_STATES).
_SAMPLE_STATE_LABEL = {"pending": "queued", "running": "generating", "partial": "partial", "complete": "scoring",
                       "scored": "complete", "failed": "failed"}
#: Buffer group states -> ``asyncrl_buffer_groups{state}`` labels (asyncrl.metrics.GROUP_STATES); fed
#: groups not yet admitted (``pending``) are not a group state there.
_GROUP_STATE_LABEL = {"generating": "in_flight", "ready": "ready", "batched": "claimed", "acked": "acknowledged"}


class PrometheusExport:
    """The controller's ``/metrics`` (``monitoring.controller_metrics_port``): :class:`ControllerMetrics`
    and the buffer state gauges of :class:`BufferMetrics` (only the poller sets those)."""

    def __init__(self, cfg: Any) -> None:
        from asyncrl.metrics import BufferMetrics, role_registry, start_metrics_server

        self.registry, self.ctl = role_registry("controller")
        self.buf = BufferMetrics(self.registry)
        self.buf.max_staleness.set(cfg.buffer.max_staleness)
        self.buf.group_capacity.set(cfg.rollout.rollout_batch_size)
        self.num_train = max(1, cfg.data.num_train_prompts)
        self.total_steps = cfg.run.total_steps
        self.cursor: int | None = None
        self.counted: dict[str, int] = {}
        self.port = start_metrics_server(self.registry, cfg.monitoring.controller_metrics_port,
                                         host=cfg.monitoring.metrics_host)

    #: The buffer's reason codes (buffers/lua) -> the closed sets of ``asyncrl.metrics``.
    BUFFER_REASONS = {"stale_resume": "stale", "stale_batch": "stale", "abandoned_version": "lineage",
                      "reward_error": "reward_error", "zero_variance": "zero_variance"}

    def _delta(self, key: str, total: int) -> int:
        """Increase of the buffer counter ``key`` since the last poll (the buffer keeps totals in Redis)."""
        before = self.counted.get(key)
        self.counted[key] = total
        return max(0, total - before) if before is not None else total

    def _export_counters(self, stats: dict[str, Any]) -> None:
        """Buffer events counted by the Lua scripts (drops, restarts, lease reclaims,
        admissions) -> the :class:`BufferMetrics` counters, by their increase since the last poll."""
        for key, total in stats.get("counters", {}).items():
            kind, _, code = key.partition(":")
            reason = self.BUFFER_REASONS.get(code)
            n = self._delta(key, int(total))
            if not n:
                continue
            if kind == "dropped_groups" and reason:
                self.buf.dropped(reason, groups=n)
            elif kind == "restarted_samples" and reason:
                self.buf.restarted(reason, samples=n)
            elif kind == "restarted_groups" and reason:
                self.buf.restarted(reason, groups=n)
            elif kind == "reclaimed_leases":
                self.buf.reclaimed.inc(n)
            elif kind == "restart_discarded_tokens":
                self.buf.restart_discarded_tokens.inc(n)
            elif kind == "discarded_best_of_n":
                self.buf.dropped("best_of_n", samples=n)
            elif kind == "finished_groups":
                self.buf.groups_finished.inc(n)
            elif kind == "zero_variance_groups":
                self.buf.groups_zero_variance.inc(n)
        admitted = self._delta("admitted_groups", int(stats.get("admitted_groups", 0)))
        if admitted:
            self.buf.groups_admitted.inc(admitted)

    def update(self, stats: dict[str, Any], trainer_step: int, running: list[str]) -> None:
        self._export_counters(stats)
        samples: dict[str, int] = {}
        for state, n in stats.get("samples_by_state", {}).items():
            if state in _SAMPLE_STATE_LABEL:
                label = _SAMPLE_STATE_LABEL[state]
                samples[label] = samples.get(label, 0) + int(n)
        groups: dict[str, int] = {}
        for state, n in stats.get("groups_by_state", {}).items():
            if state in _GROUP_STATE_LABEL:
                label = _GROUP_STATE_LABEL[state]
                groups[label] = groups.get(label, 0) + int(n)
        self.buf.set_state(samples=samples, groups=groups)
        self.buf.policy_version.set(stats.get("version", 0))
        self.buf.lineage.set(stats.get("lineage", 0))
        cursor = int(stats.get("dataset_cursor", 0))
        if self.cursor is not None and cursor > self.cursor:
            self.ctl.prompts_fed.inc(cursor - self.cursor)
        self.cursor = cursor
        self.ctl.dataset_epoch.set(cursor // self.num_train)
        self.ctl.run_progress.set(min(1.0, trainer_step / self.total_steps))
        for kind in ("rollout", "trainer", "controller", "reward_model"):
            self.ctl.role_processes.labels(kind).set(sum(_role_kind(n) == kind for n in running))

    def restarted(self, name: str, reason: str) -> None:
        self.ctl.restarted(_role_kind(name), "unhealthy" if reason == "unhealthy" else "exit")

    def evaluated(self, accuracy: float | None, seconds: float) -> None:
        if accuracy is not None:
            self.ctl.eval_accuracy.set(accuracy)
        self.ctl.eval_duration.observe(seconds)


def parse_prometheus_totals(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of every sample of each metric in ``names`` in a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return out


class RolloutScraper:
    """Idle ratio and generated tokens/s of each rollout server, from its engine's ``/metrics``.

    Idle ratios are over the last ~10 s of host time, tokens/s over a :class:`RateWindow`
    (whole trainer steps, at least 60 s: generation is bursty); :meth:`reset` after an
    evaluation pause (host time runs on while the servers are stopped).
    """

    IDLE = "asyncrl_rollout_idle_seconds_total"
    TOKENS = "asyncrl_rollout_generated_tokens_total"

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.window: dict[str, deque[tuple[float, dict[str, float]]]] = {u: deque() for u in urls}
        self.tokens: dict[str, RateWindow] = {u: RateWindow() for u in urls}

    def reset(self) -> None:
        for w in self.window.values():
            w.clear()
        for r in self.tokens.values():
            r.clear()

    async def poll(self, trainer_step: int = 0) -> dict[str, float]:
        import aiohttp

        out: dict[str, float] = {}
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for i, url in enumerate(self.urls):
                try:
                    async with session.get(url + "/metrics") as resp:
                        if resp.status != 200:
                            continue
                        text = await resp.text()
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    continue
                now = time.monotonic()
                window = self.window[url]
                window.append((now, parse_prometheus_totals(text, (self.IDLE, self.TOKENS))))
                while len(window) > 2 and now - window[0][0] > 10.0:
                    window.popleft()
                (t0, v0), (t1, v1) = window[0], window[-1]
                if self.TOKENS in v1:
                    rate = self.tokens[url].add(now, v1[self.TOKENS], trainer_step)
                    if rate is not None:
                        out[f"rollout/tokens_per_second_{i}"] = rate
                if t1 > t0 and self.IDLE in v0 and self.IDLE in v1:
                    out[f"idle_ratio/rollout-{i}"] = min(1.0, max(0.0, (v1[self.IDLE] - v0[self.IDLE]) / (t1 - t0)))
        return out
