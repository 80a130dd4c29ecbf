"""The discrete-event simulation: rollout servers (fluid continuous batching), the buffer and the trainer.

:class:`SimConfig` is one configuration (asyncrl's knobs and the component models),
:func:`simulate` runs it and returns a :class:`SimResult` (asyncrl's definitions of the measured
quantities: package docstring, docs/scaling.md).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from .agents import AgentEvents
from .buffer import Buffer, Group, WorkItem
from .components import INF, EngineModel, TrainerModel
from .lengths import FixedLength, LengthModel

__all__ = ["train_batch_groups", "Req", "Server", "SimConfig", "StepRecord", "SimResult", "Simulator", "simulate"]


def train_batch_groups(partial_percent: float, rollout_batch_size: int) -> int:
    """B = ceil(p * R) prompt groups per train batch.

    The same formula as ``asyncrl.core.config.train_batch_groups`` (not imported: this module imports
    nothing heavy; ``tests/test_simulate.py`` pins the two together).
    """
    return max(1, math.ceil(partial_percent * rollout_batch_size - 1e-9))


class Req:
    """One request running (or queued) on an engine: a segment of one sample.

    An agent sample's segment runs in pieces separated by tool calls: ``stops`` are the tool
    calls' positions in the segment, ``pos`` the tokens of it generated before this piece.
    """

    __slots__ = ("item", "start", "end", "ver_offset", "ver", "credited", "ctx0", "seg_len", "finish", "pos", "stops")

    def __init__(self, item: WorkItem, seg_len: int, finish: str):
        self.item = item
        self.seg_len = seg_len
        self.finish = finish
        self.start = self.end = self.ver_offset = 0.0
        self.ver = 0
        self.credited: list[tuple[int, int]] = []
        self.ctx0 = self.pos = 0
        self.stops: list[int] = []


class Server:
    """One rollout server: engine (fluid continuous batching) + rollout worker."""

    def __init__(self, idx: int, engine: EngineModel, max_inflight: int):
        self.idx = idx
        self.engine = engine
        self.max_inflight = max_inflight
        self.version = 0
        self.updating = False
        self.running: dict[int, Req] = {}
        self.waiting: deque[Req] = deque()
        self.tools: dict[int, Req] = {}  # agent segments waiting for their tool (worker slot held, no engine row)
        self.heap: list = []
        self.offset = 0.0
        self.t = 0.0
        self.stall_until = 0.0
        self.kv_base = 0.0
        self.gen = 0
        self.tokens = 0.0
        self.idle_time = 0.0
        self.row_time = 0.0

    @property
    def kv(self) -> float:
        """Tokens of context in the KV cache now."""
        return self.kv_base + len(self.running) * self.offset

    def inflight(self) -> int:
        """Claimed items (running + queued in the engine)."""
        return len(self.running) + len(self.waiting)

    def advance(self, now: float) -> None:
        """Move the fluid state to ``now`` (decode progress, idle and occupancy integrals)."""
        if now <= self.t:
            return
        rows = len(self.running)
        if self.inflight() == 0:
            self.idle_time += now - self.t
        self.row_time += rows * (now - self.t)
        start = max(self.t, self.stall_until)
        if rows and now > start:
            steps = (now - start) / self.engine.step_seconds(rows, self.kv)
            self.offset += steps
            self.tokens += rows * steps
        self.t = now


@dataclass
class SimConfig:
    """One simulated configuration (the asyncrl knobs and the component models).

    Attributes:
        name: label.
        rollout_batch_size, partial_percent, n_samples, max_budget, max_response_len,
            max_staleness, stale_policy, batches_per_version: the asyncrl knobs (docs/concepts.md).
        prompt_tokens: prompt length.
        lengths: LengthModel of the responses.
        servers, engine, max_inflight: rollout servers, their EngineModel, worker items in flight
            (``rollout.max_inflight_requests``).
        pause_mode: ``abort`` | ``in_place`` (``rollout.pause_mode``).
        notice, fetch, load: seconds from publish to the worker noticing, fetching and loading.
        trainer: TrainerModel.
        colocated: servers and trainer share the devices (synchronous asyncrl on GPUs).
        admission_counts_ready: the admission rule before the third session.
        warmup, duration: measurement window (seconds) when ``steps`` is 0.
        steps: stop after this many train steps (0: run ``warmup + duration`` seconds).
        warmup_steps: with ``steps``, measure from the end of this step on.
        seed: random seed.
        engine_wide: the servers' engine while the trainer waits for a batch, ``engine`` while it
            works (``resources.core_sharing: follow``: the rollout server takes the trainer's
            threads); None: ``engine`` always.
        agent: an :class:`~bench.simulate.agents.AgentModel` (multi-call episodes with tool latency), or None.
    """

    name: str = "run"
    rollout_batch_size: int = 8
    partial_percent: float = 1.0
    n_samples: int = 8
    max_budget: int = 64
    max_response_len: int = 64
    max_staleness: int = 0
    stale_policy: str = "restart"
    batches_per_version: int = 1
    prompt_tokens: int = 42
    lengths: LengthModel = field(default_factory=lambda: FixedLength(16))
    servers: int = 1
    engine: EngineModel = field(default_factory=lambda: EngineModel("engine", 0.01, 0.001))
    max_inflight: int = 32
    pause_mode: str = "abort"
    notice: float = 0.0
    fetch: float = 0.0
    load: float = 0.0
    trainer: TrainerModel = field(default_factory=TrainerModel)
    colocated: bool = False
    admission_counts_ready: bool = False
    warmup: float = 0.0
    duration: float = 600.0
    steps: int = 0
    warmup_steps: int = 0
    seed: int = 0
    agent: Any = None
    engine_wide: EngineModel | None = None

    @property
    def train_batch_groups(self) -> int:
        """B = ceil(p R)."""
        return train_batch_groups(self.partial_percent, self.rollout_batch_size)

    def validate(self) -> None:
        """The config validator's rules that matter here (asyncrl/core/config.py)."""
        if self.partial_percent < 1 and self.max_staleness == 0:
            raise ValueError("partial_percent < 1 needs max_staleness >= 1 (docs/concepts.md)")
        if self.pause_mode not in ("abort", "in_place"):
            raise ValueError(f"pause_mode must be abort or in_place, got {self.pause_mode!r}")
        if self.max_budget < 1 or self.max_response_len < 1:
            raise ValueError("max_budget and max_response_len must be >= 1")


