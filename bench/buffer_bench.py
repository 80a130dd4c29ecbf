"""Replay-buffer throughput: the full sample life cycle against a local Redis (AOF everysec).

Life cycle measured: claim -> append 16-token chunks -> complete (the last chunk and the end
of the segment in one script) -> score -> group READY -> batch -> acknowledge -> commit.
Response lengths are drawn from a log-normal distribution with mean 200 tokens
(sigma = 1, mu = ln 200 - 0.5), rounded up and capped at 2048; n = 8 samples per group.
W concurrent workers are asyncio tasks in one process sharing one ``ReplayBuffer``
(R = max(8, W) groups in flight, B = max(1, W / 8) groups per train batch, eta large so
admission never idles a worker); one feeder task keeps R groups pending, one trainer task takes batches, acknowledges, publishes a
version every step and commits every step. Then, against the same server, a plain pipelined
``XADD`` loop (one 16-token entry per XADD, 1,000 per pipeline) gives the ceiling.

usage: python bench/buffer_bench.py [--seconds 8] [--workers 1,8,64] [--json out.json]
Not a test: run it once, on an otherwise quiet machine if possible.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.controller.redis_server import RedisServer  # noqa: E402
from buffers import BufferSettings, ReplayBuffer  # noqa: E402

CHUNK = 16
MAX_LEN = 2048
MEAN_LEN = 200


def response_length(rng: random.Random) -> int:
    """Log-normal with mean 200 tokens, capped at 2048."""
    mu = math.log(MEAN_LEN) - 0.5
    return max(1, min(MAX_LEN, math.ceil(rng.lognormvariate(mu, 1.0))))


async def lifecycle(url: str, run: str, workers: int, seconds: float, seed: int) -> dict:
    settings = BufferSettings(
        rollout_batch_size=max(8, workers), train_batch_groups=max(1, workers // 8),
        n_samples_per_prompt=8, max_budget=MAX_LEN, max_response_len=MAX_LEN, max_staleness=1000,
        stale_policy="keep", lease_seconds=60, flush_tokens=CHUNK,
    )
    buf = await ReplayBuffer.open(url, run, settings, max_connections=workers + 8)
    stop = asyncio.Event()
    counters = {"tokens": 0, "samples": 0, "committed_samples": 0, "steps": 0}

    async def feeder() -> None:
        cur = await buf.dataset_cursor()
        while not stop.is_set():
            if await buf.pending_groups() < settings.rollout_batch_size:
                groups = [buf.make_group(f"p{cur + i}", [1] * 64) for i in range(8)]
                cur = await buf.feed(groups, cur)
            else:
                await asyncio.sleep(0.005)

    async def worker(wid: int) -> None:
        rng = random.Random(seed * 1000 + wid)
        while not stop.is_set():
            items = await buf.claim(f"w{wid}", 1)
            if not items:
                await asyncio.sleep(0.01)
                continue
            it = items[0]
            length = response_length(rng)
            ids = [rng.randrange(32000) for _ in range(CHUNK)]
            lps = [-1.0] * CHUNK
            vers = [it.clock_version] * CHUNK
            pos = 0
            while length - pos > CHUNK:
                await buf.append(it, ids, lps, vers)
                pos += CHUNK
            n = length - pos
            await buf.end_segment(it, "stop", ids[:n], lps[:n], vers[:n])
            await buf.score(it, reward=1.0)
            counters["tokens"] += length
            counters["samples"] += 1

    async def trainer() -> None:
        step = 0
        while not stop.is_set():
            batch = await buf.next_batch(step + 1)
            if batch is None:
                await asyncio.sleep(0.002)
                continue
            step += 1
            await buf.acknowledge(batch, step)
            await buf.clock.publish(step, f"file:///w/{step}", "bench")
            await buf.commit(step)
            counters["committed_samples"] += sum(len(g.samples) for g in batch.groups)
            counters["steps"] = step

    tasks = [asyncio.create_task(feeder()), asyncio.create_task(trainer())]
    tasks += [asyncio.create_task(worker(i)) for i in range(workers)]
    await asyncio.sleep(min(3.0, seconds / 2))  # warm-up: fill the pipeline of R groups
    base = dict(counters)
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - t0
    snap = dict(counters)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await buf.drain()
    await buf.close()
    return {
        "workers": workers,
        "seconds": round(elapsed, 2),
        "appended_tokens_per_s": round((snap["tokens"] - base["tokens"]) / elapsed),
        "sample_lifecycles_per_s": round((snap["committed_samples"] - base["committed_samples"]) / elapsed, 1),
        "completed_samples_per_s": round((snap["samples"] - base["samples"]) / elapsed, 1),
        "train_steps": snap["steps"],
        "mean_tokens_per_sample": round((snap["tokens"] - base["tokens"]) / max(1, snap["samples"] - base["samples"]), 1),
    }


async def xadd_ceiling(url: str, seconds: float) -> dict:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(url, decode_responses=False)
    payload = bytes(4 * CHUNK)
    entries = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        async with r.pipeline(transaction=False) as pipe:
            for _ in range(1000):
                pipe.xadd("bench:ceiling", {"ids": payload, "lps": payload, "vers": payload}, maxlen=100_000, approximate=True)
            await pipe.execute()
        entries += 1000
    elapsed = time.perf_counter() - t0
    await r.delete("bench:ceiling")
    await r.aclose()
    return {"xadd_per_s": round(entries / elapsed), "tokens_per_s": round(entries * CHUNK / elapsed)}


async def amain(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as d, RedisServer(Path(d) / "redis") as server:
        results = {"distribution": "lognormal(mu=ln(200)-0.5, sigma=1), ceil, capped at 2048; n=8 per group",
                   "lifecycle": [], "redis": "appendonly yes, appendfsync everysec"}
        for w in args.workers:
            res = await lifecycle(server.url, f"bench{w}", w, args.seconds, seed=w)
            print(json.dumps(res), flush=True)
            results["lifecycle"].append(res)
        ceiling = await xadd_ceiling(server.url, args.seconds / 2)
        print(json.dumps({"ceiling": ceiling}), flush=True)
        results["ceiling"] = ceiling
        for res in results["lifecycle"]:
            res["ratio_to_xadd_ceiling"] = round(res["appended_tokens_per_s"] / ceiling["tokens_per_s"], 3)
        return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per configuration")
    parser.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    results = asyncio.run(amain(args))
    for res in results["lifecycle"]:
        print(f"{res['workers']:>3} workers: {res['appended_tokens_per_s']:>8} appended tokens/s, "
              f"{res['sample_lifecycles_per_s']:>7} sample life cycles/s "
              f"({res['ratio_to_xadd_ceiling']:.1%} of the XADD ceiling)")
    print(f"ceiling: {results['ceiling']['xadd_per_s']} XADD/s = {results['ceiling']['tokens_per_s']} tokens/s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
