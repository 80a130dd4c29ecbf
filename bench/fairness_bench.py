"""Fairness benchmark (issue 31 item 1): small requests' time beside a maximal admissible one, against alone.

The issue's scenario over real HTTP: an embedded server (``python -m rollout_server.server``, the
tiny random model by default, ``--max-running-requests 64``, the default reserve of 8 rows and cost
bound of 2^20 entries) gets the largest request it admits, ``{"input_ids": [1, 2, 3, 4], "stream":
true, "return_logprob": true, "top_logprobs_num": 20, "sampling_params": {"n": 56,
"max_new_tokens": 851, "ignore_eos": true}}``, and, once it streams, 8 small requests at once
(32 greedy tokens each, ``ignore_eos``). Each small request's time is compared with its time when
the same 8 run without the big request ("solo": the 8 together, so the ratio is what the big
request adds) and, for reference, with one small request entirely alone. The big request is
then dropped (closing its stream aborts it).

Two servers run side by side in this one process tree: ``fair`` (``--fair-slowdown 2``, the
default) and ``off`` (``--fair-slowdown 1e9``: every row runs in every step, the behaviour before
fair decode steps). Each repeat measures both, back to back, so a change of the machine's load
hits them alike; the JSON holds every time, the per-request ratios (beside / solo) and their
medians and maxima per server, and the server process's CPU seconds while the 8 ran, beside
against solo: on a loaded machine the wall times move with the load, the CPU seconds much less.

Starvation: run at low priority (SCHED_IDLE: ``chrt --idle 0 nice -n 19 python ...``) on a machine
whose cores are busy, the server and this client get a CPU only when nothing else wants one, and a
phase's wall time is then mostly time spent *runnable but not running*: the kernel's run-queue wait,
not the server's. Each phase therefore records, from ``/proc/PID/task/TID/schedstat`` (Linux;
Documentation/scheduler/sched-stats.rst: CPU ns, run-queue wait ns, timeslices), the CPU and
run-queue wait seconds of every server thread and of this client, and each small request's time in
the engine (``meta_info.e2e_latency``: submit to finish) beside its wall time. A repeat is *clean*
when in both phases no server thread and no client thread waited in the run queue for more than
``--max-starved`` (default 0.1) of the phase; the summary gives the wall ratios over all repeats and
over the clean ones (None when there are none: then the wall-clock ratio was not measured, only
the scheduler).

``--engine`` runs the same scenario through the engine in this process (no HTTP: its decode loop
alone), ``fair`` against ``off``, and reports CPU and wall ratios beside / solo.

``--calibrate`` instead times the engine's decode steps in this process (no HTTP) for R rows with
and without 20 top logprobs, and fits ``t = α + β·R + δ·R·k`` by least squares: the step cost
model of rollout_server/engine_fair.py in plain-row units is ``a = α/β``, ``γ = δ/β``.

Run (at low priority on a shared machine): ``python bench/fairness_bench.py [--model DIR]
[--repeats 5] [--json docs/bench/fairness.json]``, ``... --engine`` or ``... --calibrate``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._report import emit, record_path  # noqa: E402

SMALL = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0}}


def maximal(rows: int, reserve: int, cost: int) -> dict:
    """The largest request a server of ``rows`` rows, ``reserve`` reserved and cost bound ``cost`` admits (issue 31)."""
    n = rows - reserve
    return {"input_ids": [1, 2, 3, 4], "stream": True, "return_logprob": True, "top_logprobs_num": 20,
            "sampling_params": {"n": n, "max_new_tokens": cost // (n * 22), "ignore_eos": True}}


async def _small(http, url: str) -> tuple[float, float]:
    """One small request: (wall seconds at the client, seconds in the engine: submit to finish)."""
    t0 = time.monotonic()
    async with http.post(url + "/generate", json=SMALL) as r:
        assert r.status == 200, await r.text()
        body = await r.json()
    return time.monotonic() - t0, float(body["meta_info"]["e2e_latency"])


async def _smalls(http, url: str, k: int = 8) -> tuple[list[float], list[float]]:
    """``k`` small requests at once: their wall seconds and their seconds in the engine."""
    out = await asyncio.gather(*[_small(http, url) for _ in range(k)])
    return [w for w, _ in out], [e for _, e in out]


def thread_times(pid: int) -> dict[str, tuple[float, float]] | None:
    """Per thread of process ``pid``: (CPU seconds, run-queue wait seconds) so far, from
    ``/proc/PID/task/TID/schedstat`` (Linux with schedstats; None elsewhere). The wait is the time the
    thread was runnable but another task had the CPU (Documentation/scheduler/sched-stats.rst)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                cpu_ns, wait_ns = (int(x) for x in f.read().split()[:2])
        except (OSError, ValueError):  # the thread ended meanwhile, or no schedstats
            continue
        out[tid] = (cpu_ns / 1e9, wait_ns / 1e9)
    return out or None


