"""The replay buffer's state machine: a Python port of ``buffers/lua/*.lua``, one method per script.

The transitions, in the scripts' order of checks, are described in the package docstring
(:mod:`bench.simulate`) and docs/scaling.md#the-model.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from .lengths import LengthModel

__all__ = ["Sample", "Group", "WorkItem", "Buffer"]


class Sample:
    """One sample's buffer state (the fields of ``sample:<gid>/<i>`` the scripts read)."""

    __slots__ = ("sid", "group", "idx", "target", "length", "status", "minv", "bver", "bused",
                 "restarts", "resumes", "qtoken", "maxv", "extra")

    def __init__(self, sid: int, group: "Group", idx: int, target: int):
        self.sid, self.group, self.idx, self.target = sid, group, idx, target
        self.length = 0
        self.status = "pending"
        self.minv = self.bver = self.maxv = -1
        self.bused = 0
        self.restarts = self.resumes = 0
        self.qtoken = 0
        self.extra = 0  # tokens in the sequence the policy did not generate (an agent's observations)


class Group:
    """One prompt group's buffer state."""

    __slots__ = ("gid", "seq", "n", "samples", "state", "n_scored", "feed_index", "admit_version", "admit_time", "minv",
                 "ready_time")

    def __init__(self, gid: int, feed_index: int, n: int):
        self.gid, self.feed_index, self.n = gid, feed_index, n
        self.seq = 0
        self.samples: list[Sample] = []
        self.state = "pending"
        self.n_scored = 0
        self.admit_version = -1
        self.admit_time = 0.0
        self.minv = -1
        self.ready_time = 0.0


@dataclass
class WorkItem:
    """A claimed GENERATE item: the sample, ``max_new_tokens`` and whether it is an idle resume."""

    sample: Sample
    max_new: int
    idle: bool


