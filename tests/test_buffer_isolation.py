"""Items coalesced into one script call succeed or fail on their own (issue #18 item 7).

A damaged stored field of one sample (here its ``maxv``, which ``append`` did not validate) or a
damaged group met by one claim request must fail that item only, with its own error, while the
neighbours in the same ``EVALSHA`` are applied and told so. Real redis-server (tests/conftest.py).
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from buffers import BadRequest, MalformedData, ReplayBuffer
from test_buffer import feed, open_buf


async def _two_running(buf: ReplayBuffer):
    await feed(buf, 1)
    a, b = await buf.claim("w", 2)
    return a, b


async def test_append_damaged_maxv_fails_alone(redis_url):
    buf = await open_buf(redis_url)
    raw = aioredis.Redis.from_url(redis_url)
    try:
        a, b = await _two_running(buf)
        await raw.hset(buf.prefix + f"sample:{b.sample_id}", "maxv", "not-a-number")
        # a first, b second, in one coalesced call: a's write must stand and a must be told so
        ra, rb = await asyncio.gather(buf.append(a, [11, 12], [-0.1, -0.2], [0, 0]),
                                      buf.append(b, [13], [-0.3], [0]), return_exceptions=True)
        assert ra == 2, ra
        assert isinstance(rb, MalformedData), rb
        assert len(await raw.hget(buf.prefix + f"sample:{a.sample_id}", "ids")) == 8
        assert await raw.hget(buf.prefix + f"sample:{b.sample_id}", "ids") == b""  # nothing half-applied
        # b second in the call, a still fine: order does not matter
        rb, ra = await asyncio.gather(buf.append(b, [13], [-0.3], [0]),
                                      buf.append(a, [13], [-0.3], [0]), return_exceptions=True)
        assert isinstance(rb, MalformedData) and ra == 3
    finally:
        await raw.aclose()
        await buf.close()


async def test_score_bad_advantage_kind_fails_alone(redis_url):
    buf = await open_buf(redis_url)
    try:
        a, b = await _two_running(buf)
        await buf.end_segment(a, "stop", [11], [-0.1], [0])
        await buf.end_segment(b, "stop", [11], [-0.1], [0])
        good = buf.score(a, reward=1.0)
        bad = buf._scores.submit([b.sample_id, b.claim_token, "reward", "1.0", "bogus", b"", ""])
        ra, rb = await asyncio.gather(good, bad, return_exceptions=True)
        assert ra.value == "generating" and isinstance(rb, BadRequest), (ra, rb)
        assert (await buf.get_sample(a.sample_id)).status.value == "scored"
        assert (await buf.get_sample(b.sample_id)).status.value == "complete"
    finally:
        await buf.close()


async def test_claim_requests_are_independent(redis_url):
    """Request A leases two samples; request B, in the same call, meets a damaged group: A gets
    its leases (before: the whole call failed after A's leases were taken), B gets the error."""
    buf = await open_buf(redis_url, rollout_batch_size=2)
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await feed(buf, 2)  # g0, g1; fresh order g0/0, g0/1, g1/0, g1/1
        await raw.hdel(buf.prefix + "group:g1", "prompt")
        ra, rb = await asyncio.gather(buf.claim("A", 2), buf.claim("B", 1), return_exceptions=True)
        assert isinstance(rb, MalformedData), rb
        assert sorted(i.sample_id for i in ra) == ["g0/0", "g0/1"]
        leases = await raw.zrange(buf.prefix + "leases", 0, -1)
        assert sorted(x.decode() for x in leases) == ["g0/0", "g0/1"]
    finally:
        await raw.aclose()
        await buf.close()


async def test_claim_bad_max_items_is_a_bad_request(redis_url):
    buf = await open_buf(redis_url)
    try:
        await feed(buf, 1)
        ra, rb = await asyncio.gather(buf.claim("A", 1), buf._claims.submit(["", 1]), return_exceptions=True)
        assert len(ra) == 1 and isinstance(rb, BadRequest), (ra, rb)
    finally:
        await buf.close()


def test_cli_connection_error_hides_the_password(capsys):
    from buffers.cli import main as cli_main

    assert cli_main(["stats", "--redis_url", "redis://:hunter2-very-secret@127.0.0.1:1/0", "--run", "t"]) == 1
    err = capsys.readouterr().err
    assert "hunter2-very-secret" not in err and "redis://:***@127.0.0.1:1/0" in err


@pytest.mark.parametrize("url", ["redis://:pw-secret-1@h:1/0", "redis://role:pw-secret-1@h:1/0"])
def test_redact_url(url):
    from asyncrl.core.secret_values import redact_url, url_without_password

    assert "pw-secret-1" not in redact_url(url) and "***" in redact_url(url)
    assert "pw-secret-1" not in url_without_password(url) and url_without_password(url).startswith("redis://")
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