def starvation(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """What the scheduler withheld over a phase of ``wall`` seconds: the largest run-queue wait of
    one thread as a share of the phase (``share``), and the CPU / wait seconds of the thread that
    waited most (None without schedstats)."""
    if not before or not after or wall <= 0:
        return None
    deltas = {t: (c - before.get(t, (0.0, 0.0))[0], w - before.get(t, (0.0, 0.0))[1]) for t, (c, w) in after.items()}
    tid = max(deltas, key=lambda t: deltas[t][1])
    cpu, wait = deltas[tid]
    return {"share": wait / wall, "cpu_s": cpu, "wait_s": wait, "cpu_all_threads_s": sum(c for c, _ in deltas.values())}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def _round(url: str, pid: int, big_body: dict) -> dict:
    """One measurement on one server: one small alone, 8 together, 8 beside the maximal request.

    Besides each small request's wall time, the server process's CPU seconds while the 8 ran
    (solo and beside): a load-independent measure of the work the small requests shared the
    server with (one engine thread and the event loop, sharing the GIL: about one core).
    """
    import aiohttp

    me = os.getpid()

    async def phase() -> dict:
        s0, m0, c0, t0 = thread_times(pid), thread_times(me), _cpu_seconds(pid), time.monotonic()
        walls, engine = await _smalls(http, url)
        wall = time.monotonic() - t0
        server, client = starvation(s0, thread_times(pid), wall), starvation(m0, thread_times(me), wall)
        return {"walls": walls, "engine_s": engine, "cpu_s": _cpu_seconds(pid) - c0, "wall_s": wall,
                "server_starved": server, "client_starved": client}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await _small(http, url)  # warm
        alone = (await _small(http, url))[0]
        solo = await phase()
        streaming = asyncio.Event()

        async def big() -> None:
            async with http.post(url + "/generate", json=big_body) as r:
                assert r.status == 200, await r.text()
                async for _ in r.content.iter_any():
                    streaming.set()

        task = asyncio.create_task(big())
        await asyncio.wait_for(streaming.wait(), 120)
        await asyncio.sleep(0.2)
        beside = await phase()
        task.cancel()  # closing the stream aborts the big request
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)
    shares = [x["share"] for p in (solo, beside) for x in (p["server_starved"], p["client_starved"]) if x is not None]
    return {"alone": alone, "solo": solo["walls"], "beside": beside["walls"],
            "ratios": [b / s for b, s in zip(sorted(beside["walls"]), sorted(solo["walls"]))],
            "engine_ratios": [b / s for b, s in zip(sorted(beside["engine_s"]), sorted(solo["engine_s"]))],
            "cpu_solo_s": solo["cpu_s"], "cpu_beside_s": beside["cpu_s"],
            "cpu_ratio": beside["cpu_s"] / max(solo["cpu_s"], 1e-9),
            "phases": {"solo": solo, "beside": beside}, "starved_share": max(shares) if shares else None}