@dataclass
class StepRecord:
    """One train step: its phases (seconds), groups, staleness of each group, samples, tokens."""

    step: int
    t_start: float
    wait: float
    forward_backward: float
    optim: float
    publish: float
    checkpoint: float
    staleness: list[int]
    samples: int
    response_tokens: int

    @property
    def total(self) -> float:
        """Sum of the phases."""
        return self.wait + self.forward_backward + self.optim + self.publish + self.checkpoint


@dataclass
class SimResult:
    """What a run measured (asyncrl's definitions, see the package docstring of bench.simulate)."""

    name: str
    window_seconds: float
    steps: int
    seconds_per_step: float
    samples_per_second: float
    tokens_per_second: float
    engine_tokens_per_second: float
    engine_tokens_per_second_window: float
    trainer_idle: float
    rollout_idle: float
    running_requests: float
    staleness_mean: float
    staleness_max: int
    phases: dict[str, float]
    buffer: dict[str, int]
    books: dict[str, int]
    trained_samples: int
    trained_tokens: int

    def row(self) -> dict[str, Any]:
        """A flat dict for JSON."""
        return asdict(self)


class Simulator(AgentEvents):
    """Discrete-event simulation of one SimConfig (see the package docstring of bench.simulate)."""

    def __init__(self, cfg: SimConfig):
        cfg.validate()
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.buf = Buffer(cfg.rollout_batch_size, cfg.train_batch_groups, cfg.n_samples, cfg.max_budget,
                          cfg.max_response_len, cfg.max_staleness, cfg.stale_policy, cfg.lengths, self.rng,
                          cfg.batches_per_version, cfg.admission_counts_ready)
        self.servers = [Server(i, cfg.engine_wide or cfg.engine, cfg.max_inflight) for i in range(cfg.servers)]
        self.events: list = []
        self._eseq = 0
        self.now = 0.0
        self.end_time = INF if cfg.steps else cfg.warmup + cfg.duration
        self.records: list[tuple[float, StepRecord]] = []
        self.trained: list[Group] = []
        self.snap0: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
        self.hungry: set[int] = set()
        self.agent_episodes: dict[tuple[int, int], Any] = {}
        self._rr = 0
        # trainer state
        self.step = 0
        self.step_start = 0.0
        self.batch: list[tuple[Group, int]] | None = None
        self.phase_t: dict[str, float] = {}
        self.trainer_busy_until = 0.0
        self.done = False

    # -------------------------------------------------------------------------------- events
    def _push(self, t: float, kind: str, *payload: Any) -> None:
        self._eseq += 1
        heapq.heappush(self.events, (t, self._eseq, kind, payload))

    def run(self) -> SimResult:
        """Run to the end of the window (or ``steps``) and summarise."""
        cfg = self.cfg
        self.buf.feed_to(cfg.rollout_batch_size)
        first = cfg.trainer.tick if cfg.trainer.tick is not None else 0.0
        self._push(first, "trainer_poll")
        if not cfg.steps and cfg.warmup > 0:
            self._push(cfg.warmup, "snapshot")
        self.hungry = set(range(len(self.servers)))
        self._wake()
        while self.events and not self.done:
            t, _, kind, payload = heapq.heappop(self.events)
            if t > self.end_time:
                self.now = self.end_time
                break
            self.now = t
            self.buf.now = t
            getattr(self, "_on_" + kind)(*payload)
        return self._summarise()

    # -------------------------------------------------------------------------------- servers
    def _schedule(self, srv: Server) -> None:
        srv.gen += 1
        if not srv.running:
            return
        while srv.heap and (srv.heap[0][2] not in srv.running or srv.running[srv.heap[0][2]].end != srv.heap[0][0]):
            heapq.heappop(srv.heap)
        start = max(self.now, srv.stall_until)
        steps = max(0.0, srv.heap[0][0] - srv.offset)
        eng = srv.engine
        if eng.gamma > 0:
            steps = min(steps, float(eng.refresh_steps))
        t = start + steps * eng.step_seconds(len(srv.running), srv.kv)
        self._push(t, "server", srv.idx, srv.gen)

    def _on_server(self, idx: int, gen: int) -> None:
        srv = self.servers[idx]
        if gen != srv.gen:
            return
        srv.advance(self.now)
        finished = []
        while srv.heap:
            end, _, sid = srv.heap[0]
            r = srv.running.get(sid)
            if r is None or r.end != end:
                heapq.heappop(srv.heap)
                continue
            if end <= srv.offset + 1e-6 + 1e-9 * srv.offset:
                heapq.heappop(srv.heap)
                finished.append(r)
                continue
            break
        for r in finished:
            if r.stops:
                self._tool_call(srv, r)
            else:
                self._finish(srv, r, r.seg_len, r.finish)
        self._start_waiting(srv)
        self._dispatch(srv)
        self._schedule(srv)
        self._wake()

    def _credit(self, srv: Server, r: Req, produced: int) -> list[tuple[int, int]]:
        done = sum(k for _, k in r.credited)
        return r.credited + [(r.ver, max(0, produced - done))]

    def _finish(self, srv: Server, r: Req, produced: int, reason: str) -> None:
        """A segment ends (``stop`` / ``budget``: its tokens all produced; ``abort``: cut short)."""
        del srv.running[r.item.sample.sid]
        srv.kv_base -= r.ctx0 - r.start
        if not srv.running:
            srv.kv_base = 0.0
        s = r.item.sample
        if s.status != "running":  # dropped meanwhile
            return
        self.buf.end_segment(s, self._credit(srv, r, produced), reason)

    def _start_waiting(self, srv: Server) -> None:
        """Move queued requests into the running batch while rows and KV allow; prefill them."""
        eng = srv.engine
        prefill = 0
        groups_prefilled: set[int] = set()
        srv.advance(self.now)
        while srv.waiting and len(srv.running) < eng.max_rows:
            r = srv.waiting[0]
            need = r.ctx0 + r.seg_len
            if srv.running and srv.kv + need > eng.kv_capacity:
                break
            srv.waiting.popleft()
            s = r.item.sample
            if s.status != "running":
                continue
            r.start = r.ver_offset = srv.offset
            r.end = srv.offset + (r.stops[0] if r.stops else r.seg_len) - r.pos
            r.ver = srv.version
            srv.running[s.sid] = r
            srv.kv_base += r.ctx0 - r.start
            heapq.heappush(srv.heap, (r.end, s.group.gid * 4096 + s.idx, s.sid))
            if s.length == 0 and r.pos == 0 and eng.shared_prefix:
                if s.group.gid not in groups_prefilled:
                    groups_prefilled.add(s.group.gid)
                    prefill += self.cfg.prompt_tokens
            else:
                prefill += r.ctx0
        if prefill and eng.prefill_per_token > 0:
            srv.stall_until = max(srv.stall_until, self.now) + prefill * eng.prefill_per_token

    def _dispatch(self, srv: Server) -> None:
        """The worker's claim loop for ``srv`` (catch-up first when the engine is behind)."""
        if srv.updating or self.done:
            return
        if srv.version < self.buf.v:
            self._begin_update(srv)
            return
        if self.cfg.colocated and self.now < self.trainer_busy_until:
            self.hungry.add(srv.idx)
            return
        free = srv.max_inflight - srv.inflight() - len(srv.tools)
        if free <= 0:
            self.hungry.discard(srv.idx)
            return
        items = self.buf.claim(free)
        if len(items) < free:
            self.hungry.add(srv.idx)
        else:
            self.hungry.discard(srv.idx)
        if not items:
            return
        srv.advance(self.now)
        for it in items:
            s = it.sample
            ep = self._episode(s) if self.cfg.agent is not None else None
            remaining = s.target - s.length
            seg = min(it.max_new, remaining)
            if seg <= 0:  # nothing left to generate (cannot happen with max_new >= 1): complete it
                self.buf.end_segment(s, [], "stop")
                continue
            finish = "stop" if seg == remaining else "budget"
            r = Req(it, seg, finish)
            r.ctx0 = self.cfg.prompt_tokens + s.length
            if ep is not None:
                self._agent_request(r, s, ep)
            srv.waiting.append(r)
        self._start_waiting(srv)
        self._schedule(srv)

    def _wake(self) -> None:
        """Servers with free slots claim while the buffer has work (round robin)."""
        if not self.hungry:
            return
        order = sorted(self.hungry)
        k = self._rr % len(order)
        self._rr += 1
        for idx in order[k:] + order[:k]:
            if not self.buf.has_work():
                break
            if idx in self.hungry:
                self._dispatch(self.servers[idx])

    # -------------------------------------------------------------------------------- weights
    def _begin_update(self, srv: Server) -> None:
        srv.updating = True
        self.hungry.discard(srv.idx)
        self._push(self.now + self.cfg.fetch, "pause", srv.idx, self.buf.v)

    def _on_notice(self, idx: int) -> None:
        srv = self.servers[idx]
        if not srv.updating and srv.version < self.buf.v:
            self._begin_update(srv)

    def _on_pause(self, idx: int, version: int) -> None:
        srv = self.servers[idx]
        srv.advance(self.now)
        if self.cfg.pause_mode == "abort":
            for r in list(srv.running.values()):
                produced = min(r.seg_len - 1, r.pos + int(math.floor(srv.offset - r.start + 1e-9)))
                self._finish(srv, r, max(0, produced), "abort")
            srv.heap.clear()
            while srv.waiting:
                r = srv.waiting.popleft()
                if r.item.sample.status == "running":
                    self.buf.end_segment(r.item.sample, r.credited, "abort")  # an agent's pieces so far
        srv.stall_until = max(srv.stall_until, self.now) + self.cfg.load
        self._push(self.now + self.cfg.load, "loaded", idx, version)
        self._schedule(srv)
        self._wake()

    def _on_loaded(self, idx: int, version: int) -> None:
        srv = self.servers[idx]
        srv.advance(self.now)
        for r in srv.running.values():  # in_place: the rest of the segment is the new version's
            k = int(round(srv.offset - r.ver_offset))
            k = max(0, min(k, r.seg_len - sum(c for _, c in r.credited)))
            r.credited.append((r.ver, k))
            r.ver, r.ver_offset = version, srv.offset
        for r in srv.waiting:
            r.ver = version
        srv.version = version
        srv.updating = False
        self._dispatch(srv)
        self._schedule(srv)
        self._wake()

    # -------------------------------------------------------------------------------- trainer
    def _follow(self, waiting: bool) -> None:
        """``engine_wide``: the servers decode with it while the trainer waits, with ``engine`` else."""
        eng = self.cfg.engine_wide if waiting else self.cfg.engine
        if self.cfg.engine_wide is None:
            return
        for srv in self.servers:
            srv.advance(self.now)
            srv.engine = eng
            self._schedule(srv)

    def _on_trainer_poll(self) -> None:
        tr = self.cfg.trainer
        batch = self.buf.next_batch()
        if batch is None:
            self._push(self.now + (tr.tick if tr.tick is not None else tr.poll), "trainer_poll")
            self._wake()
            return
        self.batch = batch
        self._follow(False)
        groups = [g for g, _ in batch]
        wait = self.now - self.step_start
        fb = tr.forward_backward_seconds(groups, self.cfg.prompt_tokens)
        self.phase_t = {"wait": wait, "forward_backward": fb, "optim": tr.optim if tr.tick is None else 0.0}
        busy = fb + self.phase_t["optim"]
        if self.cfg.colocated and busy > 0:
            self.trainer_busy_until = self.now + busy
            for srv in self.servers:
                srv.advance(self.now)
                srv.stall_until = max(srv.stall_until, self.trainer_busy_until)
                self._schedule(srv)
        self._push(self.now + busy, "trainer_optimised")
        self._wake()

    def _on_trainer_optimised(self) -> None:
        tr = self.cfg.trainer
        groups = [g for g, _ in self.batch]
        self.buf.acknowledge(groups)
        self._wake()
        pub = tr.publish if tr.tick is None else 0.0
        self.phase_t["publish"] = pub
        self._push(self.now + pub, "trainer_published")

    def _on_trainer_published(self) -> None:
        tr = self.cfg.trainer
        self.buf.publish()
        for srv in self.servers:
            self._push(self.now + self.cfg.notice, "notice", srv.idx)
        ck = tr.checkpoint if (tr.tick is None and tr.checkpoint_interval and (self.step + 1) % tr.checkpoint_interval == 0) else 0.0
        self.phase_t["checkpoint"] = ck
        self._push(self.now + ck, "trainer_step_end")
        self._wake()

    def _on_trainer_step_end(self) -> None:
        tr = self.cfg.trainer
        self.step += 1
        batch = self.batch
        samples = sum(len(g.samples) for g, _ in batch)
        tokens = sum(s.length for g, _ in batch for s in g.samples)
        rec = StepRecord(self.step, self.step_start, self.phase_t["wait"], self.phase_t["forward_backward"],
                         self.phase_t["optim"], self.phase_t["publish"], self.phase_t["checkpoint"],
                         [st for _, st in batch], samples, tokens)
        rec_time = self.now if tr.tick is None else self.step_start + self.phase_t["wait"]
        self.records.append((rec_time, rec))
        self.trained.extend(g for g, _ in batch)
        self.batch = None
        self._follow(True)
        if self.cfg.steps and self.cfg.warmup_steps and self.step == self.cfg.warmup_steps:
            self.snap0 = self._snapshot(self.now)
        if self.cfg.steps and self.step >= self.cfg.steps:
            self.done = True
            return
        if tr.tick is not None:
            # the benchmark trainer sleeps to the next tick of its grid
            nxt = (math.floor(self.now / tr.tick + 1e-9) + 1) * tr.tick
            self.step_start = self.now
            self._push(nxt, "trainer_poll")
        else:
            self.step_start = self.now
            self._push(self.now, "trainer_poll")

    # -------------------------------------------------------------------------------- summary
    def _snapshot(self, t: float) -> tuple[float, float, float, float]:
        for srv in self.servers:
            srv.advance(t)
        return (t, sum(s.idle_time for s in self.servers), sum(s.row_time for s in self.servers),
                sum(s.tokens for s in self.servers))

    def _on_snapshot(self) -> None:
        self.snap0 = self._snapshot(self.now)

    def _summarise(self) -> SimResult:
        cfg = self.cfg
        end = self.now if cfg.steps else self.end_time
        snap1 = self._snapshot(end)
        lo = self.snap0[0]
        if cfg.steps:
            recs = [r for _, r in self.records[cfg.warmup_steps:]]
        else:
            recs = [r for t, r in self.records if lo <= t <= end]
        span = max(1e-9, end - lo)
        samples = sum(r.samples for r in recs)
        tokens = sum(r.response_tokens for r in recs)
        stal = [x for r in recs for x in r.staleness]
        steps = len(recs)
        phases = {k: (sum(getattr(r, k) for r in recs) / steps if steps else 0.0)
                  for k in ("wait", "forward_backward", "optim", "publish", "checkpoint")}
        idle_tr = [r.wait / r.total for r in recs if r.total > 0]
        gen_tokens = snap1[3]
        win_tokens = snap1[3] - self.snap0[3]
        n = max(1, len(self.servers))
        return SimResult(
            name=cfg.name, window_seconds=span, steps=steps,
            seconds_per_step=span / steps if steps else INF,
            samples_per_second=samples / span, tokens_per_second=tokens / span,
            engine_tokens_per_second=gen_tokens / max(1e-9, end),
            engine_tokens_per_second_window=win_tokens / span,
            trainer_idle=sum(idle_tr) / len(idle_tr) if idle_tr else 1.0,
            rollout_idle=(snap1[1] - self.snap0[1]) / (span * n),
            running_requests=(snap1[2] - self.snap0[2]) / (span * n),
            staleness_mean=sum(stal) / len(stal) if stal else 0.0,
            staleness_max=max(stal) if stal else 0,
            phases=phases, buffer=dict(self.buf.stats), books=self.buf.books(),
            trained_samples=samples, trained_tokens=tokens)


def simulate(cfg: SimConfig) -> SimResult:
    """Run one configuration."""
    return Simulator(cfg).run()
