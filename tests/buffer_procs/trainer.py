"""Trainer process (rank 0 only, no model): takes batches, "trains", acknowledges, publishes
a new policy version every step and checkpoints every CKPT steps (a JSON file: step,
version, and the groups trained per step = the surviving lineage), then commits.

On start it loads the checkpoint (or starts at step 0, version 0) and calls
``recover(step, version)``. Each trained group is checked: indices 0..n-1 once each, every
SCORED sample's tokens equal the generator's (no chunk lost or duplicated).
It exits 0 when every fed group is trained or dropped.

usage: trainer.py URL RUN TOTAL CKPT_PATH CKPT_EVERY CRASH_KIND CRASH_AT
crash kinds: after_batch (handed out, not acknowledged), after_ack, after_publish,
after_checkpoint (checkpoint written, buffer not committed), none.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from common import SETTINGS, Crasher, expected_tokens, open_buffer, retry, reward_fails, write_json_atomic
from buffers import VersionConflict


def check_group(bg) -> list[str]:
    problems = []
    n, g = SETTINGS.n_samples_per_prompt, SETTINGS.samples_generated  # g > n: best-of-n keeps n
    idx = sorted(s.index for s in bg.samples)
    if len(set(idx)) != len(idx) or any(i >= g for i in idx) or len(idx) != min(n, g - bg.n_failed):
        problems.append(f"{bg.group.group_id}: sample indices {idx} with {bg.n_failed} failed: not min({n}, {g} - failed)")
    for s in bg.samples:
        if s.response_ids != expected_tokens(s.sample_id) or reward_fails(s.sample_id):
            problems.append(f"{s.sample_id}: tokens {s.response_ids} != {expected_tokens(s.sample_id)}")
        if len(s.versions) != len(s.response_ids) or len(s.behaviour_logprobs) != len(s.response_ids):
            problems.append(f"{s.sample_id}: arrays misaligned")
    return problems


async def publish(buf, version: int) -> None:
    try:
        await retry(buf.clock.publish, version, f"file:///w/{version}", f"c{version}")
    except VersionConflict:
        if await retry(buf.clock.version) < version:
            raise


async def main(url, run, total, ckpt_path: Path, every: int, crasher: Crasher) -> int:
    buf = await open_buffer(url, run)
    ckpt = json.loads(ckpt_path.read_text()) if ckpt_path.exists() else {"step": 0, "version": 0, "trained": {}}
    step, version, trained = ckpt["step"], ckpt["version"], ckpt["trained"]
    await retry(buf.recover, step, version, f"file:///w/{version}", f"c{version}")
    while True:
        dropped = await retry(buf.dropped_groups)
        done = sum(len(v) for v in trained.values())
        if done + len(dropped) >= total and await retry(buf.dataset_cursor) >= total:
            write_json_atomic(ckpt_path, {"step": step, "version": version, "trained": trained})
            await retry(buf.commit, step)
            return 0
        batch = await retry(buf.next_batch, step + 1)
        if batch is None and await retry(buf.dataset_cursor) >= total and await retry(buf.only_ready_left):
            batch = await retry(buf.next_batch, step + 1, 1)  # the end of the dataset: a smaller last batch
        if batch is None:
            await asyncio.sleep(0.02)
            continue
        crasher.point("after_batch")
        problems = [p for g in batch.groups for p in check_group(g)]
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 3
        step += 1
        await retry(buf.acknowledge, batch, step)
        trained[str(step)] = batch.group_ids
        crasher.point("after_ack")
        version = step
        await publish(buf, version)
        crasher.point("after_publish")
        if step % every == 0:
            write_json_atomic(ckpt_path, {"step": step, "version": version, "trained": trained})
            crasher.point("after_checkpoint")
            await retry(buf.commit, step)


if __name__ == "__main__":
    url, run, total, path, every, kind, at = sys.argv[1:8]
    sys.exit(asyncio.run(main(url, run, int(total), Path(path), int(every), Crasher(kind, int(at)))))
