"""Where a small request's wall time goes beside the maximal one (the probe of docs/rollout.md, "Fairness benchmark").

bench/fairness_bench.py's HTTP scenario on one ``fair`` server, with each small request traced: the
server (this file run with ``--serve``: ``python -m rollout_server.server`` with its ``/generate``
handler wrapped, plus ``GET /debug/trace``) stamps the handler's entry, the submit to the engine,
the first token, the finish and the handler's return, and reads its threads'
``/proc/self/task/TID/schedstat`` at entry and return; the client reads the server's threads and its
own at send and receive. Per request this gives the time before the engine (``in``: send to
handler, ``presubmit``: handler to submit), in it (``queue_prefill``, ``decode``) and after, and for
each part how long the thread that carries it waited in the run queue (runnable, not running:
Documentation/scheduler/sched-stats.rst) against its CPU time. A diagnostic, not a product path:
the wrapper only records.

Run (at low priority): ``python bench/fairness_trace.py [--repeats 20] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._report import write_record  # noqa: E402
from bench.fairness_bench import SMALL, maximal, thread_times  # noqa: E402


def _serve(argv: list[str]) -> int:
    """The embedded server with traced ``/generate`` requests (those with an ``x-trace`` header)."""
    from aiohttp import web

    import rollout_server.server as srv
    from rollout_server.engine import Engine

    current: contextvars.ContextVar = contextvars.ContextVar("trace", default=None)
    traces: list[dict] = []
    submit, handle, app = Engine.submit, srv.RolloutHTTPServer.handle_generate, srv.RolloutHTTPServer.app

    def traced_submit(self, groups):
        groups = list(groups)
        rec = current.get()
        if rec is not None:
            rec["samples"] += [s for g in groups for s in g.samples]
        return submit(self, groups)

    async def traced_handle(self, request):
        tag = request.headers.get("x-trace")
        if tag is None:
            return await handle(self, request)
        rec = {"id": tag, "entry": time.time(), "threads_entry": thread_times(os.getpid()), "samples": []}
        current.set(rec)
        try:
            return await handle(self, request)
        finally:
            rec["ret"], rec["threads_ret"] = time.time(), thread_times(os.getpid())
            ss = rec.pop("samples")
            rec["submit"] = min(s.created_time for s in ss) if ss else None
            rec["first_token"] = max(s.first_token_time or 0.0 for s in ss) if ss else None
            rec["finished"] = max(s.finished_time or 0.0 for s in ss) if ss else None
            traces.append(rec)

    def traced_app(self):
        a = app(self)

        async def dump(request):
            out = list(traces)
            traces.clear()
            return web.json_response(out)

        a.router.add_get("/debug/trace", dump)
        return a

    Engine.submit, srv.RolloutHTTPServer.handle_generate, srv.RolloutHTTPServer.app = traced_submit, traced_handle, traced_app
    return srv.main(argv)


async def _small(http, url: str, pid: int, tag: str) -> dict:
    me = os.getpid()
    c0, s0, t0 = thread_times(me), thread_times(pid), time.time()
    async with http.post(url + "/generate", json=SMALL, headers={"x-trace": tag}) as r:
        assert r.status == 200, await r.text()
        await r.read()
    t1, s1, c1 = time.time(), thread_times(pid), thread_times(me)
    client = {t: (c1[t][0] - c0.get(t, (0, 0))[0], c1[t][1] - c0.get(t, (0, 0))[1]) for t in c1}
    return {"id": tag, "send": t0, "recv": t1, "threads_send": s0, "threads_recv": s1,
            "client_wait_s": max(w for _, w in client.values()), "client_cpu_s": sum(c for c, _ in client.values())}


async def _round(url: str, pid: int, body: dict, rep: int) -> tuple[list, list, list]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await _small(http, url, pid, "warm")
        solo = await asyncio.gather(*[_small(http, url, pid, f"{rep}-solo-{i}") for i in range(8)])
        streaming = asyncio.Event()

        async def big() -> None:
            async with http.post(url + "/generate", json=body) as r:
                async for _ in r.content.iter_any():
                    streaming.set()

        task = asyncio.create_task(big())
        await asyncio.wait_for(streaming.wait(), 300)
        await asyncio.sleep(0.2)
        beside = await asyncio.gather(*[_small(http, url, pid, f"{rep}-beside-{i}") for i in range(8)])
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)
        async with http.get(url + "/debug/trace") as r:
            traces = await r.json()
    return solo, beside, traces


def _parts(reqs: list[dict], traces: list[dict], pid: int) -> list[dict]:
    """Per request: seconds of each part and the run-queue wait / CPU of the thread that carries it
    (the event loop: the main thread; the engine: the server thread with the most CPU)."""
    by_id, main = {t["id"]: t for t in traces}, str(pid)
    out = []
    for q in reqs:
        t = by_id[q["id"]]
        engine = max((k for k in t["threads_ret"] if k != main), key=lambda k: t["threads_ret"][k][0])

        def d(a: dict, b: dict, k: str, i: int) -> float:
            return b.get(k, (0.0, 0.0))[i] - a.get(k, (0.0, 0.0))[i]

        out.append({
            "wall": q["recv"] - q["send"], "in": t["entry"] - q["send"],
            "in_loop_wait": d(q["threads_send"], t["threads_entry"], main, 1),
            "presubmit": t["submit"] - t["entry"], "queue_prefill": t["first_token"] - t["submit"],
            "decode": t["finished"] - t["first_token"], "post": t["ret"] - t["finished"], "out": q["recv"] - t["ret"],
            "engine_wait": d(t["threads_entry"], t["threads_ret"], engine, 1),
            "engine_cpu": d(t["threads_entry"], t["threads_ret"], engine, 0),
            "loop_wait": d(t["threads_entry"], t["threads_ret"], main, 1),
            "client_wait": q["client_wait_s"],
        })
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        sys.exit(_serve(argv[1:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from asyncrl.core.net import free_port
    from asyncrl.models import build_tiny_model
    from rollout_server.client import EngineClient
    from rollout_server.testing import make_random_model

    tmp = Path(tempfile.mkdtemp(prefix="fairness_trace_"))
    model = str(make_random_model(build_tiny_model(tmp / "tiny"), tmp / "varied", seed=1))
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", "--model-path", model, "--port", str(port), "--engine-threads", "1",
                             "--max-running-requests", "64", "--fair-reserve-rows", "8", "--max-request-cost", str(1 << 20)],
                            stdout=open(tmp / "server.log", "wb"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    url, body, reps = f"http://127.0.0.1:{port}", maximal(64, 8, 1 << 20), []

    async def ready() -> None:
        async with EngineClient(url) as c:
            await c.wait_ready(600, poll_seconds=0.2, process=proc)

    try:
        asyncio.run(ready())
        for rep in range(a.repeats):
            solo, beside, traces = asyncio.run(_round(url, proc.pid, body, rep))
            r = {"solo": _parts(solo, traces, proc.pid), "beside": _parts(beside, traces, proc.pid), "loadavg": os.getloadavg()}
            reps.append(r)
            for name in ("solo", "beside"):
                w = max(r[name], key=lambda x: x["wall"])
                print(f"repeat {rep} {name:6s} slowest {w['wall']:.2f} s: in {w['in']:.2f} (loop waited {w['in_loop_wait']:.2f}), "
                      f"presubmit {w['presubmit']:.3f}, queue+prefill {w['queue_prefill']:.2f}, decode {w['decode']:.2f} "
                      f"(engine thread waited {w['engine_wait']:.2f}, ran {w['engine_cpu']:.3f}), post {w['post']:.2f}, "
                      f"out {w['out']:.2f}; load {r['loadavg'][0]:.1f}", flush=True)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()
    summary = {}
    for name in ("solo", "beside"):
        slow = [max(r[name], key=lambda x: x["wall"]) for r in reps]
        inside = [x["queue_prefill"] + x["decode"] for x in slow]
        summary[name] = {"slowest_wall_median_s": statistics.median(x["wall"] for x in slow),
                         "slowest_wall_max_s": max(x["wall"] for x in slow),
                         "engine_wait_share_median": statistics.median(x["engine_wait"] / max(i, 1e-9) for x, i in zip(slow, inside)),
                         "engine_wait_share_min": min(x["engine_wait"] / max(i, 1e-9) for x, i in zip(slow, inside)),
                         "engine_cpu_median_s": statistics.median(x["engine_cpu"] for x in slow),
                         "before_engine_max_s": max(x["in"] + x["presubmit"] for x in slow)}
    summary["wall_ratios"] = [max(x["wall"] for x in r["beside"]) / max(x["wall"] for x in r["solo"]) for r in reps]
    summary["engine_cpu_ratios"] = [max(r["beside"], key=lambda x: x["wall"])["engine_cpu"]
                                    / max(max(r["solo"], key=lambda x: x["wall"])["engine_cpu"], 1e-9) for r in reps]
    result = {"summary": summary, "repeats": reps}
    print(json.dumps(summary, indent=2))
    write_record(result, Path(a.json) if a.json else None)
    return result


if __name__ == "__main__":
    main()
