"""Hypothesis state machine over random interleavings of buffer transitions (real redis-server).

Rules: feed, claim, append, park (budget), abort, complete, score / fail, crash-and-reclaim
(a worker vanishes; its leases expire), version bump, batch, acknowledge (and again),
checkpoint (commit), rewind (trainer restarts from its last checkpoint). After every step:

* every fed group is in exactly one place: live in the buffer, dropped with a reason, or
  committed after being trained in the surviving lineage; none is trained twice;
* every live sample exists once per index, its status matches exactly one queue, and its
  tokens are a prefix of what the deterministic generator produces (nothing lost or doubled).
"""

from __future__ import annotations

import asyncio
import itertools
import zlib

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncrl.core.types import SampleStatus, WorkKind
from buffers import BufferError, BufferSettings, ReplayBuffer

QUEUES = ("fresh", "resumable", "parked", "unscored", "leases")
STATUS_QUEUES = {
    "pending": {"fresh"}, "running": {"leases"}, "partial": {"resumable", "parked"},
    "complete": {"leases", "unscored"}, "scored": set(), "failed": set(),
}
L = 8


def want(sid: str) -> list[int]:
    h = zlib.crc32(sid.encode())
    return [(h + 3 * t) % 97 for t in range(1 + h % L)]


class BufferMachine(RuleBasedStateMachine):
    redis_url: str = ""
    runs = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.buf: ReplayBuffer | None = None

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    @initialize(policy=st.sampled_from(["restart", "drop", "keep"]))
    def setup(self, policy):
        s = BufferSettings(rollout_batch_size=3, train_batch_groups=2, n_samples_per_prompt=2, max_budget=3,
                           max_response_len=L, max_staleness=1, stale_policy=policy, lease_seconds=0.05)
        self.buf = self.run(ReplayBuffer.open(self.redis_url, f"sm{next(self.runs)}", s))
        self.fed: list[str] = []
        self.held: list = []  # WorkItems a live worker holds
        self.step = 0  # last acknowledged step (surviving lineage)
        self.log: dict[int, list[str]] = {}  # step -> groups trained (surviving lineage)
        self.open_batch = None
        self.ckpt = (0, 0)  # (step, version)
        self.committed: set[str] = set()

    def teardown(self):
        if self.buf is not None:
            self.run(self.buf.drain())
            self.run(self.buf.close())
        self.loop.close()

    # ------------------------------------------------------------------ rules
    @rule(k=st.integers(1, 3))
    def feed(self, k):
        cur = self.run(self.buf.dataset_cursor())
        gids = [f"g{cur + i}" for i in range(k)]
        self.run(self.buf.feed([self.buf.make_group(g, [1, 2]) for g in gids], cur))
        self.fed += gids

    @rule(k=st.integers(1, 3))
    def claim(self, k):
        self.held += self.run(self.buf.claim("w", k))

    def _pick(self, i, kind=WorkKind.GENERATE):
        cands = [it for it in self.held if it.kind == kind]
        return cands[i % len(cands)] if cands else None

    def _call(self, it, coro):
        try:
            return self.run(coro)
        except BufferError:
            if it in self.held:
                self.held.remove(it)  # lease lost / abandoned weights: the worker drops the request
            return None

    @rule(i=st.integers(0, 9), n=st.integers(1, 3))
    def append(self, i, n):
        it = self._pick(i)
        if it is None:
            return
        w = want(it.sample_id)
        pos = it.length_tokens
        n = min(n, len(w) - pos, it.max_new_tokens - (pos - len(it.response_ids)))
        if n <= 0:
            return
        v = self.run(self.buf.clock.version())
        self._call(it, self.buf.append(it, w[pos:pos + n], [-0.1] * n, [min(v, it.clock_version)] * n))

    @rule(i=st.integers(0, 9), reason=st.sampled_from(["auto", "abort", "budget"]))
    def end_segment(self, i, reason):
        it = self._pick(i)
        if it is None:
            return
        w = want(it.sample_id)
        if reason == "auto":
            reason = "stop" if it.length_tokens == len(w) else "length"
        elif it.length_tokens == len(w):
            reason = "stop"
        status = self._call(it, self.buf.end_segment(it, reason))
        if status is not None and status != SampleStatus.COMPLETE:
            self.held.remove(it)
        elif status is not None:
            it.kind = WorkKind.SCORE

    def _segment(self, it):
        w = want(it.sample_id)
        v = self.run(self.buf.clock.version())
        while it in self.held:
            pos = it.length_tokens
            n = min(2, len(w) - pos, it.max_new_tokens - (pos - len(it.response_ids)))
            if n <= 0:
                break
            self._call(it, self.buf.append(it, w[pos:pos + n], [-0.1] * n, [min(v, it.clock_version)] * n))
        if it in self.held:
            status = self._call(it, self.buf.end_segment(it, "stop" if it.length_tokens == len(w) else "length"))
            if status == SampleStatus.COMPLETE:
                it.kind = WorkKind.SCORE
            elif status is not None:
                self.held.remove(it)

    @rule(i=st.integers(0, 9))
    def generate_segment(self, i):
        it = self._pick(i)
        if it is not None:
            self._segment(it)

    @rule(rounds=st.integers(1, 6), fail_mod=st.integers(5, 40))
    def work_through(self, rounds, fail_mod):
        """A busy worker: claim, generate whole segments, score (some rewards fail)."""
        for _ in range(rounds):
            self.held += self.run(self.buf.claim("w", 4))
            for it in list(self.held):
                if it.kind == WorkKind.GENERATE:
                    self._segment(it)
                if it in self.held and it.kind == WorkKind.SCORE:
                    kw = {"error": "x"} if zlib.crc32(it.sample_id.encode()) % fail_mod == 0 else {"reward": 1.0}
                    if self._call(it, self.buf.score(it, **kw)) is not None:
                        self.held.remove(it)

    @rule(i=st.integers(0, 9), fail=st.booleans())
    def score(self, i, fail):
        it = self._pick(i, WorkKind.SCORE)
        if it is None:
            return
        kw = {"error": "verifier failed"} if fail else {"reward": 1.0}
        if self._call(it, self.buf.score(it, **kw)) is not None:
            self.held.remove(it)

    @rule()
    def crash_worker_and_reclaim(self):
        self.held.clear()  # the worker is gone; its leases expire and the work is reclaimed
        self.run(asyncio.sleep(0.06))
        self.held += self.run(self.buf.claim("w2", 2))

    @rule()
    def bump_version(self):
        v = self.run(self.buf.clock.version())
        self.run(self.buf.clock.publish(v + 1, f"file:///w/{v + 1}", "c"))

    @rule(last=st.booleans())
    def batch(self, last):
        b = self.run(self.buf.next_batch(self.step + 1, 1 if last else None))
        if b is not None:
            assert self.open_batch is None or b.batch_id == self.open_batch.batch_id
            for g in b.groups:
                for s in g.samples:
                    assert s.response_ids == want(s.sample_id) and s.status == SampleStatus.SCORED
            self.open_batch = b

    @precondition(lambda self: self.open_batch is not None)
    @rule(twice=st.booleans())
    def acknowledge(self, twice):
        b = self.open_batch
        assert self.run(self.buf.acknowledge(b, self.step + 1)) is True
        if twice:
            assert self.run(self.buf.acknowledge(b, self.step + 1)) is False
        self.step += 1
        self.log[self.step] = b.group_ids
        self.open_batch = None

    @rule()
    def checkpoint(self):
        v = self.run(self.buf.clock.version())
        self.ckpt = (self.step, v)
        self.run(self.buf.commit(self.step))
        for s, gids in self.log.items():
            if s <= self.step:
                self.committed.update(gids)

    @rule()
    def rewind(self):
        step, version = self.ckpt
        self.run(self.buf.recover(step, version, f"file:///w/{version}", "c"))
        self.log = {s: g for s, g in self.log.items() if s <= step}
        self.step = step
        self.open_batch = None

    # ------------------------------------------------------------------ invariants
    @invariant()
    def books_balance(self):
        if self.buf is None:
            return
        buf, p = self.buf, self.buf.prefix
        trained = [g for s in sorted(self.log) for g in self.log[s]]
        assert len(trained) == len(set(trained)), f"trained twice: {trained}"

        async def read():
            live = {x.decode() for x in await buf.redis.zrange(p + "groups", 0, -1)}
            pending = [x.decode() for x in await buf.redis.lrange(p + "pending", 0, -1)]
            dropped = await buf.dropped_groups()
            queues = {q: {x.decode() for x in await buf.redis.zrange(p + q, 0, -1)} for q in QUEUES}
            groups = {g: await buf.get_group(g) for g in live}
            return live, pending, dropped, queues, groups

        live, pending, dropped, queues, groups = self.run(read())
        assert len(pending) == len(set(pending)) and not live & set(pending)
        places = [live, set(pending), set(dropped), self.committed]
        for a, b in itertools.combinations(places, 2):
            assert not a & b, (a & b)
        assert set().union(*places) == set(self.fed), (set(self.fed) ^ set().union(*places))
        assert not set(trained) & set(dropped)
        for gid, (group, samples) in groups.items():
            assert [s.index for s in samples] == list(range(group.n_samples))
            for s in samples:
                member = {q for q in QUEUES if s.sample_id in queues[q]}
                allowed = STATUS_QUEUES[s.status.value]
                assert len(member) <= 1 and member <= allowed and (member or not allowed), (s.sample_id, s.status, member)
                assert s.response_ids == want(s.sample_id)[: len(s.response_ids)], s.sample_id
                assert len(s.versions) == len(s.behaviour_logprobs) == len(s.response_ids)


def test_buffer_state_machine(redis_url):
    BufferMachine.redis_url = redis_url
    run = BufferMachine.TestCase
    run.settings = settings(max_examples=30, stateful_step_count=40, deadline=None,
                            suppress_health_check=list(HealthCheck))
    run().runTest()
