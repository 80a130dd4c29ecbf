"""Feeder process: feeds ``total`` prompt groups two at a time, keeping about R pending.

usage: feeder.py URL RUN TOTAL CRASH_KIND CRASH_AT  (crash kind ``after_feed`` or ``none``)
"""

from __future__ import annotations

import asyncio
import sys

from common import SETTINGS, Crasher, group_ids, open_buffer, retry
from buffers import CursorMismatch


async def main(url: str, run: str, total: int, crasher: Crasher) -> None:
    buf = await open_buffer(url, run)
    gids = group_ids(total)
    while True:
        cur = await retry(buf.dataset_cursor)
        if cur >= total:
            return
        if await retry(buf.pending_groups) >= SETTINGS.rollout_batch_size:
            await asyncio.sleep(0.02)
            continue
        chunk = gids[cur:cur + 2]
        try:
            await retry(buf.feed, [buf.make_group(g, [1, 2, 3 + i]) for i, g in enumerate(chunk, cur)], cur)
        except CursorMismatch:
            continue  # a retried feed whose first attempt was applied: nothing repeated
        crasher.point("after_feed")


if __name__ == "__main__":
    url, run, total, kind, at = sys.argv[1:6]
    asyncio.run(main(url, run, int(total), Crasher(kind, int(at))))
