"""The cost of the sample timeline (issue 30): buffer transitions with and without recording, one process.

Each round runs the life of G groups (n = 8 samples, 200-token responses in 16-token chunks, a park at
the budget of 128 tokens and an idle resume for each) through every script that records an event — feed, claim,
append, end_segment, score, next_batch, acknowledge, commit — on two runs of the same local
redis-server (AOF everysec, as ``asyncrl train`` starts it): one opened with ``timeline=True`` (the
default; its commit also exports to a temporary trace directory, as the trainer does) and one with
``timeline=False`` (the scripts get an empty origin and record nothing). The two alternate round by
round so machine load hits both alike; the median round time of each and their ratio are printed.

The bar (issue 30): the main job's step must not slow by more than 2%. The main job's buffer work is a
small part of its step (the trainer's step is seconds; the buffer's scripts are milliseconds), so the
ratio printed here bounds the buffer's share of the cost from above. The wall-clock ratio includes
the client (Python) and is noisy on a loaded machine; the second ratio is the time Redis itself spent
in the scripts (``INFO commandstats``), which is what the recording adds to.

usage: python bench/trace_overhead.py [--rounds 10] [--groups 8] [--json out.json]
Not a test: run it once, on a quiet machine if possible.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.controller.redis_server import RedisServer  # noqa: E402
from asyncrl.core.types import WorkKind  # noqa: E402
from buffers import BufferSettings, ReplayBuffer  # noqa: E402

N = 8
LEN = 200
CHUNK = 16
BUDGET = 128


async def _life(buf: ReplayBuffer, groups: int, step: int, trace_dir: Path | None) -> float:
    """One round: feed, generate (half parked at the budget and resumed), score, batch, ack, commit."""
    start = time.perf_counter()
    cur = await buf.dataset_cursor()
    await buf.feed([buf.make_group(f"r{step}g{i}", list(range(1, 33))) for i in range(groups)], cur)
    version = await buf.clock.version()

    async def work(it) -> None:
        while True:
            if it.kind is WorkKind.GENERATE:
                target = min(LEN, it.length_tokens + it.max_new_tokens)
                while it.length_tokens + CHUNK < target:
                    await buf.append(it, [7] * CHUNK, [-0.5] * CHUNK, [version] * CHUNK)
                n = target - it.length_tokens
                reason = "stop" if target >= LEN else "budget"  # M = 128 < 200: every sample parks once
                status = await buf.end_segment(it, reason, [7] * n, [-0.5] * n, [version] * n)
                if status.value != "complete":
                    return
            await buf.score(it, reward=float(it.index % 2))
            return

    while True:
        items = await buf.claim("bench", 64)
        if not items:
            if await buf.only_ready_left():
                break
            continue
        await asyncio.gather(*(work(it) for it in items))
    batch = await buf.next_batch(step, min_groups=1)
    while batch is not None:
        await buf.acknowledge(batch, step)
        step += 1
        batch = await buf.next_batch(step, min_groups=1)
    await buf.commit(step)
    if trace_dir is not None:
        await buf.export_timeline(trace_dir)
    return time.perf_counter() - start


async def run(rounds: int, groups: int, export: bool = True) -> dict:
    """Alternate rounds on a recording and a non-recording run; returns the timings and their ratio."""
    with tempfile.TemporaryDirectory() as d, RedisServer(Path(d) / "redis") as server:
        kw = dict(rollout_batch_size=groups, train_batch_groups=groups, n_samples_per_prompt=N,
                  max_budget=BUDGET, max_response_len=LEN, max_staleness=1000, lease_seconds=60.0)
        on = await ReplayBuffer.open(server.url, "on", BufferSettings(**kw), role="bench", timeline=True)
        off = await ReplayBuffer.open(server.url, "off", BufferSettings(**kw), role="bench", timeline=False)
        times: dict[str, list[float]] = {"on": [], "off": []}
        server: dict[str, list[float]] = {"on": [], "off": []}  # seconds Redis spent in the scripts
        step = {"on": 0, "off": 0}
        try:
            for r in range(rounds + 1):  # round 0 warms up both
                for name, buf in (("off", off), ("on", on)) if r % 2 else (("on", on), ("off", off)):
                    before = await _script_usec(buf)
                    t = await _life(buf, groups, step[name] * 1000, Path(d) / "trace" if name == "on" and export else None)
                    step[name] += 1
                    if r > 0:
                        times[name].append(t)
                        server[name].append((await _script_usec(buf) - before) / 1e6)
        finally:
            await on.close()
            await off.close()
    med_on, med_off = statistics.median(times["on"]), statistics.median(times["off"])
    srv_on, srv_off = statistics.median(server["on"]), statistics.median(server["off"])
    return {"server_s_on": srv_on, "server_s_off": srv_off, "server_ratio_on_over_off": srv_on / srv_off,"rounds": rounds, "groups": groups, "samples_per_round": groups * N,
            "median_s_on": med_on, "median_s_off": med_off, "ratio_on_over_off": med_on / med_off,
            "times_on": times["on"], "times_off": times["off"]}


async def _script_usec(buf: ReplayBuffer) -> int:
    """Microseconds Redis has spent running scripts (``INFO commandstats``, evalsha + eval), all runs."""
    info = await buf.redis.info("commandstats")
    return sum(int(v.get("usec", 0)) for k, v in info.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


def main() -> None:
    """Parse the flags, run, print the ratio (and write ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-export", action="store_true", help="measure the recording in Redis only (no file export)")
    a = p.parse_args()
    res = asyncio.run(run(a.rounds, a.groups, export=not a.no_export))
    print(f"{res['samples_per_round']} sample lives per round, {a.rounds} rounds each: "
          f"median {res['median_s_off'] * 1e3:.1f} ms without the timeline, {res['median_s_on'] * 1e3:.1f} ms with it "
          f"({'export included' if not a.no_export else 'no export'}): ratio {res['ratio_on_over_off']:.3f}")
    print(f"time Redis spent in the scripts per round: {res['server_s_off'] * 1e3:.1f} ms without, "
          f"{res['server_s_on'] * 1e3:.1f} ms with the timeline: ratio {res['server_ratio_on_over_off']:.3f}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
