"""A bounded probe suite of the embedded rollout server (issue #31): what an attacker would try.

Bodies, encodings, auth headers, sampling extremes, cost bounds, the streaming cost, and the
fairness check of item 1, each against a real server process on 127.0.0.1 that the suite starts
itself (the tiny random model, real HTTP). Every loop is bounded; the suite runs in well under two
minutes. Forged control tokens are probed in tests/test_agent_sessions.py (the sessions gateway and
the workflow API's ``observe``); argv warnings and the run files' modes at the end of this file.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
import zlib

import aiohttp
import psutil
import pytest

from rollout_server.testing import make_random_model, start_embedded_server

pytestmark = pytest.mark.integration

KEY = "probe-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
#: the server under test: 20 rows, 8 of them kept for requests of at most 8 samples, and a cost bound
ROWS, RESERVE, COST = 20, 8, 160_000
#: the largest request it admits: 12 samples x 606 tokens x (2 + 20) = 159,984 entries. It has more
#: samples than the reserve, so it is a big request (a request of exactly ``RESERVE`` samples is not,
#: and two of them may hold every row). Long enough to still be streaming when the small requests
#: come: at 151 tokens it finished in 0.44 s once cumulative chunks stopped being rebuilt.
MAXIMAL = {"input_ids": [1, 2, 3, 4], "stream": True, "return_logprob": True, "top_logprobs_num": 20,
           "sampling_params": {"n": ROWS - RESERVE, "max_new_tokens": COST // ((ROWS - RESERVE) * 22),
                               "ignore_eos": True, "temperature": 1.0}}
SMALL = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0}}


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    model = make_random_model(tiny_model_dir, tmp_path_factory.mktemp("probe") / "varied", seed=1)
    s = start_embedded_server(model, "--max-running-requests", str(ROWS), "--fair-reserve-rows", str(RESERVE),
                              "--max-request-cost", str(COST), api_key=KEY,
                              log_path=tmp_path_factory.mktemp("log") / "probe.log")
    yield s
    s.stop()


async def _post(url: str, data: bytes, headers: dict, path: str = "/generate") -> tuple[int, bytes]:
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        try:
            async with http.post(url + path, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as r:
                return r.status, await r.read()
        except aiohttp.ClientConnectionError as exc:  # a refused big body may be cut off; the status is what counts
            return -1, str(exc).encode()


def _msg(raw: bytes) -> str:
    body = json.loads(raw)
    err = body.get("error")
    return err.get("message", "") if isinstance(err, dict) else str(err)


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


# ------------------------------------------------------------------------------ item 2: encodings
def test_compressed_bodies_are_refused_before_auth_and_never_inflated(srv):
    """A deflate or gzip bomb (64 MB of zeros, with or without the key), a gzip header on a body
    that is not gzip, 2,000 gzip members: 415 naming Content-Encoding, and the server spends no
    CPU inflating anything (it used seconds before the fix, after its 401/413)."""
    zeros = b"\0" * (64 << 20)
    bomb_deflate = zlib.compress(zeros, 9)
    bomb_gzip = gzip.compress(zeros, 9)
    members = b"".join(gzip.compress(b"{}") for _ in range(2000))
    del zeros
    probes = [(bomb_deflate, "deflate", {}), (bomb_gzip, "gzip", AUTH), (b'{"input_ids": [1]}', "gzip", AUTH),
              (members, "gzip", AUTH), (bomb_gzip, "gzip, br", {})]

    async def run():
        out = []
        for data, enc, headers in probes:
            cpu0 = _cpu(srv.process.pid)
            status, raw = await _post(srv.url, data, {**headers, "Content-Encoding": enc})
            await asyncio.sleep(0.2)  # lingering inflation (the bug) would burn CPU after the answer
            out.append((status, raw, _cpu(srv.process.pid) - cpu0))
        async with aiohttp.ClientSession() as http:
            async with http.get(srv.url + "/health") as r:
                out.append((r.status, b"", 0.0))
        return out

    results = asyncio.run(run())
    for (status, raw, cpu), (_, enc, _) in zip(results, probes):
        assert status in (415, -1), (enc, status, raw[:200])
        if status == 415:
            assert "Content-Encoding" in _msg(raw)
        assert cpu < 0.15, f"{enc}: the server used {cpu:.2f} s of CPU on a refused compressed body"
    assert results[-1][0] == 200
    assert any(s == 415 for s, _, _ in results[:-1])


def test_identity_encoding_is_accepted(srv):
    status, raw = asyncio.run(_post(srv.url, json.dumps(SMALL).encode(), {**AUTH, "Content-Encoding": "identity"}))
    assert status == 200, raw[:300]


# ------------------------------------------------------------------------------ item 3: auth headers, sampling extremes
@pytest.mark.parametrize("headers,name", [({"Authorization": b"Bearer \xff\xfe".decode("latin-1")}, "Authorization"),
                                          ({"x-api-key": b"\xff".decode("latin-1")}, "x-api-key")])
def test_non_ascii_credentials_are_a_400_naming_the_header(srv, headers, name):
    status, raw = asyncio.run(_post(srv.url, json.dumps(SMALL).encode(), {"Content-Type": "application/json", **headers}))
    assert status == 400 and name in _msg(raw), raw[:300]


def test_wrong_and_right_keys(srv):
    bad = asyncio.run(_post(srv.url, json.dumps(SMALL).encode(), {**AUTH, "Authorization": "Bearer nope"}))
    assert bad[0] == 401
    none = asyncio.run(_post(srv.url, json.dumps(SMALL).encode(), {"Content-Type": "application/json"}))
    assert none[0] == 401
    assert asyncio.run(_post(srv.url, json.dumps(SMALL).encode(), AUTH))[0] == 200


@pytest.mark.parametrize("penalty", [1e-300, 5e-324, 0.0099])
def test_tiny_repetition_penalty_is_a_400_naming_the_field(srv, penalty):
    body = {**SMALL, "sampling_params": {**SMALL["sampling_params"], "repetition_penalty": penalty}}
    status, raw = asyncio.run(_post(srv.url, json.dumps(body).encode(), AUTH))
    assert status == 400 and "repetition_penalty" in _msg(raw), raw[:300]


def test_smallest_repetition_penalty_generates_finite_output(srv):
    body = {"input_ids": [5, 6, 5, 6], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "repetition_penalty": 0.01, "temperature": 1.0}}
    status, raw = asyncio.run(_post(srv.url, json.dumps(body).encode(), AUTH))
    assert status == 200, raw[:300]
    lps = [x[0] for x in json.loads(raw)["meta_info"]["output_token_logprobs"]]
    assert len(lps) == 16 and all(lp is not None and lp <= 0 for lp in lps)


# ------------------------------------------------------------------------------ bodies
def test_many_unknown_keys_give_a_short_error(srv):
    body = {**SMALL, **{f"k{i:05d}": 1 for i in range(30_000)}}
    status, raw = asyncio.run(_post(srv.url, json.dumps(body).encode(), AUTH))
    assert status == 400 and len(raw) < 4096, (status, len(raw))
    assert "unknown field" in _msg(raw) and "more" in _msg(raw)


def test_not_json_and_wrong_shapes_are_400s(srv):
    for data in (b"\xff\xfe", b"[1,2]", b'{"input_ids": "x"}', b"{" * 100_000, b'{"input_ids": [1], "stream": "yes"}'):
        status, raw = asyncio.run(_post(srv.url, data, AUTH))
        assert status == 400, (data[:20], status, raw[:200])


# ------------------------------------------------------------------------------ item 1: cost bound, streaming, fairness
def test_cost_over_the_bound_is_a_400_naming_the_limit(srv):
    over = json.loads(json.dumps(MAXIMAL))
    over["sampling_params"]["max_new_tokens"] += 1
    status, raw = asyncio.run(_post(srv.url, json.dumps(over).encode(), AUTH))
    assert status == 400 and "--max-request-cost" in _msg(raw) and str(COST) in _msg(raw), raw[:300]
    wide = json.loads(json.dumps(MAXIMAL))
    wide["sampling_params"].update(n=ROWS - RESERVE + 1, max_new_tokens=4)
    status, raw = asyncio.run(_post(srv.url, json.dumps(wide).encode(), AUTH))
    assert status == 400 and "--fair-reserve-rows" in _msg(raw), raw[:300]


async def _stream_bytes(url: str, body: dict) -> tuple[int, float]:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", json=body, headers=AUTH, timeout=aiohttp.ClientTimeout(total=120)) as r:
            assert r.status == 200
            n = 0
            async for chunk in r.content.iter_any():
                n += len(chunk)
    return n, time.monotonic() - t0


def test_cumulative_stream_costs_a_bounded_multiple_of_its_response(srv):
    """Cumulative chunks (the default mode) resend everything: spaced geometrically, a stream of
    300 tokens with 20 top logprobs sends at most about (CUMULATIVE_GROWTH + 2) = 10x its final
    response (it was ~100x).

    The bound: each chunk before the last carries at least 9/8 of the tokens of the one before it, so
    together they carry at most 9x the longest of them, which may be one token short of the final
    response; the final chunk adds 1x. Each chunk also repeats fields that do not grow with its
    tokens (ids, finish reason, counts, timings), under 1 KiB. The bound depends on where the chunk
    points fall, i.e. on how many tokens the engine published between two wake-ups of the stream,
    so the test checks the spacing rule on every chunk and the derived bound, not a measured ratio
    (CI once saw 10.06x against a bound of 10x without the per-chunk fields).
    """
    from rollout_server.streaming import CUMULATIVE_GROWTH

    body = {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 20,
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True, "temperature": 0}}
    status, raw = asyncio.run(_post(srv.url, json.dumps(body).encode(), AUTH))
    assert status == 200

    async def stream() -> list[bytes]:
        async with aiohttp.ClientSession() as http:
            async with http.post(srv.url + "/generate", json={**body, "stream": True}, headers=AUTH,
                                 timeout=aiohttp.ClientTimeout(total=120)) as r:
                assert r.status == 200
                return [line async for line in r.content if line.strip()]

    lines = asyncio.run(stream())
    assert lines[-1] == b"data: [DONE]\n"
    chunks = [json.loads(line[len(b"data: "):]) for line in lines[:-1]]
    sizes = [len(c["output_ids"]) for c in chunks]
    assert sizes[-1] == 300 and chunks[-1]["meta_info"]["finish_reason"] is not None
    for before, after in zip(sizes[:-2], sizes[1:-1]):  # chunks before the final one
        assert after - before >= max(1, -(-before // CUMULATIVE_GROWTH)), sizes
    streamed = sum(len(line) + 1 for line in lines)  # each line and the blank line after it
    bound = (CUMULATIVE_GROWTH + 2) * len(raw) + 1024 * len(chunks)
    assert streamed <= bound, (streamed, len(raw), len(chunks), sizes)


def test_small_requests_never_wait_for_a_maximal_one(srv):
    """Fairness: 8 small requests beside the largest admissible one (12 samples streaming 606
    tokens with 20 top logprobs each, a second one queued behind it) finish in less than half the
    big request's time: they do not wait for it (without the fair reserve the two big ones held
    every row and the small ones finished with the first)."""

    async def small(http) -> float:
        t0 = time.monotonic()
        async with http.post(srv.url + "/generate", json=SMALL, headers=AUTH) as r:
            assert r.status == 200
            await r.read()
        return time.monotonic() - t0

    async def run():
        async with aiohttp.ClientSession() as http:
            await small(http)  # warm up
            solo = statistics.median([await small(http) for _ in range(5)])
            together = await asyncio.gather(*[small(http) for _ in range(8)])
            big = asyncio.create_task(_stream_bytes(srv.url, MAXIMAL))
            # a second maximal request queued behind it: big requests together never take the reserve
            second = asyncio.create_task(_stream_bytes(srv.url, MAXIMAL))
            await asyncio.sleep(0.5)  # the big request holds its rows and streams
            assert not big.done()
            beside = await asyncio.gather(*[small(http) for _ in range(8)])
            streamed, big_seconds = await big
            await second
            return solo, together, beside, streamed, big_seconds

    solo, together, beside, streamed, big_seconds = asyncio.run(run())
    # What the reserve guarantees: the small requests do not wait for the big one. Without it (or with
    # a "maximal" request of exactly the reserve's size, which is not big) they finished with it, at
    # 2.1-2.2 s against 0.07-0.1 s solo. Issue 31's 2x bound on their slowdown (fair decode steps) is
    # asserted in the engine's cost accounting (tests/test_rollout_fairness.py) and measured in wall-clock
    # time by bench/fairness_bench.py: no timed factor is asserted on a shared machine.
    assert 2 * max(beside) < big_seconds, (
        f"the small requests waited for the big one: solo {solo:.3f} s, 8 together {max(together):.3f} s, "
        f"beside the maximal request {[round(b, 3) for b in beside]}, which took {big_seconds:.1f} s")


# ------------------------------------------------------------------------------ item 6: argv secrets, file modes
def test_secrets_on_argv_warn():
    from buffers.cli import main as buffer_main
    from rollout_server.server_options import parse_args

    with pytest.warns(UserWarning, match="--api-key puts a secret on the command line"):
        parse_args(["--model-path", "m", "--api-key", "K"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_args(["--model-path", "m"])  # no key on argv: no warning
    with pytest.warns(UserWarning, match="--redis_url with a password"):
        buffer_main(["stats", "--redis_url", "redis://:PW@127.0.0.1:1/0"])


def test_controller_creates_run_files_owner_only(tmp_path):
    """The controller (and the embedded redis-server it starts) runs with umask 077 like its roles."""
    code = (
        "import os, sys; from pathlib import Path\n"
        "os.umask(0o022)\n"
        "from asyncrl.core.config import load_config\n"
        "from asyncrl.controller.controller import Controller\n"
        "cfg = load_config(['--run.output_dir', sys.argv[1], '--run.name', 'umask'], environ={})\n"
        "c = Controller(cfg, False)\n"
        "c._prepare_run_dir()\n"
        "p = c.run_dir / 'metrics.jsonl'; p.write_text('x'); (c.run_dir / 'sub').mkdir()\n"
        "print(oct(p.stat().st_mode & 0o777), oct((c.run_dir / 'sub').stat().st_mode & 0o777))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0o600", "0o700"], out.stdout