class Buffer:
    """The replay buffer's state machine (buffers/lua/*.lua), one method per script.

    Args:
        R: rollout batch size (cap on generating groups).
        B: train batch groups.
        n: samples per group.
        M: max_budget tokens per sample per version.
        L: max_response_len.
        eta: max_staleness.
        stale_policy: ``restart`` | ``drop`` | ``keep``.
        lengths: the LengthModel; rng: its random source.
        batches_per_version: weight_sync.interval.
        admission_counts_ready: the rule before the third session (READY groups hold a slot).
    """

    def __init__(self, R: int, B: int, n: int, M: int, L: int, eta: int, stale_policy: str,
                 lengths: LengthModel, rng: random.Random, batches_per_version: int = 1,
                 admission_counts_ready: bool = False):
        if stale_policy not in ("restart", "drop", "keep"):
            raise ValueError(f"stale_policy must be restart, drop or keep, got {stale_policy!r}")
        self.R, self.B, self.n, self.M, self.L, self.eta = R, B, n, M, L, eta
        self.policy, self.lengths, self.rng, self.bpv = stale_policy, lengths, rng, batches_per_version
        self.counts_ready = admission_counts_ready
        self.v = 0
        self.admitted = 0
        self.generating = 0
        self.ready_count = 0
        self.pending: deque[Group] = deque()
        self.fresh: list = []
        self.resumable: list = []
        self.parked: list = []
        self.ready: list = []
        self.ready_by_minv: list = []
        self._seq = 0
        self._pseq = 0
        self._sid = 0
        self._gid = 0
        self.fed = 0
        self.groups_live: dict[int, Group] = {}
        self.stats = {"admitted": 0, "parked_budget": 0, "parked_abort": 0, "idle_resumes": 0,
                      "restarted_samples": 0, "restarted_groups": 0, "dropped_groups": 0,
                      "trained_groups": 0, "completed_samples": 0, "resumes": 0}
        self.now = 0.0

    # -------------------------------------------------------------------------------- feeding
    def feed_to(self, count: int) -> None:
        """The feeder keeps ``count`` groups pending (asyncrl.feeder.feeder keeps R)."""
        while len(self.pending) < count:
            g = Group(self._gid, self.fed, self.n)
            self._gid += 1
            self.fed += 1
            self.pending.append(g)
            self.groups_live[g.gid] = g

    def _generating_slots(self) -> int:
        return self.generating + (self.ready_count if self.counts_ready else 0)

    def admit(self) -> int:
        """settings.lua ``admit``: admit pending groups under the R cap and AReaL's bound."""
        limit = (self.eta + self.v + 1) * self.B * self.bpv
        count = 0
        while self.admitted < limit and self._generating_slots() < self.R:
            if not self.pending:
                self.feed_to(self.R)
            g = self.pending.popleft()
            self._seq += 1
            g.seq = self._seq
            g.state = "generating"
            g.admit_version = self.v
            g.admit_time = self.now
            targets = self.lengths.lengths(self.rng, g.feed_index, self.v, g.n)
            for i in range(g.n):
                s = Sample(self._sid, g, i, max(1, min(self.L, int(targets[i]))))
                self._sid += 1
                g.samples.append(s)
                self._push_fresh(s)
            self.generating += 1
            self.admitted += 1
            count += 1
        if count:
            self.stats["admitted"] += count
            self.feed_to(self.R)
        return count

    # -------------------------------------------------------------------------------- queues
    def _push_fresh(self, s: Sample) -> None:
        s.qtoken += 1
        heapq.heappush(self.fresh, (s.group.seq * 2048 + s.idx, s.qtoken, s))

    def _push_resumable(self, s: Sample) -> None:
        s.qtoken += 1
        self._pseq += 1
        heapq.heappush(self.resumable, (s.minv, self._pseq, s.qtoken, s))

    def _push_parked(self, s: Sample) -> None:
        s.qtoken += 1
        self._pseq += 1
        heapq.heappush(self.parked, (s.bver, self._pseq, s.qtoken, s))

    @staticmethod
    def _top(heap: list) -> Sample | None:
        while heap:
            entry = heap[0]
            s = entry[-1]
            if entry[-2] == s.qtoken and s.status in ("pending", "partial"):
                return s
            heapq.heappop(heap)
        return None

    def has_work(self) -> bool:
        """True when a claim would hand something out (work queued or a group admissible)."""
        if self._top(self.resumable) or self._top(self.fresh) or self._top(self.parked):
            return True
        limit = (self.eta + self.v + 1) * self.B * self.bpv
        return self.admitted < limit and self._generating_slots() < self.R

    def _reset_sample(self, s: Sample, reason: str) -> None:
        if s.status == "scored":
            s.group.n_scored -= 1
        s.status = "pending"
        s.length = 0
        s.minv = s.bver = s.maxv = -1
        s.bused = 0
        s.restarts += 1
        if self.lengths.resample_on_restart:
            s.target = max(1, min(self.L, int(self.lengths.redraw(self.rng, s.group.feed_index, self.v))))
        self._push_fresh(s)
        self.stats["restarted_samples"] += 1

    def _drop_group(self, g: Group, reason: str) -> None:
        if g.state == "generating":
            self.generating -= 1
        elif g.state == "ready":
            self.ready_count -= 1
        g.state = "dropped"
        for s in g.samples:
            s.status = "dropped"
            s.qtoken += 1
        self.groups_live.pop(g.gid, None)
        self.admitted -= 1
        self.stats["dropped_groups"] += 1

    def _stale_ok(self, s: Sample) -> bool:
        if s.minv < 0 or self.v - s.minv <= self.eta or self.policy == "keep":
            return True
        if self.policy == "restart":
            self._reset_sample(s, "stale_resume")
        else:
            self._drop_group(s.group, "stale_resume")
            self.admit()
        return False

    # -------------------------------------------------------------------------------- claim.lua
    def claim(self, max_items: int) -> list[WorkItem]:
        """claim.lua: promote parked samples, admit, hand out up to ``max_items`` items."""
        while self.parked:
            s = self._top(self.parked)
            if s is None or s.bver >= self.v:
                break
            heapq.heappop(self.parked)
            self._push_resumable(s)
        self.admit()
        out: list[WorkItem] = []
        guard = 0
        while len(out) < max_items and guard < 100_000:
            guard += 1
            s = self._top(self.resumable)
            if s is not None:
                if s.bver == self.v and s.bused >= self.M:
                    heapq.heappop(self.resumable)
                    self._push_parked(s)
                elif self._stale_ok(s):
                    heapq.heappop(self.resumable)
                    out.append(self._take(s, idle=False))
                continue
            s = self._top(self.fresh)
            if s is not None:
                heapq.heappop(self.fresh)
                out.append(self._take(s, idle=False))
                continue
            s = self._top(self.parked)
            if s is None:
                break
            if self._stale_ok(s):
                heapq.heappop(self.parked)
                out.append(self._take(s, idle=True))
        return out

    def _take(self, s: Sample, idle: bool) -> WorkItem:
        if idle:
            s.bver, s.bused = self.v, 0
            self.stats["idle_resumes"] += 1
        used = s.bused if s.bver == self.v else 0
        if s.length > 0:
            s.resumes += 1
            self.stats["resumes"] += 1
        s.status = "running"
        s.qtoken += 1
        return WorkItem(s, max(0, min(self.M - used, self.L - s.length)), idle)

    # -------------------------------------------------------------------------------- append.lua
    def end_segment(self, s: Sample, by_version: list[tuple[int, int]], reason: str) -> str:
        """append.lua with a finish reason: ``stop`` | ``budget`` | ``abort``; returns the new status."""
        for tv, k in by_version:
            if k <= 0:
                continue
            if tv > self.v:
                raise AssertionError(f"token version {tv} ahead of the clock {self.v}")
            if tv > s.bver:
                s.bver, s.bused = tv, 0
            if tv == s.bver:
                s.bused += k
            if s.minv < 0 or tv < s.minv:
                s.minv = tv
            s.maxv = max(s.maxv, tv)
            s.length += k
        if s.length > self.L:
            raise AssertionError(f"sample {s.sid} holds {s.length} > L = {self.L} tokens")
        if reason == "stop" or s.length >= self.L:
            s.status = "complete"
            self.stats["completed_samples"] += 1
            self._score(s)
            return "complete"
        if reason == "budget" or s.bused >= self.M:
            s.status = "partial"
            self._push_parked(s)
            self.stats["parked_budget"] += 1
            return "parked"
        self.stats["parked_abort"] += 1
        if s.length == 0:
            s.status = "pending"
            self._push_fresh(s)
            return "pending"
        s.status = "partial"
        self._push_resumable(s)
        return "resumable"

    # -------------------------------------------------------------------------------- score.lua
    def _score(self, s: Sample) -> None:
        s.status = "scored"
        g = s.group
        g.n_scored += 1
        if g.n_scored == g.n:
            g.state = "ready"
            g.ready_time = self.now
            g.minv = self.group_minv(g)  # scored samples do not change while READY
            self.generating -= 1
            self.ready_count += 1
            heapq.heappush(self.ready, (g.seq, g.gid, g))
            heapq.heappush(self.ready_by_minv, (g.minv, g.seq, g.gid, g))
            self.admit()

    # -------------------------------------------------------------------------------- next_batch.lua
    def group_minv(self, g: Group) -> int:
        """Oldest token version among the group's scored samples (-1: none)."""
        mv = -1
        for s in g.samples:
            if s.status == "scored" and s.minv >= 0 and (mv < 0 or s.minv < mv):
                mv = s.minv
        return mv

    def next_batch(self, min_groups: int | None = None) -> list[tuple[Group, int]] | None:
        """next_batch.lua: B READY groups oldest first, staleness-checked; None if fewer."""
        need = self.B if min_groups is None else min_groups
        if self.ready_count < need:
            # fewer than B READY: the script still applies the stale policy to stale READY groups;
            # skip the scan when none is stale (the oldest minv among READY groups is recent)
            while self.ready_by_minv and self.ready_by_minv[0][-1].state != "ready":
                heapq.heappop(self.ready_by_minv)
            top = self.ready_by_minv[0][0] if self.ready_by_minv else None
            if top is None or top < 0 or self.policy == "keep" or self.v - top <= self.eta:
                self.admit()
                return None
        chosen: list[tuple[Group, int]] = []
        keep_heap = []
        while self.ready and len(chosen) < self.B:
            seq, gid, g = heapq.heappop(self.ready)
            if g.state != "ready":
                continue
            mv = g.minv
            if mv >= 0 and self.v - mv > self.eta and self.policy != "keep":
                self.ready_count -= 1
                if self.policy == "restart":
                    for s in g.samples:
                        self._reset_sample(s, "stale_batch")
                    g.minv = -1
                    g.state = "generating"
                    g.n_scored = 0
                    self.generating += 1
                    self.stats["restarted_groups"] += 1
                else:
                    self._drop_group_ready(g)
                continue
            chosen.append((g, self.v - mv if mv >= 0 else 0))
            keep_heap.append((seq, gid, g))
        if len(chosen) < need or not chosen:
            for e in keep_heap:
                heapq.heappush(self.ready, e)
            self.admit()
            return None
        for g, _ in chosen:
            g.state = "batched"
            self.ready_count -= 1
        self.admit()
        return chosen

    def _drop_group_ready(self, g: Group) -> None:
        g.state = "dropped"
        self.groups_live.pop(g.gid, None)
        self.admitted -= 1
        self.stats["dropped_groups"] += 1

    def acknowledge(self, groups: Iterable[Group]) -> None:
        """ack.lua (+ commit: trained groups leave the buffer)."""
        for g in groups:
            g.state = "trained"
            self.groups_live.pop(g.gid, None)
            self.stats["trained_groups"] += 1
        self.admit()

    def publish(self) -> None:
        """publish.lua: the clock moves forward."""
        self.v += 1

    def books(self) -> dict[str, int]:
        """fed = trained + live + dropped, the check ``asyncrl train`` prints at the end."""
        live = len(self.groups_live)
        return {"fed": self.fed, "trained": self.stats["trained_groups"], "live": live,
                "dropped": self.stats["dropped_groups"],
                "balanced": int(self.fed == self.stats["trained_groups"] + live + self.stats["dropped_groups"])}
