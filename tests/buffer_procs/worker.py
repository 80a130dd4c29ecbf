"""Rollout-worker process with a deterministic fake generator (no engine).

Claims work, "generates" ``expected_tokens(sample_id)`` within ``max_new_tokens``, appends
chunks of ``flush_tokens``, ends the segment (``stop`` at the expected length, else
``length``, or ``abort`` when the clock moved), and scores complete samples.

usage: worker.py URL RUN WORKER_ID CRASH_KIND CRASH_AT
crash kinds: after_append (right after an acknowledged write), before_end (between a chunk
flush and the end of the segment), after_complete (COMPLETE, not scored), none.
"""

from __future__ import annotations

import asyncio
import sys

from common import SETTINGS, Crasher, expected_tokens, open_buffer, retry, reward_fails
from asyncrl.core.types import WorkKind
from buffers import BufferError


async def run_item(buf, it, crasher: Crasher) -> None:
    sid = it.sample_id
    want = expected_tokens(sid)
    if it.kind == WorkKind.GENERATE:
        assert it.response_ids == want[: len(it.response_ids)], f"{sid}: stored tokens differ from the generator's"
        version = it.clock_version
        start = len(it.response_ids)
        end = min(len(want), start + it.max_new_tokens)
        pos = start
        finish = "stop" if end == len(want) else "length"
        while pos < end:
            n = min(SETTINGS.flush_tokens, end - pos)
            ids = want[pos:pos + n]
            await retry(buf.append, it, ids, [-0.001 * t for t in range(pos, pos + n)], [version] * n)
            pos += n
            crasher.point("after_append")
            if await retry(buf.clock.version) != version and pos < end:
                finish = "abort"  # a weight update interrupts the engine call
                break
        crasher.point("before_end")
        status = await retry(buf.end_segment, it, finish)
        if status.value != "complete":
            return
        crasher.point("after_complete")
    if reward_fails(sid):
        await retry(buf.score, it, error="fake verifier failure")
    else:
        await retry(buf.score, it, reward=float(len(want) % 3))


async def main(url: str, run: str, worker: str, crasher: Crasher) -> None:
    buf = await open_buffer(url, run)
    while True:
        items = await retry(buf.claim, worker, 4)
        if not items:
            await asyncio.sleep(0.02)
            continue
        for it in items:
            try:
                await run_item(buf, it, crasher)
            except BufferError:
                pass  # lease reclaimed/revoked or weights abandoned: drop the request, as a worker does


if __name__ == "__main__":
    url, run, worker, kind, at = sys.argv[1:6]
    asyncio.run(main(url, run, worker, Crasher(kind, int(at))))