def run_http(a: argparse.Namespace) -> dict:
    """The HTTP scenario on a ``fair`` and an ``off`` server, ``a.repeats`` times each, interleaved."""
    from asyncrl.models import build_tiny_model
    from rollout_server.testing import make_random_model, start_embedded_server

    tmp = Path(tempfile.mkdtemp(prefix="fairness_bench_"))
    model = a.model or str(make_random_model(build_tiny_model(tmp / "tiny"), tmp / "varied", seed=1))
    body = maximal(a.rows, a.reserve, a.cost)
    common = ["--max-running-requests", str(a.rows), "--fair-reserve-rows", str(a.reserve), "--max-request-cost", str(a.cost)]
    servers = {"fair": start_embedded_server(model, *common, "--fair-slowdown", str(a.fair_slowdown), threads=a.threads,
                                             log_path=tmp / "fair.log", ready_timeout_seconds=600),
               "off": start_embedded_server(model, *common, "--fair-slowdown", "1e9", threads=a.threads,
                                            log_path=tmp / "off.log", ready_timeout_seconds=600)}
    rounds: dict[str, list[dict]] = {k: [] for k in servers}
    try:
        for rep in range(a.repeats):
            for name, srv in servers.items():
                r = asyncio.run(_round(srv.url, srv.process.pid, body))
                rounds[name].append(r)
                starved = "n/a" if r["starved_share"] is None else f"{r['starved_share']:.0%}"
                print(f"repeat {rep} {name}: one alone {r['alone']:.3f} s, 8 solo median {statistics.median(r['solo']):.3f} s, "
                      f"beside median {statistics.median(r['beside']):.3f} s, ratio max {max(r['ratios']):.2f}, "
                      f"server CPU beside / solo {r['cpu_ratio']:.2f}, largest run-queue wait {starved} of a phase",
                      flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    summary = {}
    for name, rs in rounds.items():
        ratios = [x for r in rs for x in r["ratios"]]
        clean = [r for r in rs if r["starved_share"] is not None and r["starved_share"] <= a.max_starved]
        clean_ratios = [x for r in clean for x in r["ratios"]]
        summary[name] = {"ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
                         "per_repeat_max": [max(r["ratios"]) for r in rs],
                         "starved_shares": [r["starved_share"] for r in rs],
                         "clean_repeats": len(clean),
                         "clean_ratio_median": statistics.median(clean_ratios) if clean else None,
                         "clean_ratio_max": max(clean_ratios) if clean else None,
                         "engine_ratio_median": statistics.median(x for r in rs for x in r["engine_ratios"]),
                         "cpu_ratio_median": statistics.median(r["cpu_ratio"] for r in rs),
                         "cpu_ratios": [r["cpu_ratio"] for r in rs],
                         "solo_median_s": statistics.median(x for r in rs for x in r["solo"]),
                         "beside_median_s": statistics.median(x for r in rs for x in r["beside"]),
                         "alone_median_s": statistics.median(r["alone"] for r in rs)}
    return {"big_request": body, "small_request": SMALL, "rows": a.rows, "reserve": a.reserve, "cost": a.cost,
            "fair_slowdown": a.fair_slowdown,
            "threads": a.threads, "max_starved": a.max_starved, "loadavg_end": os.getloadavg(), "model": record_path(a.model) if a.model else "tiny (random, seed 1)",
            "summary": summary, "rounds": rounds}


def _engine_phase(eng, with_big: bool, big_tokens: int) -> tuple[float, float]:
    """8 small requests admitted together (the engine paused in place meanwhile), beside the maximal
    request or not; returns (this process's CPU seconds, wall seconds) until the 8 finished."""
    from rollout_server.engine_sample import EngineGroup, EngineSample
    from rollout_server.sampling import SamplingParams

    tag = f"{time.monotonic()}"
    big = []
    if with_big:
        big = [EngineSample(f"big-{tag}-{j}", [1, 2, 3, 4], SamplingParams(max_new_tokens=big_tokens, temperature=1.0,
                                                                          ignore_eos=True),
                            return_logprob=True, top_logprobs_num=20) for j in range(56)]
        eng.submit([EngineGroup([1, 2, 3, 4], big)])
        while len(big[0].output_ids) < 3:
            time.sleep(0.001)
    eng.call("pause", "in_place").result()
    small = [EngineSample(f"s-{tag}-{i}", [5, 6, 7 + i], SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
             for i in range(8)]
    for s in small:
        eng.submit([EngineGroup(s.prompt_ids, [s])])
    c0, t0 = time.process_time(), time.monotonic()
    eng.call("resume").result()
    while not all(s.finished for s in small):
        time.sleep(0.01)
    cpu, wall = time.process_time() - c0, time.monotonic() - t0
    if big:
        eng.abort(f"big-{tag}")
        while not all(s.finished for s in big):
            time.sleep(0.01)
    return cpu, wall


def run_engine(a: argparse.Namespace) -> dict:
    """The scenario through :class:`rollout_server.engine.Engine` in this process (no HTTP), F = 2 and off."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.models import build_tiny_model
    from rollout_server.engine import Engine
    from rollout_server.testing import make_random_model

    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="fairness_engine_"))
    path = a.model or str(make_random_model(build_tiny_model(tmp / "tiny"), tmp / "varied", seed=1))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    for name, slowdown in (("fair", a.fair_slowdown), ("off", float("inf"))):
        eng = Engine(model, None, context_len=1024, max_batch_size=64, threads=a.threads, fair_slowdown=slowdown).start()
        try:
            _engine_phase(eng, False, 400)  # warm
            reps = []
            for _ in range(a.repeats):
                cs, ts = _engine_phase(eng, False, 400)
                cb, tb = _engine_phase(eng, True, 400)
                reps.append({"cpu_ratio": cb / cs, "wall_ratio": tb / ts, "cpu_solo_s": cs, "cpu_beside_s": cb})
                print(f"{name}: CPU beside / solo {cb / cs:.2f}, wall {tb / ts:.2f}", flush=True)
        finally:
            eng.stop()
        out[name] = reps
    return {"mode": "engine (in process)", "model": record_path(a.model) if a.model else "tiny (random, seed 1)",
            "threads": a.threads, "repeats": out}


def calibrate(a: argparse.Namespace) -> dict:
    """Decode-step time for R rows with k top logprobs; the least-squares fit of the step cost model."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.models import build_tiny_model
    from rollout_server.engine import Engine
    from rollout_server.engine_sample import EngineGroup, EngineSample
    from rollout_server.sampling import SamplingParams
    from rollout_server.testing import make_random_model

    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="fairness_cal_"))
    path = a.model or str(make_random_model(build_tiny_model(tmp / "tiny"), tmp / "varied", seed=1))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = Engine(model, None, context_len=1024, max_batch_size=64, threads=a.threads, fair_slowdown=float("inf")).start()
    points = []
    try:
        for _ in range(a.repeats):
            for rows in (1, 8, 16, 32, 56):
                for k in (0, 20):
                    ss = [EngineSample(f"c{rows}-{k}-{j}-{time.monotonic()}", [1, 2, 3, 4],
                                       SamplingParams(max_new_tokens=41, temperature=1.0, ignore_eos=True),
                                       return_logprob=True, top_logprobs_num=k) for j in range(rows)]
                    eng.submit([EngineGroup([1, 2, 3, 4], ss)])
                    while not all(s.finished for s in ss):
                        time.sleep(0.002)
                    first = max(s.first_token_time for s in ss)
                    last = max(s.finished_time for s in ss)
                    points.append((rows, k, (last - first) / 40))
    finally:
        eng.stop()
    X = torch.tensor([[1.0, r, r * k] for r, k, _ in points], dtype=torch.float64)
    y = torch.tensor([t for _, _, t in points], dtype=torch.float64)
    alpha, beta, delta = torch.linalg.lstsq(X, y[:, None]).solution.flatten().tolist()
    table = {f"{r} rows, k={k}": statistics.median(t for rr, kk, t in points if (rr, kk) == (r, k)) for r, k, _ in points}
    return {"model": record_path(a.model) if a.model else "tiny (random, seed 1)", "threads": a.threads, "step_seconds_median": table,
            "alpha_s": alpha, "beta_s_per_row": beta, "delta_s_per_row_per_top_logprob": delta,
            "a_rows": alpha / beta if beta > 0 else None, "gamma_rows": delta / beta if beta > 0 else None}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model directory (default: the tiny random model)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--reserve", type=int, default=8)
    p.add_argument("--cost", type=int, default=1 << 20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fair-slowdown", type=float, default=2.0, help="F of the fair server (the server's default: 2)")
    p.add_argument("--max-starved", type=float, default=0.1,
                   help="a repeat is clean when no thread waited in the run queue for more than this share of a phase")
    p.add_argument("--calibrate", action="store_true", help="fit the step cost model instead")
    p.add_argument("--engine", action="store_true", help="the scenario through the engine in this process, no HTTP")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    result = calibrate(a) if a.calibrate else run_engine(a) if a.engine else run_http(a)
    emit(result, Path(a.json) if a.json else None)
    return result


if __name__ == "__main__":
    main()
