"""Rollout benchmark, part (b): partial rollout against waiting for the whole batch.

Same engine (the embedded server with SmolLM2-135M-Instruct, one process, ``--threads``
torch threads), same rollout worker (:class:`rollout_server.worker.RolloutWorker`) with the same
number of requests in flight, same prompt stream and the same response lengths; only the
partial-rollout knobs differ:

* ``partial``: ``--partial_percent 0.7 --max_budget 64`` (B = ceil(0.7 R) groups per train
  batch; at most 64 new tokens per sample per policy version; ``max_staleness`` =
  ``--partial_staleness``, large enough for a longest answer to span ceil(L / 64) versions);
* ``sync``: ``--partial_percent 1 --max_budget L`` (L = ``max_response_len``) with
  ``max_staleness 0``: the trainer waits for the whole rollout batch, plain synchronous RL.

**Heavy-tailed response lengths.** Every sample gets a target length drawn from a Pareto
distribution truncated to the response cap, ``len = min(L, floor(x_m * U**(-1/alpha)))`` with
``U ~ Uniform(0, 1]``, ``x_m = --min_len`` (16) and ``alpha = --alpha`` (1.1), seeded, the same
sequence in both modes: most answers are short (median about 30 tokens) and a few hit ``L``
(256). Lengths are induced, not left to the model: requests carry ``ignore_eos`` and the
benchmark's worker treats reaching the target as the end of the answer (``stop``), so the
model's own EOS does not make the two runs differ.

**Simulated trainer.** Every ``--train_seconds`` seconds it asks the buffer for the next
train batch (``next_batch``); if one is READY it takes it, counts the response tokens of every
sample in it (only samples handed to the trainer count), acknowledges and commits the step and
publishes a new policy version; otherwise it waits for the next tick. Publishing is real for
the rollout side — the worker sees the clock move, pauses the engine (mode ``abort``: in-flight
requests end and are resumed with their KV recomputed), loads the announced directory with
``/update_weights_from_disk`` and continues — but the announced directory holds only
``model.norm.weight`` (unchanged values), so the load itself does not copy 540 MB per version
(a GPU deployment would sync in well under a second).

**Modes run at the same time**, each on its own identical engine process (same model, flags,
``--threads`` torch threads, same number of requests in flight), so the shared machine's
background load hits all of them alike. ``sync`` and ``partial`` pause the engine ``in_place``
for a new version (the weights do not change here, so this is exact, and on a CPU it avoids
re-prefilling every in-flight request per version); ``partial_abort`` is ``partial`` with the
default pause mode ``abort`` (every in-flight request is ended and resumed with its KV cache
recomputed), to show what that costs on a CPU.

The figure: completed tokens per second delivered to the trainer (tokens of the samples in the
batches it took), over ``--duration_seconds`` of wall time after a warm-up, for each mode, and
the ratio to ``sync`` (target >= 1.5). Each mode also reports the engine's own generation
rate and how many requests were running on it on average (``/v1/loads`` every 0.25 s): the
straggler tail of a synchronous batch shows up as few running requests.

Run: ``python bench/rollout_partial_bench.py [--model smollm2-135m-instruct]
[--duration_seconds 600] [--inflight 16] [--verbose] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def target_lengths(n: int, seed: int, min_len: int, alpha: float, cap: int) -> list[int]:
    """``n`` heavy-tailed target response lengths (truncated Pareto, see the module docstring)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = 1.0 - rng.random()  # (0, 1]
        out.append(max(1, min(cap, int(min_len * u ** (-1.0 / alpha)))))
    return out


