"""Reading the buffer: decoded groups and samples, and the stats ``asyncrl buffer stats`` prints.

Read-only: nothing here changes the run's state (every transition is a Lua script, called from
``buffers/buffer.py``). :class:`BufferInspection` is a base of :class:`buffers.ReplayBuffer`,
whose ``redis``, ``prefix``, ``run`` and ``settings`` it reads; use it through the buffer
(``await buf.get_group(gid)``, ``await buf.stats()``).
"""

from __future__ import annotations

import json
from typing import Any

from asyncrl.core.types import (
    SEGMENT_REASONS,
    GroupState,
    PromptGroup,
    Sample,
    SampleStatus,
    Segment,
    unpack_f32,
    unpack_i32,
)
from buffers.errors import MalformedData, UnknownItem
from buffers.scripts import _s

__all__ = ["BufferInspection", "sampling_counts"]


def sampling_counts(counters: dict[str, int]) -> dict[str, Any]:
    """Best-of-n, dynamic sampling, pass-rate filter and selective-rollout counts from the buffer's ``stats`` counters.

    ``zero_variance_share`` = groups whose trained samples all had the same reward / groups that
    finished with at least min(2, n) scored samples (counted whether or not dynamic sampling drops
    them; 0.0 before any group finished). ``predicted_skip_share`` = prompts the selective-rollout
    rule skipped / (groups fed + those prompts) (0.0 before any feed). The useful (non-zero-variance)
    share of generated groups is ``1 - zero_variance_share``.
    """
    finished = counters.get("finished_groups", 0)
    zero = counters.get("zero_variance_groups", 0)
    predicted = counters.get("skipped_prompts:zero_variance_predicted", 0)
    visits = counters.get("fed", 0) + predicted
    return {
        "finished_groups": finished,
        "zero_variance_groups": zero,
        "zero_variance_share": zero / finished if finished else 0.0,
        "discarded_best_of_n": counters.get("discarded_best_of_n", 0),
        "skipped_prompts": sum(v for k, v in counters.items() if k.startswith("skipped_prompts:")),
        # selective rollout (asyncrl.feeder.selective_rollout): visits skipped before generation, by kind,
        # and their share of the visits the rule saw (groups fed + predicted skips)
        "skipped_zero_variance_predicted": predicted,
        "predicted_skips_easy": counters.get("predicted_skips:easy", 0),
        "predicted_skips_hard": counters.get("predicted_skips:hard", 0),
        "predicted_skip_share": predicted / visits if visits else 0.0,
    }

_SEGMENT_REASON = SEGMENT_REASONS  # asyncrl.core.types: the codes of buffers/lua/settings.lua, a lost lease read as abort


