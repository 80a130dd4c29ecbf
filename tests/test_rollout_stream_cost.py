"""A cumulative stream serialises each token once (issue #31 item 1, "streaming cost linear in the output").

A cumulative SSE chunk resends every token so far. Rebuilt from Python objects each time, the
maximal admissible request's stream (56 samples x 851 tokens x 20 top logprobs) cost 8.5x the CPU
of its final response, under the GIL that the engine thread needs as well. The server now keeps
each sample's arrays as JSON text (:class:`rollout_server.requests.CumulativeArrays`). Checked here:
the bytes are exactly those of the object built the old way (NaN logprobs, missing top rows, text,
``index``, no logprobs); each token's top logprobs are serialised once over a whole stream with the
server's own chunk spacing; and over real HTTP every cumulative chunk is a prefix of the last.
"""

from __future__ import annotations

import asyncio
import json
import math
import random

import aiohttp
import pytest

import rollout_server.requests as rq
from rollout_server.engine_sample import EngineSample
from rollout_server.requests import CumulativeArrays, dumps, response_object
from rollout_server.sampling import SamplingParams
from rollout_server.streaming import CUMULATIVE_GROWTH
from rollout_server.testing import start_embedded_server


def _sample(idx: int, top: int, logprobs: bool = True) -> EngineSample:
    return EngineSample(f"r{idx}", [1, 2, 3], SamplingParams(max_new_tokens=64, ignore_eos=True),
                        return_logprob=logprobs, top_logprobs_num=top, index=idx,
                        version_starts=[("0", 0)], input_token_logprobs=[[None, 1, None], [-0.5, 2, None]])


def _grow(s: EngineSample, k: int, rng: random.Random) -> None:
    """Append ``k`` tokens, some with non-finite logprobs and a missing top row."""
    for _ in range(k):
        j = len(s.output_ids)
        s.output_ids.append(rng.randrange(1000))
        s.output_logprobs.append([-math.inf, math.nan][j % 2] if j % 7 == 3 else -rng.random() * 4)
        s.output_top_logprobs.append(None if j % 11 == 5 else [(-rng.random() * 4, rng.randrange(1000))
                                                               for _ in range(s.top_logprobs_num)])


def _reference(s: EngineSample, snap: tuple, text: str, extra: dict | None) -> str:
    out = response_object(s, snap, 0, final=snap[1] is not None, incremental=False, with_text=True,
                          current_version="0", text_now=text)
    return dumps({**out, **extra} if extra else out)


@pytest.mark.parametrize("top,logprobs,extra", [(3, True, {"index": 2}), (0, True, None), (0, False, {"index": 0})])
def test_cached_chunks_are_the_bytes_of_the_rebuilt_object(top, logprobs, extra):
    rng = random.Random(top)
    s, arrays = _sample(2, top, logprobs), CumulativeArrays()
    for step in (1, 2, 5, 1, 9):
        _grow(s, step, rng)
        n = len(s.output_ids)
        fin = {"type": "length", "length": n} if step == 9 else None
        s.finished_time = 1.0 if fin else None
        s.created_time = 0.5
        text = "t\x00e\"x\\t" * n  # control characters and escapes in the text stay text
        got = arrays.chunk(s, (n, fin), with_text=True, current_version="0", text_now=text, extra=extra)
        assert got == _reference(s, (n, fin), text, extra)
        json.loads(got)  # and it is JSON


def test_a_snapshot_behind_the_cache_is_rebuilt():
    rng = random.Random(1)
    s, arrays = _sample(0, 2), CumulativeArrays()
    _grow(s, 6, rng)
    arrays.chunk(s, (6, None), with_text=False, current_version="0")
    got = arrays.chunk(s, (4, None), with_text=False, current_version="0")
    out = response_object(s, (4, None), 0, final=False, incremental=False, with_text=False, current_version="0")
    assert got == dumps(out)


def test_each_token_is_serialised_once_over_a_stream(monkeypatch):
    """The server's chunk spacing (a chunk when the output grew by 1/8 or by 4,096 entries): the
    rows given to the top-logprob serialiser add up to the tokens generated, not to the sum of
    the chunks' lengths (up to about 10x more: what the stream sends)."""
    calls = []
    real = rq._top_logprobs
    monkeypatch.setattr(rq, "_top_logprobs", lambda rows: calls.append(len(rows)) or real(rows))
    rng, n_tokens, top, budget = random.Random(0), 400, 20, 4096
    s, arrays = _sample(0, top), CumulativeArrays()
    sent, sent_rows = 0, 0
    for n in range(1, n_tokens + 1):
        _grow(s, 1, rng)
        gap = max(1, -(-sent * (1 + top) // budget), -(-sent // CUMULATIVE_GROWTH))
        fin = {"type": "length", "length": n} if n == n_tokens else None
        if fin is None and n - sent < gap:
            continue
        arrays.chunk(s, (n, fin), with_text=False, current_version="0")
        sent, sent_rows = n, sent_rows + n
    assert sum(calls) == n_tokens, (sum(calls), sent_rows)
    assert sent_rows > 5 * n_tokens  # the stream itself resends: what the cache saves is real


@pytest.mark.integration
def test_cumulative_chunks_over_http_are_prefixes_of_the_last(tiny_model_dir, tmp_path):
    srv = start_embedded_server(tiny_model_dir, log_path=tmp_path / "server.log")
    try:
        async def main():
            body = {"input_ids": [1, 2, 3], "stream": True, "return_logprob": True, "top_logprobs_num": 3,
                    "sampling_params": {"max_new_tokens": 120, "temperature": 1.0, "ignore_eos": True, "n": 2,
                                        "sampling_seed": 7}}
            chunks = []
            async with aiohttp.ClientSession() as http:
                async with http.post(srv.url + "/generate", json=body) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            chunks.append(json.loads(line[6:]))
            return chunks

        chunks = asyncio.run(main())
    finally:
        srv.stop()
    last = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(last) == [0, 1] and all(len(c["output_ids"]) == 120 for c in last.values())
    for c in chunks:
        ref, m, n = last[c["index"]], c["meta_info"], len(c["output_ids"])
        assert m["completion_tokens"] == n == len(m["output_token_logprobs"]) == len(m["output_top_logprobs"])
        assert c["output_ids"] == ref["output_ids"][:n]
        assert m["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"][:n]
        assert m["output_top_logprobs"] == ref["meta_info"]["output_top_logprobs"][:n]
