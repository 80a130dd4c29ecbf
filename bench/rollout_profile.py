"""Rollout profile: where a main-job rollout server's time goes, and its rate against the plain loop.

Runs a short main-job-like workload through the real parts and prints the rollout server's time
by component (docs/rollout.md, "Rollout profile"):

* **rollout server**: ``asyncrl rollout-server`` as its own process (the embedded engine and the
  rollout worker in one process, as ``asyncrl train`` starts it), with the run config
  (default ``configs/smollm2_arith.yaml``: SmolLM2-135M fp32, arithmetic, math-verify reward,
  8 prompts x 8 samples, ``pause_mode: in_place``, ``disk`` weights) and ``--threads`` engine threads;
* **feeder**: the real :class:`asyncrl.feeder.feeder.Feeder` on the run's prompt stream;
* **simulated trainer** (this process): waits for each train batch (``next_batch``), holds it
  ``--train_seconds`` (the optimizer step, without its CPU use), acknowledges and commits it, writes
  the full fp32 weights as the next version directory (:func:`asyncrl.core.weights.write_weights`,
  as the trainer's publisher does; the same values every time, so the sampling does not drift) and
  publishes it; ``--steps`` times.

Read at the end from the server's ``/metrics``: the engine thread's seconds by component
(``asyncrl_rollout_engine_seconds_total``, exclusive, they add up to the thread's lifetime), the
worker's (``asyncrl_rollout_worker_seconds_total``, summed over its concurrent tasks), the engine's
generated tokens, prompt tokens run through a prefill forward pass and prompts served by the prompt cache. The running requests are sampled from ``/v1/loads`` every 0.25 s.

**Against the plain loop.** In the same process after the workload, with the same torch threads,
``bench/rollout_bench.py``'s plain batched decode loop (:func:`bench.rollout_bench.ceiling`: one
prefill, ``--gen_tokens`` decode steps, no server) runs at the workload's mean concurrency
(rounded, at least 1) with prompts of its mean prompt length; the ratio is the server's
generated tokens per second over the whole workload (first claim to last step, idle time included)
divided by the loop's (target of issue 28, item 4: >= 0.7).

**Before/after in one invocation.** ``--compare REF`` runs the same workload first with the code
of git revision ``REF`` (a temporary ``git worktree`` of this repository; this script and its
config are used as they are), then with the working tree, one after the other, and prints both.
On a loaded machine alternate them (``--rounds 2``) and compare ratios, not absolute rates.

Run: ``python bench/rollout_profile.py [--config configs/smollm2_arith.yaml] [--steps 6]
[--threads 2] [--train_seconds 4] [--max_seconds 0] [--gen_tokens 128] [--compare main] [--rounds 1]
[--set rollout.engine_scheduler_delay_factor=4] [--json out.json]``; ``--weight_loads 4`` times 4 full weight loads on an idle server instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_metrics(text: str) -> dict[str, Any]:
    """The profile's series of a ``/metrics`` exposition: component seconds and generated tokens."""
    out: dict[str, Any] = {"engine": {}, "worker": {}, "parked": {}}
    for line in text.splitlines():
        m = re.match(r'^asyncrl_rollout_(engine|worker)_seconds_total\{component="(\w+)"\} (\S+)$', line)
        if m:
            out[m.group(1)][m.group(2)] = float(m.group(3))
        m = re.match(r"^sglang:(generation_tokens|prompt_tokens)_total\{[^}]*\} (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
        m = re.match(r"^asyncrl_rollout_(prefill_forward_tokens|prompt_cache_hits|context_cache_hits)_total (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
        m = re.match(r'^asyncrl_rollout_partial_parked_total\{reason="(\w+)"\} (\S+)$', line)
        if m:  # samples parked mid-answer; each resumes with its prompt and tokens so far prefilled again
            out["parked"][m.group(1)] = float(m.group(2))
    return out


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of process ``pid``: its main thread (the rollout server's event loop: HTTP
    streaming, the worker, the Redis client) and all its other threads (the engine thread, torch's
    OpenMP workers, executor threads), from ``/proc/<pid>/task/*/stat`` (utime + stime)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"event_loop_thread": 0.0, "other_threads": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of proc(5))
        out["event_loop_thread" if int(task.name) == pid else "other_threads"] += seconds
    return out


async def workload(a: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], Any, Any]:
    """Run the rollout server, feeder and simulated trainer for ``a.steps`` steps.

    Returns ``(measurements, model, tokenizer)`` (the model and tokenizer for the plain loop).
    """
    import aiohttp

    from asyncrl.controller.redis_server import RedisServer
    from asyncrl.core.config import load_config
    from asyncrl.core.net import free_port
    from asyncrl.core.weights import write_weights
    from asyncrl.feeder.feeder import Feeder
    from asyncrl.models import load_causal_lm, load_tokenizer, resolve_model_path
    from asyncrl.tasks.tasks import TrainPromptStream
    from buffers import BufferSettings, ReplayBuffer

    redis = RedisServer(tmp / "redis").start()
    port = free_port("127.0.0.1")
    flags = ["--config", str(a.config), "--run.name", f"profile-{os.getpid()}",
             "--rollout.base_port", str(port), "--rollout.engine_threads", str(a.threads),
             "--run.output_dir", str(tmp / "run"), "--weight_sync.dir", str(tmp / "weights")]
    flags += [x for item in a.set for x in ("--" + item.split("=", 1)[0], item.split("=", 1)[1])]
    cfg = load_config(flags, environ={**os.environ, "ASYNCRL_BUFFER__REDIS_URL": redis.url})
    path = resolve_model_path(cfg.model.path)
    tok = load_tokenizer(path)
    model = load_causal_lm(path, cfg.model.dtype)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    config_json = model.config.to_dict()
    buf = await ReplayBuffer.open(redis.url, cfg.run.name, BufferSettings.from_config(cfg))
    stream = TrainPromptStream(cfg.data, tok, seed=cfg.data.seed)
    feeder = Feeder(buf, stream, buf.settings.samples_generated, cfg.rollout.rollout_batch_size)
    log = open(tmp / "rollout_server.log", "wb")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=str(a.code_root))
    env["ASYNCRL_BUFFER__REDIS_URL"] = redis.url  # a secret: never on the command line
    from asyncrl.core.process_guard import pdeathsig_preexec  # the server never outlives this process

    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "rollout-server", *flags], stdout=log,
                            stderr=subprocess.STDOUT, env=env, cwd=str(a.code_root), preexec_fn=pdeathsig_preexec())
    url = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    running: list[int] = []
    res: dict[str, Any] = {"steps": [], "code": str(a.code_label)}
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 600
            while True:  # the server loads the model, then answers
                if proc.poll() is not None:
                    raise RuntimeError(f"the rollout server exited ({proc.returncode}); see {tmp / 'rollout_server.log'}")
                healthy = False
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):  # still loading: ask again
                    async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        healthy = r.status == 200
                if healthy:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the rollout server did not answer /health in 600 s")
                await asyncio.sleep(0.5)

            async def feed() -> None:
                while not stop.is_set():
                    await feeder.feed_once()
                    await asyncio.sleep(0.1)

            async def sample_loads() -> None:
                while not stop.is_set():
                    await asyncio.sleep(0.25)
                    # a sample the busy server does not answer in time is left out of the mean concurrency
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                        async with http.get(url + "/v1/loads", timeout=aiohttp.ClientTimeout(total=5)) as r:
                            running.append(int((await r.json())["loads"][0]["num_running_reqs"]))

            async def metrics() -> dict[str, Any]:
                async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
                    return parse_metrics(await r.text())

            helpers = [asyncio.create_task(feed()), asyncio.create_task(sample_loads())]
            m0 = await metrics()
            cpu0 = thread_cpu(proc.pid)
            t0 = time.monotonic()
            prompt_lens = [len(stream.get(c).prompt_ids) for c in range(64)]  # the run's prompts
            for step in range(a.steps):
                t_wait = time.monotonic()
                while (batch := await buf.next_batch(step)) is None:
                    if proc.poll() is not None:
                        raise RuntimeError(f"the rollout server exited; see {tmp / 'rollout_server.log'}")
                    if a.max_seconds and time.monotonic() - t0 > a.max_seconds:
                        break
                    await asyncio.sleep(0.02)
                if batch is None:  # --max_seconds: the rate is over the time used, steps or not
                    print(f"  [{res['code']}] stopped after {a.max_seconds:.0f} s (--max_seconds) in step {step + 1}",
                          file=sys.stderr, flush=True)
                    break
                wait = time.monotonic() - t_wait
                tokens = sum(len(s.response_ids) for g in batch.groups for s in g.samples)
                await asyncio.sleep(a.train_seconds)
                await buf.acknowledge(batch, step)
                await buf.commit(step)
                t_pub = time.monotonic()
                vdir, checksum = await asyncio.get_running_loop().run_in_executor(
                    None, lambda v=step + 1: write_weights(Path(cfg.weight_sync.dir), v, sd, config_json, keep_last=3))
                await buf.clock.publish(step + 1, str(vdir.resolve()), checksum)
                res["steps"].append({"wait_seconds": round(wait, 3), "response_tokens": tokens,
                                     "publish_seconds": round(time.monotonic() - t_pub, 3)})
                print(f"  [{res['code']}] step {step + 1}/{a.steps}: waited {wait:.2f} s for the batch "
                      f"({tokens} response tokens)", file=sys.stderr, flush=True)
            wall = time.monotonic() - t0
            m1 = await metrics()
            cpu1 = thread_cpu(proc.pid)
            stop.set()
            for t in helpers:
                t.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        await buf.close()
        redis.kill()
    gen = m1.get("generation_tokens", 0.0) - m0.get("generation_tokens", 0.0)
    res.update({
        "wall_seconds": wall, "generated_tokens": gen, "max_seconds": a.max_seconds, "tokens_per_second": gen / wall,
        "prompt_tokens": m1.get("prompt_tokens", 0.0) - m0.get("prompt_tokens", 0.0),
        # None: a revision whose server does not export them
        **{k: (m1[k] - m0.get(k, 0.0) if k in m1 else None)
           for k in ("prefill_forward_tokens", "prompt_cache_hits", "context_cache_hits")},
        "mean_running_requests": sum(running) / len(running) if running else 0.0,
        "mean_prompt_tokens": sum(prompt_lens) / max(1, len(prompt_lens)),
        "engine_seconds": {k: v - m0["engine"].get(k, 0.0) for k, v in m1["engine"].items()},
        "worker_seconds": {k: v - m0["worker"].get(k, 0.0) for k, v in m1["worker"].items()},
        "parked": {k: v - m0["parked"].get(k, 0.0) for k, v in m1["parked"].items()},
        "server_cpu_seconds": {k: v - cpu0[k] for k, v in cpu1.items()},
    })
    return res, model, tok


def one(a: argparse.Namespace) -> dict[str, Any]:
    """The workload, then the plain loop at its mean concurrency (same process, same threads)."""
    import torch

    from bench.rollout_bench import ceiling, make_prompts

    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-rollout-profile-"))
    try:
        res, model, tok = asyncio.run(workload(a, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    B = max(1, round(res["mean_running_requests"]))
    prompts = make_prompts(tok, B, max(1, round(res["mean_prompt_tokens"])))
    ceiling(model, prompts[:2], 4)  # warm
    ceil = max(ceiling(model, prompts, a.gen_tokens) for _ in range(max(1, a.loop_repeats)))
    # the loop as it sampled before 2026-11-29 (torch.multinomial), the bar of the earlier figures
    ceil_mn = max(ceiling(model, prompts, a.gen_tokens, sampler="multinomial") for _ in range(max(1, a.loop_repeats)))
    res.update({"loop_concurrency": B, "loop_tokens_per_second": ceil, "ratio": res["tokens_per_second"] / ceil,
                "loop_multinomial_tokens_per_second": ceil_mn, "ratio_multinomial": res["tokens_per_second"] / ceil_mn,
                "threads": a.threads, "load_average": os.getloadavg()})
    return res


def weight_loads(a: argparse.Namespace) -> list[dict[str, float]]:
    """``--weight_loads N``: time N full weight loads on an idle embedded server (the worker's
    ``pause(in_place)`` + ``/update_weights_from_disk`` + ``continue`` of a full fp32 version
    directory written by ``write_weights``), with the engine's ``weights`` seconds of each."""
    from asyncrl.core.config import load_config
    from asyncrl.core.weights import write_weights
    from asyncrl.models import load_causal_lm, resolve_model_path
    from rollout_server.client import EngineClient
    from rollout_server.testing import start_embedded_server

    cfg = load_config(["--config", str(a.config)])
    path = resolve_model_path(cfg.model.path)
    model = load_causal_lm(path, cfg.model.dtype)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-weight-loads-"))
    dirs = [write_weights(tmp, v, sd, model.config.to_dict())[0] for v in range(1, a.weight_loads + 1)]
    srv = start_embedded_server(path, threads=a.threads)

    async def run() -> list[dict[str, float]]:
        rows = []
        async with EngineClient(srv.url) as c:
            for v, d in enumerate(dirs, 1):
                before = (await c._call("GET", "/get_server_info")).get("engine_profile_seconds", {}).get("weights", 0.0)
                t0 = time.perf_counter()
                await c.pause("in_place")
                await c.update_weights_from_disk(str(d), weight_version=str(v))
                await c.resume()
                total = time.perf_counter() - t0
                after = (await c._call("GET", "/get_server_info")).get("engine_profile_seconds", {}).get("weights", 0.0)
                rows.append({"seconds": total, "engine_weights_seconds": after - before})
                print(f"load {v}: {total:.3f} s pause to continue, {after - before:.3f} s of it in the engine", flush=True)
        return rows

    try:
        return asyncio.run(run())
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def report(r: dict[str, Any]) -> None:
    """Print one run's numbers and component table."""
    steps = r["steps"]
    print(f"\n== {r['code']}: {len(steps)} steps in {r['wall_seconds']:.1f} s, {r['generated_tokens']:.0f} generated tokens "
          f"-> {r['tokens_per_second']:.1f} tok/s; plain loop at B={r['loop_concurrency']} "
          f"(mean running {r['mean_running_requests']:.1f}): {r['loop_tokens_per_second']:.1f} tok/s; "
          f"ratio {r['ratio']:.2f} (to the loop with torch.multinomial, the bar before 2026-11-29: "
          f"{r['loop_multinomial_tokens_per_second']:.1f} tok/s, {r['ratio_multinomial']:.2f}); trainer waited {sum(s['wait_seconds'] for s in steps) / max(1, len(steps)):.2f} s "
          f"per step; load average {r['load_average'][0]:.1f}")
    if r.get("prefill_forward_tokens") is not None:
        print(f"prompt tokens: {r['prompt_tokens']:.0f} in requests, {r['prefill_forward_tokens']:.0f} through a prefill "
              f"forward pass; {r['prompt_cache_hits']:.0f} prompts served by the prompt cache, "
              f"{r.get('context_cache_hits') or 0:.0f} from the context cache; samples parked "
              f"mid-answer (then resumed with their prompt and tokens so far prefilled again): "
              f"{', '.join(f'{k} {v:.0f}' for k, v in r.get('parked', {}).items()) or 'none'}")
    cpu = r.get("server_cpu_seconds", {})
    if cpu:
        print(f"rollout server CPU: event-loop thread {cpu['event_loop_thread']:.1f} s, other threads (engine, OpenMP, "
              f"executors) {cpu['other_threads']:.1f} s over {r['wall_seconds']:.1f} s of wall time")
    eng = r["engine_seconds"]
    total = sum(eng.values())
    if total > 0:
        print("| engine thread component | seconds | share |\n|---|---:|---:|")
        for k, v in sorted(eng.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v:.2f} | {v / total:.1%} |")
    else:
        print("(this revision's server has no engine profile)")
    if r["worker_seconds"]:
        print("| worker (summed over concurrent tasks) | seconds | per step |\n|---|---:|---:|")
        for k, v in sorted(r["worker_seconds"].items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v:.2f} | {v / max(1, len(steps)):.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2_arith.yaml")
    ap.add_argument("--steps", type=int, default=6, help="train steps of the simulated trainer")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the engine and of the plain loop")
    ap.add_argument("--train_seconds", type=float, default=4.0, help="how long the simulated trainer holds each batch")
    ap.add_argument("--max_seconds", type=float, default=0.0,
                    help="end the workload after this many seconds even if --steps are not done (0: no limit)")
    ap.add_argument("--gen_tokens", type=int, default=128, help="decode steps of the plain loop")
    ap.add_argument("--loop_repeats", type=int, default=2, help="runs of the plain loop (the best is kept)")
    ap.add_argument("--compare", default=None, help="git revision to run first, with the same workload (before/after)")
    ap.add_argument("--rounds", type=int, default=1, help="with --compare: alternate the two this many times")
    ap.add_argument("--weight_loads", type=int, default=0,
                    help="instead of the workload: time this many full weight loads on an idle server")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the working tree's runs (e.g. rollout.engine_scheduler_delay_factor=4); "
                         "the --compare revision runs the config as it is")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one run, JSON on stdout's last line
    ap.add_argument("--code_root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    ap.add_argument("--code_label", default="working tree", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.config = a.config.resolve()
    for item in a.set:
        if "=" not in item or not item.split("=", 1)[0]:
            ap.error(f"--set takes KEY=VALUE (a config field such as rollout.engine_scheduler_delay_factor=4), got {item!r}")
    if a.weight_loads:
        rows = weight_loads(a)
        if a.json:
            a.json.write_text(json.dumps({"threads": a.threads, "loads": rows}, indent=2))
        return 0
    if a.one:  # a SIGTERM still stops the server and Redis (the finally blocks run)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        print("RESULT " + json.dumps(one(a)), flush=True)
        return 0
    runs: list[tuple[str, Path]] = [("working tree", ROOT)]
    tree = None
    if a.compare:
        tree = Path(tempfile.mkdtemp(prefix="asyncrl-profile-ref-")) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), a.compare], check=True,
                       stdout=subprocess.DEVNULL)
        runs = [(a.compare, tree), ("working tree", ROOT)] * a.rounds
    results = []
    try:
        for label, code in runs:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--code_root", str(code), "--code_label", label,
                   "--config", str(a.config), "--steps", str(a.steps), "--threads", str(a.threads),
                   "--train_seconds", str(a.train_seconds), "--gen_tokens", str(a.gen_tokens),
                   "--max_seconds", str(a.max_seconds), "--loop_repeats", str(a.loop_repeats)]
            if code == ROOT:
                cmd += [x for item in a.set for x in ("--set", item)]
            # the revision's packages first; this script's bench helpers (rollout_bench) from this tree
            env = dict(os.environ, PYTHONPATH=f"{code}{os.pathsep}{ROOT}", OMP_NUM_THREADS=str(a.threads))
            print(f"running the workload with the code of {label} ...", flush=True)
            out = subprocess.run(cmd, env=env, cwd=str(code), stdout=subprocess.PIPE, text=True)
            sys.stdout.write("".join(l + "\n" for l in out.stdout.splitlines() if not l.startswith("RESULT ")))
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if out.returncode != 0 or not line:
                raise SystemExit(f"the run with {label} failed (exit {out.returncode})")
            results.append(json.loads(line[-1][len("RESULT "):]))
    finally:
        if tree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
            shutil.rmtree(tree.parent, ignore_errors=True)
    for r in results:
        report(r)
    if a.compare:
        before = [r["ratio"] for r in results if r["code"] == a.compare]
        after = [r["ratio"] for r in results if r["code"] != a.compare]
        print(f"\nratio to the plain loop: {a.compare} {', '.join(f'{x:.2f}' for x in before)}; "
              f"working tree {', '.join(f'{x:.2f}' for x in after)}")
    if a.json:
        a.json.write_text(json.dumps({"config": str(a.config.relative_to(ROOT)) if a.config.is_relative_to(ROOT) else
                                      a.config.name, "set": a.set, "steps": a.steps, "threads": a.threads,
                                      "train_seconds": a.train_seconds, "cpu_count": os.cpu_count(), "runs": results},
                                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