def make_worker_class():
    from rollout_server.worker import RolloutWorker

    class TargetLengthWorker(RolloutWorker):
        """A rollout worker whose samples 'emit EOS' at the target length in their metadata."""

        def _target(self, item) -> int:
            return int(item.metadata["target_lengths"][item.index])

        def sampling_params(self, item) -> dict:
            params = super().sampling_params(item)
            params["max_new_tokens"] = max(1, min(params["max_new_tokens"], self._target(item) - len(item.response_ids)))
            return params

        def finish_reason(self, item, engine_finish, response_len):
            if engine_finish == "length" and response_len >= self._target(item):
                return "stop"
            return super().finish_reason(item, engine_finish, response_len)

    return TargetLengthWorker


async def run_mode(mode: str, a: Any, url: str, redis_url: str, tokenizer: Any, weights_dir: Path,
                   prompts: list[list[int]]) -> dict:
    """One measurement: feeder + worker + simulated trainer for ``a.duration_seconds``."""
    from asyncrl.tasks.rewards import RewardScorer
    from asyncrl.core.types import PromptGroup
    from buffers import BufferSettings, ReplayBuffer
    from rollout_server.client import EngineClient
    from rollout_server.worker import WorkerOptions

    L = a.max_response_len
    pause_mode = "abort" if mode.endswith("_abort") else a.pause_mode
    if mode.startswith("partial"):
        settings = BufferSettings.from_partial_percent(
            a.rollout_batch_size, a.partial_percent, n_samples_per_prompt=a.n_samples, max_budget=a.max_budget,
            max_response_len=L, max_staleness=a.partial_staleness, lease_seconds=30.0, flush_tokens=16)
    else:
        settings = BufferSettings.from_partial_percent(
            a.rollout_batch_size, 1.0, n_samples_per_prompt=a.n_samples, max_budget=L,
            max_response_len=L, max_staleness=0, lease_seconds=30.0, flush_tokens=16)
    run = f"bench-{mode}-{os.getpid()}"
    buf = await ReplayBuffer.open(redis_url, run, settings)
    lengths = target_lengths(100_000, a.seed, a.min_len, a.alpha, L)
    stop = asyncio.Event()

    async def feeder() -> None:
        cursor = 0
        while not stop.is_set():
            missing = settings.rollout_batch_size - await buf.pending_groups()
            if missing > 0:
                groups = []
                for c in range(cursor, cursor + missing):
                    tl = lengths[c * a.n_samples:(c + 1) * a.n_samples]
                    groups.append(PromptGroup(f"p{c:07d}", prompts[c % len(prompts)], {"target_lengths": tl}, a.n_samples))
                await buf.feed(groups, cursor)
                cursor += missing
            await asyncio.sleep(0.05)

    Worker = make_worker_class()
    opts = WorkerOptions(f"bench-{mode}", temperature=1.0, max_inflight_requests=a.inflight, pause_mode=pause_mode,
                         extra_sampling_params={"ignore_eos": True}, version_poll_seconds=0.05)
    client = EngineClient(url)
    await client.update_weights_from_disk(str(weights_dir / "v000000"), weight_version="0")
    worker = Worker(buf, client, RewardScorer("format"), tokenizer, opts)
    result = {"mode": mode, "pause_mode": pause_mode, "train_batch_groups": settings.train_batch_groups, "max_budget": settings.max_budget,
              "max_staleness": settings.max_staleness, "batches": 0, "samples": 0, "tokens": 0,
              "staleness": [], "batch_times": []}

    async def trainer(t_start: float) -> None:
        step = 0
        next_tick = t_start + a.train_seconds
        while not stop.is_set():
            await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
            next_tick += a.train_seconds
            batch = await buf.next_batch(step)
            if batch is None:
                continue
            now = time.monotonic()
            if now - t_start >= a.warmup_seconds:
                result["batches"] += 1
                result["batch_times"].append(round(now - t_start, 2))
                for g in batch.groups:
                    result["staleness"].append(g.staleness)
                    for s in g.samples:
                        result["samples"] += 1
                        result["tokens"] += len(s.response_ids)
            await buf.acknowledge(batch, step)
            await buf.commit(step)
            step += 1
            link = weights_dir / mode / f"v{step:06d}"
            link.parent.mkdir(exist_ok=True)
            link.symlink_to(weights_dir / "v000000")
            await buf.clock.publish(step, str(link), "")
            if a.verbose:
                print(f"[{time.monotonic() - t_start:6.1f}s] {mode}: step {step}, {result['batches']} batches, "
                      f"{result['tokens']} tokens counted", flush=True)

    occupancy: list[int] = []
    occupancy_missed = [0]

    async def sample_occupancy(t_start: float) -> None:
        """Requests running on the engine (``/v1/loads`` num_running_reqs), every 0.25 s after warm-up."""
        while not stop.is_set():
            await asyncio.sleep(0.25)
            if time.monotonic() - t_start >= a.warmup_seconds:
                try:
                    loads = await client.loads()
                except Exception:  # a busy engine may not answer in time: counted, reported
                    occupancy_missed[0] += 1
                    continue
                occupancy.append(int(loads["num_running_reqs"]))

    t0 = time.monotonic()
    tasks = [asyncio.create_task(feeder()), asyncio.create_task(trainer(t0)),
             asyncio.create_task(sample_occupancy(t0))]
    wtask = asyncio.create_task(worker.run(stop))
    done, _ = await asyncio.wait([*tasks, wtask], timeout=a.warmup_seconds + a.duration_seconds,
                                 return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    for t in tasks:
        t.cancel()
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()
    await asyncio.gather(*tasks, return_exceptions=True)
    stats = await wtask
    if done:
        raise RuntimeError(f"{mode}: a benchmark task ended early: {done}")
    await client.close()
    window = a.duration_seconds
    result.update({
        "tokens_per_second": result["tokens"] / window,
        "engine_tokens_per_second": stats.generated_tokens / (time.monotonic() - t0),
        "weight_updates": stats.weight_updates, "segments": stats.segments,
        "parked_budget": stats.parked_budget, "parked_abort": stats.parked_abort,
        "mean_running_requests": (sum(occupancy) / len(occupancy)) if occupancy else 0.0,
        "running_requests_samples": len(occupancy), "running_requests_samples_missed": occupancy_missed[0],
        "mean_staleness": (sum(result["staleness"]) / len(result["staleness"])) if result["staleness"] else 0.0,
    })
    buf_stats = await buf.stats()
    result["dropped_by_reason"] = buf_stats["dropped_by_reason"]
    result["restarted_by_reason"] = buf_stats["restarted_by_reason"]
    await buf.drain()
    await buf.close()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    ap.add_argument("--inflight", type=int, default=16, help="requests in flight (both modes)")
    ap.add_argument("--rollout_batch_size", type=int, default=8, help="R, prompt groups per rollout batch")
    ap.add_argument("--n_samples", type=int, default=2, help="samples per prompt group")
    ap.add_argument("--partial_percent", type=float, default=0.7)
    ap.add_argument("--max_budget", type=int, default=64)
    ap.add_argument("--partial_staleness", type=int, default=4)
    ap.add_argument("--max_response_len", type=int, default=128)
    ap.add_argument("--min_len", type=int, default=8, help="Pareto scale x_m (shortest answers)")
    ap.add_argument("--alpha", type=float, default=1.1, help="Pareto tail index (smaller: heavier tail)")
    ap.add_argument("--train_seconds", type=float, default=2.0, help="the simulated trainer takes a batch every this many seconds")
    ap.add_argument("--warmup_seconds", type=float, default=20.0)
    ap.add_argument("--duration_seconds", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=["sync", "partial", "partial_abort"],
                    help="sync, partial (pause --pause_mode), partial_abort (pause mode abort)")
    ap.add_argument("--pause_mode", default="in_place", choices=["abort", "in_place"],
                    help="pause mode of the sync and partial modes (the weights do not change, so in_place is exact here)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--verbose", action="store_true", help="print every train step")
    ap.add_argument("--sequential", action="store_true",
                    help="one engine, modes one after the other (default: all at once, one engine each)")
    a = ap.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    from asyncrl.models import load_tokenizer, resolve_model_path
    from asyncrl.controller.redis_server import RedisServer
    from rollout_server.testing import start_embedded_server

    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    prompts = []
    for i in range(64):
        msgs = [{"role": "user", "content": f"What is {17 + i} + {29 * (i + 3)}? Answer briefly."}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    lengths = target_lengths(4000, a.seed, a.min_len, a.alpha, a.max_response_len)
    srt = sorted(lengths)
    dist = {"median": srt[len(srt) // 2], "mean": round(sum(srt) / len(srt), 1), "p90": srt[int(0.9 * len(srt))],
            "share_at_cap": round(sum(x == a.max_response_len for x in srt) / len(srt), 3)}
    print(f"target lengths: {dist}", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-partial-bench-"))
    weights = tmp / "weights"
    (weights / "v000000").mkdir(parents=True)
    from safetensors.torch import load_file, save_file

    state = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update({k: v for k, v in load_file(str(f)).items() if k == "model.norm.weight"})
    save_file(state, str(weights / "v000000" / "model.safetensors"))
    (weights / "v000000" / "config.json").write_text((Path(path) / "config.json").read_text())

    redis = RedisServer(tmp / "redis").start()
    flags = ("--incremental-streaming-output", "--max-running-requests", str(max(64, a.inflight)))
    # one engine per mode, identical (same model, flags, threads); the modes run at the same time
    # so that the machine's background load hits both alike
    servers = [start_embedded_server(path, *flags, threads=a.threads) for _ in (a.modes[:1] if a.sequential else a.modes)]

    async def all_modes() -> list[dict]:
        if a.sequential:  # one engine, the modes one after the other
            return [await run_mode(m, a, servers[0].url, redis.url, tok, weights, prompts) for m in a.modes]
        return list(await asyncio.gather(*(run_mode(m, a, s.url, redis.url, tok, weights, prompts)
                                           for m, s in zip(a.modes, servers))))

    try:
        results = asyncio.run(all_modes())
        for r in results:
            mode = r["mode"]
            print(f"{mode:13s} pause={r['pause_mode']:8s} B={r['train_batch_groups']} M={r['max_budget']} eta={r['max_staleness']}: "
                  f"{r['batches']} batches, {r['samples']} samples, {r['tokens']} tokens -> "
                  f"{r['tokens_per_second']:.1f} tok/s to the trainer (engine {r['engine_tokens_per_second']:.1f} tok/s, "
                  f"mean staleness {r['mean_staleness']:.2f}, {r['mean_running_requests']:.1f} requests running on average "
                  f"({r['running_requests_samples']} samples, {r['running_requests_samples_missed']} missed), "
                  f"{r['weight_updates']} weight updates, "
                  f"dropped {r['dropped_by_reason']}, restarted {r['restarted_by_reason']})", flush=True)
    finally:
        for srv in servers:
            srv.stop()
        redis.kill()
    by = {r["mode"]: r for r in results}
    from bench._report import record_path

    out: dict[str, Any] = {"model": record_path(path), "threads": a.threads, "sequential": a.sequential, "inflight": a.inflight,
                           "rollout_batch_size": a.rollout_batch_size, "n_samples": a.n_samples,
                           "max_response_len": a.max_response_len, "length_distribution": dist,
                           "pareto": {"x_m": a.min_len, "alpha": a.alpha}, "train_seconds": a.train_seconds,
                           "duration_seconds": a.duration_seconds, "cpu_count": os.cpu_count(),
                           "load_average": os.getloadavg(), "results": results}
    if "sync" in by and by["sync"]["tokens_per_second"] > 0:
        for m in by:
            if m != "sync":
                out[f"speedup_{m}"] = by[m]["tokens_per_second"] / by["sync"]["tokens_per_second"]
                print(f"speedup {m} / sync: {out[f'speedup_{m}']:.2f}x", flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
