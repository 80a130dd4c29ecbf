"""Crash safety with real ``kill -9``: feeder, rollout workers, trainer and redis-server itself.

Each round runs real processes (tests/buffer_procs/) against the real redis-server of the
fixture: a feeder, two rollout workers and a trainer, each killed with SIGKILL at a seeded
crash point (right after an acknowledged write, between a chunk flush and the segment's
end, between COMPLETE and its score, between handing out a batch and acknowledging it,
after acknowledging, after publishing, between checkpoint and commit). Dead processes are
restarted; in some rounds redis-server is SIGKILLed and restarted from its AOF. After each
round the books must balance exactly: groups fed = groups trained once in the surviving
lineage (the trainer's last checkpoint) + groups dropped with a reason; every trained
sample holds exactly the generator's tokens (none lost or duplicated); nothing is left.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buffers import ReplayBuffer

PROCS = Path(__file__).resolve().parent / "buffer_procs"
WORKER_KINDS = ["after_append", "before_end", "after_complete"]
TRAINER_KINDS = ["after_batch", "after_ack", "after_publish", "after_checkpoint"]
TOTAL = 12


def _spawn(script: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(PROCS / script), *map(str, args)],
        cwd=PROCS, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def run_round(redis_server, tmp_path: Path, seed: int, kill_redis: bool) -> dict:
    """One seeded round; returns the reconciliation numbers (asserts inside)."""
    rng = random.Random(seed)
    url, run = redis_server.url, f"crash{seed}"
    ckpt = tmp_path / f"ckpt{seed}.json"
    wkind = WORKER_KINDS[seed % len(WORKER_KINDS)]
    tkind = TRAINER_KINDS[seed % len(TRAINER_KINDS)]
    specs = {
        "feeder": ["feeder.py", url, run, TOTAL],
        "w0": ["worker.py", url, run, "w0"],
        "w1": ["worker.py", url, run, "w1"],
        "trainer": ["trainer.py", url, run, TOTAL, ckpt, 2],
    }
    crashes = {"feeder": ("after_feed", rng.randint(1, 4)), "w0": (wkind, rng.randint(1, 12)),
               "w1": (rng.choice(WORKER_KINDS), rng.randint(1, 20)), "trainer": (tkind, rng.randint(1, 3))}
    procs = {name: _spawn(*spec, *crashes[name]) for name, spec in specs.items()}
    kills = {name: 0 for name in specs}
    redis_kill_at = time.monotonic() + rng.uniform(0.05, 1.0) if kill_redis else None
    deadline = time.monotonic() + 40
    try:
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(f"round {seed} did not finish: kills {kills}; buffer: {asyncio.run(_stats(url, run))}")
            t = procs["trainer"].poll()
            if t == 0:
                break
            for name, p in procs.items():
                rc = p.poll()
                # the feeder ends when it has fed; the trainer may finish between the poll above
                # and this one (the next pass breaks out)
                if rc is None or (name in ("feeder", "trainer") and rc == 0):
                    continue
                if rc != -signal.SIGKILL:
                    err = p.stderr.read() if p.stderr else ""
                    raise AssertionError(f"round {seed}: {name} exited with {rc}: {err[-3000:]}")
                kills[name] += 1
                procs[name] = _spawn(*specs[name], "none", 0)  # restart; no second crash
            # Kill redis at a seeded moment, or at the latest once the first checkpoint (step 2
            # of 6) exists, so the kill always lands mid-round however fast the machine is.
            if redis_kill_at is not None and (time.monotonic() > redis_kill_at or ckpt.exists()):
                redis_server.kill()  # SIGKILL: everything acknowledged is in the AOF (kernel page cache)
                time.sleep(0.1)
                redis_server.start()
                kills["redis"] = 1
                redis_kill_at = None
            time.sleep(0.02)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stderr:
                p.stderr.close()
    return asyncio.run(reconcile(url, run, ckpt, kills))


async def _stats(url: str, run: str) -> dict:
    buf = await ReplayBuffer.open(url, run)
    try:
        return await buf.stats()
    finally:
        await buf.close()


async def reconcile(url: str, run: str, ckpt_path: Path, kills: dict) -> dict:
    data = json.loads(ckpt_path.read_text())
    trained = [g for step in sorted(data["trained"], key=int) for g in data["trained"][step]]
    buf = await ReplayBuffer.open(url, run)
    try:
        dropped = await buf.dropped_groups()
        fed = [f"q{i:04d}" for i in range(TOTAL)]
        assert await buf.dataset_cursor() == TOTAL
        assert len(trained) == len(set(trained)), f"a group was trained twice: {trained}"
        assert not set(trained) & set(dropped), "a group was both trained and dropped"
        assert sorted(trained + list(dropped)) == fed, (trained, dropped)
        assert all(reason for reason in dropped.values())
        st = await buf.stats()
        assert st["queues"]["live_groups"] == 0 and st["groups_by_state"]["pending"] == 0, st
        assert st["counters"]["fed"] == TOTAL  # the feeder neither skipped nor repeated
        assert sum(st["dropped_by_reason"].values()) == len(dropped)
        books = await buf.books()
        assert books["balanced"] and books["committed_groups"] == len(trained), books
        return {"trained": len(trained), "dropped": len(dropped), "kills": kills, "lineage": st["lineage"]}
    finally:
        await buf.close()


def test_crash_rounds_quick(redis_server, tmp_path):
    """Two rounds (one with a redis-server kill) in the default suite."""
    r1 = run_round(redis_server, tmp_path, seed=1, kill_redis=False)
    r2 = run_round(redis_server, tmp_path, seed=2, kill_redis=True)
    assert r1["kills"]["w0"] + r1["kills"]["trainer"] >= 1
    assert r2["kills"].get("redis") == 1


def test_crash_round_with_best_of_n_and_dynamic_sampling(redis_server, tmp_path, monkeypatch):
    """One round (with a redis-server kill) where groups generate 3 samples, train the best 2 and
    groups with equal kept rewards are dropped (zero_variance): the books still balance."""
    monkeypatch.setenv("ASYNCRL_TEST_SAMPLING", "1")
    r = run_round(redis_server, tmp_path, seed=3, kill_redis=True)
    st = asyncio.run(_stats(redis_server.url, "crash3"))
    assert st["settings"]["generation_size"] == 3 and st["counters"]["discarded_best_of_n"] > 0, st
    assert st["counters"]["finished_groups"] >= r["trained"], st
    # rewards depend only on the sample id: 7 of the 12 groups have equal best two
    assert st["dropped_by_reason"].get("zero_variance") == 7, st
    assert r["trained"] + r["dropped"] == TOTAL


@pytest.mark.slow
def test_crash_rounds_seeded(redis_server, tmp_path):
    """20 seeded rounds; every third one also kills redis-server. Every crash kind is exercised."""
    totals = {"worker": 0, "trainer": 0, "feeder": 0, "redis": 0, "lineage_bumps": 0}
    for seed in range(100, 120):
        r = run_round(redis_server, tmp_path, seed, kill_redis=seed % 3 == 0)
        totals["worker"] += r["kills"]["w0"] + r["kills"]["w1"]
        totals["trainer"] += r["kills"]["trainer"]
        totals["feeder"] += r["kills"]["feeder"]
        totals["redis"] += r["kills"].get("redis", 0)
        totals["lineage_bumps"] += r["lineage"]
    assert totals["worker"] >= 20 and totals["trainer"] >= 10 and totals["redis"] == 6, totals
    assert totals["lineage_bumps"] >= 1, totals