class BufferInspection:
    """Read-only queries of one run's buffer (a base of :class:`buffers.ReplayBuffer`).

    Needs the attributes ``redis`` (a ``redis.asyncio.Redis``), ``prefix`` (the run's key
    prefix), ``run`` (its name) and ``settings`` (its :class:`buffers.BufferSettings`).
    """

    redis: Any
    prefix: str
    run: str
    settings: Any

    async def get_group(self, group_id: str) -> tuple[PromptGroup, list[Sample]]:
        """A group and its samples, decoded.

        Raises:
            UnknownItem: no such group; MalformedData: damaged record.
        """
        raw = await self.redis.hgetall(self.prefix + f"group:{group_id}")
        if not raw:
            raise UnknownItem(f"prompt group {group_id} does not exist in run {self.run}")
        h = {k.decode(): v for k, v in raw.items()}
        try:
            n = int(h["n"])
            group = PromptGroup(
                group_id=_s(h["gid"]), prompt_ids=unpack_i32(h["prompt"]), metadata=json.loads(h["meta"]),
                n_samples=n, feed_index=int(h.get("feed_index", -1)), state=GroupState(_s(h["state"])),
                admission_seq=int(h.get("seq", 0)),
            )
        except (KeyError, ValueError) as exc:
            raise MalformedData(f"prompt group {group_id} record is damaged: {exc!r}") from None
        samples: list[Sample] = []
        if group.state != GroupState.PENDING:
            async with self.redis.pipeline(transaction=False) as pipe:
                for i in range(n):
                    pipe.hgetall(self.prefix + f"sample:{group_id}/{i}")
                raws = await pipe.execute()
            samples = [self._decode_sample(f"{group_id}/{i}", r) for i, r in enumerate(raws)]
        return group, samples

    async def episode_record(self, sample_id: str) -> tuple[list[float], list[int], list[Segment], str | None]:
        """What a replay of an episode needs beyond its claimed token ids (docs/agents.md).

        Returns:
            ``(behaviour_logprobs, versions, segments, finish_reason)`` of the sample, the arrays
            of shape (R,).

        Raises:
            UnknownItem, MalformedData.
        """
        sample = await self.get_sample(sample_id)
        return sample.behaviour_logprobs, sample.versions, sample.segments, sample.finish_reason

    async def get_sample(self, sample_id: str) -> Sample:
        """One sample, decoded. Raises UnknownItem or MalformedData."""
        raw = await self.redis.hgetall(self.prefix + f"sample:{sample_id}")
        return self._decode_sample(sample_id, raw)

    def _decode_sample(self, sid: str, raw: dict) -> Sample:
        if not raw:
            raise UnknownItem(f"sample {sid} does not exist in run {self.run}")
        h = {k.decode(): v for k, v in raw.items()}
        try:
            ids, lps, vers = unpack_i32(h["ids"]), unpack_f32(h["lps"]), unpack_i32(h["vers"])
            if not len(ids) == len(lps) == len(vers):
                raise ValueError(f"array lengths differ: {len(ids)}, {len(lps)}, {len(vers)}")
            segs_raw = unpack_i32(h.get("segs", b""))
            if len(segs_raw) % 3:
                raise ValueError("segment array is not a multiple of 3 int32")
            segs = [
                Segment(segs_raw[j], segs_raw[j + 1], _SEGMENT_REASON.get(segs_raw[j + 2] % 16, "abort"),
                        segs_raw[j + 2] // 16)
                for j in range(0, len(segs_raw), 3)
            ]
            adv: Any = None
            advk = _s(h.get("adv_kind", b""))
            if advk == "scalar":
                adv = float(h["adv"])
            elif advk == "tokens":
                adv = unpack_f32(h["adv"])
            finish = _s(h.get("finish", b"")) or None
            return Sample(
                sample_id=_s(h["sid"]), group_id=_s(h["gid"]), index=int(h["idx"]), response_ids=ids,
                behaviour_logprobs=lps, versions=vers, segments=segs, status=SampleStatus(_s(h["status"])),
                finish_reason=finish, reward=float(h["reward"]) if "reward" in h else None,
                error=_s(h["error"]) if "error" in h else None, advantages=adv,
                num_resumes=int(h.get("resumes", 0)), num_restarts=int(h.get("restarts", 0)),
                created_ms=int(h.get("created", 0)), updated_ms=int(h.get("updated", 0)),
                completed_ms=int(h.get("completed", 0)),
                info=json.loads(h["info"]) if "info" in h else None,
            )
        except (KeyError, ValueError) as exc:
            raise MalformedData(f"sample {sid} record is damaged: {exc!r}") from None

    async def stats(self) -> dict[str, Any]:
        """Counts by state, staleness histogram, partial ratio, oldest version in flight,
        drop/restart counts by reason, lineage, clock (what ``asyncrl buffer stats`` prints)."""
        p = self.prefix
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in ("fresh", "resumable", "parked", "unscored", "leases", "inflight", "ready", "groups"):
                pipe.zcard(p + name)
            pipe.llen(p + "pending")
            pipe.llen(p + "replay")
            pipe.hgetall(p + "stats")
            pipe.get(p + "version")
            pipe.get(p + "lineage")
            pipe.get(p + "cursor")
            pipe.get(p + "admitted")
            pipe.zrange(p + "groups", 0, -1)
            pipe.get(p + "batch:open")
            pipe.get(p + "last_acked_step")
            pipe.get(p + "committed_step")
            res = await pipe.execute()
        (fresh, resumable, parked, unscored, leased, inflight, ready, live, pending, replay, counters,
         version, lineage, cursor, admitted, gids, open_batch, last_acked, committed) = res
        version = int(version or 0)
        counters = {_s(k): int(v) for k, v in counters.items()}
        group_states: dict[str, int] = {}
        sample_states: dict[str, int] = {}
        hist: dict[int, int] = {}
        oldest_in_flight: int | None = None
        partial_samples = 0
        gids = [_s(g) for g in gids]
        async with self.redis.pipeline(transaction=False) as pipe:
            for gid in gids:
                pipe.hmget(p + f"group:{gid}", "state", "n")
            ginfo = await pipe.execute()
        async with self.redis.pipeline(transaction=False) as pipe:
            for gid, (state, n) in zip(gids, ginfo):
                for i in range(int(n or 0)):
                    pipe.hmget(p + f"sample:{gid}/{i}", "status", "minv", "resumes")
            sinfo = iter(await pipe.execute())
        for gid, (state, n) in zip(gids, ginfo):
            st = _s(state or b"missing")
            group_states[st] = group_states.get(st, 0) + 1
            gmin = -1
            for _ in range(int(n or 0)):
                sst, minv, resumes = next(sinfo)
                sst = _s(sst or b"missing")
                sample_states[sst] = sample_states.get(sst, 0) + 1
                mv = int(minv or -1)
                if mv >= 0:
                    gmin = mv if gmin < 0 else min(gmin, mv)
                if sst == "partial" or int(resumes or 0) > 0:
                    partial_samples += 1
            if st in ("generating", "ready") and gmin >= 0:
                oldest_in_flight = gmin if oldest_in_flight is None else min(oldest_in_flight, gmin)
            if st in ("ready", "batched") and gmin >= 0:
                hist[version - gmin] = hist.get(version - gmin, 0) + 1
        group_states["pending"] = int(pending)
        total_samples = sum(sample_states.values())
        return {
            "run": self.run,
            "version": version,
            "lineage": int(lineage or 0),
            "dataset_cursor": int(cursor or 0),
            "admitted_groups": int(admitted or 0),
            "groups_by_state": group_states,
            "samples_by_state": sample_states,
            "queues": {"fresh": fresh, "resumable": resumable, "parked": parked, "unscored": unscored,
                       "leased": leased, "inflight_groups": inflight, "ready": ready, "replay": replay,
                       "live_groups": live},
            "staleness_histogram": {str(k): v for k, v in sorted(hist.items())},
            "partial_ratio": (partial_samples / total_samples) if total_samples else 0.0,
            "oldest_version_in_flight": oldest_in_flight,
            "dropped_by_reason": {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("dropped_groups:")},
            "restarted_by_reason": {k[len("restarted_"):]: v for k, v in counters.items() if k.startswith("restarted_")},
            "open_batch": _s(open_batch) if open_batch else None,
            "last_acked_step": int(last_acked) if last_acked is not None else None,
            "committed_step": int(committed) if committed is not None else None,
            "counters": counters,
            "sampling": sampling_counts(counters),
            "settings": self.settings.to_stored(),  # as stored: the budget as max_budget_tokens
        }

    async def books(self) -> dict[str, Any]:
        """The reconciliation of the run's prompts and groups, by reason (docs/buffer.md#the-books).

        ``cursor = fed + skipped`` (prompts the pass-rate filter kept out) and ``fed = committed +
        dropped + live + pending``, where ``dropped`` is by reason (``zero_variance`` for dynamic
        sampling among them); best-of-n discards samples, not groups, and is reported beside.
        ``balanced`` is True when both equations hold; read while roles run, a group may move between
        two reads, so call it on a quiet run.
        """
        p = self.prefix
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.get(p + "cursor")
            pipe.hgetall(p + "stats")
            pipe.hlen(p + "dropped")
            pipe.zcard(p + "groups")
            pipe.llen(p + "pending")
            cursor, counters, dropped, live, pending = await pipe.execute()
        counters = {_s(k): int(v) for k, v in counters.items()}
        cursor = int(cursor or 0)
        fed = counters.get("fed", 0)
        skipped = {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("skipped_prompts:")}
        by_reason = {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("dropped_groups:")}
        committed = counters.get("committed_groups", 0)
        balanced = (cursor == fed + sum(skipped.values()) and fed == committed + dropped + live + pending
                    and sum(by_reason.values()) == dropped)
        return {"cursor": cursor, "fed": fed, "skipped_by_reason": skipped, "committed_groups": committed,
                "dropped_groups": dropped, "dropped_by_reason": by_reason, "live_groups": live,
                "pending_groups": pending, **sampling_counts(counters), "balanced": balanced}

    async def dropped_groups(self) -> dict[str, str]:
        """Every dropped group id and its reason."""
        raw = await self.redis.hgetall(self.prefix + "dropped")
        return {_s(k): _s(v) for k, v in raw.items()}
