"""The replay buffer client: feed, claim, append, score, batch, acknowledge, commit, recover.

One :class:`ReplayBuffer` per process over one ``redis.asyncio.Redis`` (redis-py's asyncio
guidance: one client per process, shared by its tasks). Every transition is one Lua script in
``buffers/lua`` (validate first, then write), so a client killed between two calls leaves no
half-applied state, and a Redis killed with ``kill -9`` keeps every acknowledged write (AOF,
see ``asyncrl/controller/redis_server.py``). The API contract and state diagram are in docs/buffer.md.

Beside this module: ``buffers/settings.py`` (:class:`BufferSettings`, the knobs enforced),
``buffers/inspection.py`` (reading groups and samples, ``stats``), ``buffers/scripts.py`` (the
Lua scripts), ``buffers/version_clock.py`` (the clock) and ``buffers/keys.py`` (the layout).

Design choices (and simplifications):

* Work is a set of sorted sets with a lease sorted set instead of a stream + consumer group:
  it gives the same guarantees (lease, reclaim after ``lease_seconds``, at-most-one owner via a
  fencing ``claim_token``) and, unlike a stream, the priority order the design asks for
  (unscored complete → resumable partials by oldest version → fresh → budget-parked when idle).
* Appends are exactly-once: each chunk carries the offset it starts at.
* One trainer consumer (rank 0): at most one batch is open (handed out, not acknowledged).
* Admission control (AReaL eq. 3) runs inside feed/claim/score/acknowledge: at most R groups
  being generated (READY groups do not count, as AReaL counts running rollouts only) and
  ``admitted < (eta + v + 1) * B * batches_per_version``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any, Iterable, Sequence

from asyncrl.core.types import (
    Batch,
    BatchGroup,
    GroupState,
    PromptGroup,
    SampleStatus,
    WorkItem,
    WorkKind,
    pack_f32,
    pack_i32,
    unpack_i32,
)
from buffers.errors import (
    BadRequest,
    MalformedData,
    SchemaMismatch,
    SettingsMismatch,
    UnknownItem,
)
from buffers.inspection import BufferInspection
from buffers.keys import GROUP_ID, SCHEMA_VERSION, key_prefix
from buffers.pass_rates import PassRateStore
from buffers.scripts import Coalescer, Scripts, _s, decode_error

# The settings live in buffers/settings.py; these names stay importable from here.
from buffers.settings import FINISH_REASONS, STALE_POLICIES, BufferSettings, settings_fields  # noqa: F401
from buffers.timeline import origin_of
from buffers.version_clock import VersionClock

__all__ = ["BufferSettings", "ReplayBuffer", "STALE_POLICIES", "FINISH_REASONS"]


_APPEND_STATUS = ("running", "complete", "partial", "pending")


def _tagged(finish: str, trajectory: int | None) -> str:
    """``finish`` with an episode's trajectory tag ``@k`` (buffers/lua/append.lua), or as is.

    Raises:
        BadRequest: ``trajectory`` outside 0-15.
    """
    if trajectory is None:
        return finish
    if not 0 <= int(trajectory) <= 15:
        raise BadRequest(f"trajectory must be in 0..15, got {trajectory}")
    return f"{finish}@{int(trajectory)}"


def _decode_append(reply: Any) -> Any:
    """``length * 8 + status code`` -> (length, status); an error string -> its exception."""
    if isinstance(reply, int):
        return reply >> 3, _APPEND_STATUS[reply & 7]
    return decode_error(reply)


def _decode_score(reply: Any) -> Any:
    """Group state string -> GroupState; ``!<CODE> <message>`` -> its exception."""
    if reply[:1] == b"!":
        return decode_error(reply[1:])
    return GroupState(_s(reply))


class ReplayBuffer(BufferInspection, PassRateStore):
    """Client of one run's replay buffer. Create with :meth:`open`; see docs/buffer.md.

    Reading groups, samples and stats (``get_group``, ``get_sample``, ``stats``,
    ``dropped_groups``, ``books``) comes from :class:`buffers.inspection.BufferInspection`; the
    pass-rate filter's keys from :class:`buffers.pass_rates.PassRateStore`.
    """

    def __init__(self, redis: Any, run: str, settings: BufferSettings, owns_client: bool,
                 role: str = "client", timeline: bool = True) -> None:
        self.redis = redis
        self.run = run
        self.prefix = key_prefix(run)
        self.settings = settings
        self._owns = owns_client
        self._scripts = Scripts(redis)
        #: ``role@host:pid`` sent with every script call for the timeline ('' = not recorded)
        self.origin = origin_of(role) if timeline else ""
        self.clock = VersionClock(redis, run, self._scripts, origin=self.origin)
        # KEYS[1]: a key every role may write (Redis ACLs treat a script's declared keys as read-write)
        self._head = [self.prefix + "stats"]
        self._argv = [self.prefix, SCHEMA_VERSION, *settings.lua_args(), self.origin]
        self._appends = Coalescer(lambda *a: self._run("append", *a), _decode_append)
        self._scores = Coalescer(lambda *a: self._run("score", *a), _decode_score)
        self._claims = Coalescer(lambda *a: self._run("claim", *a), self._decode_claim, max_items=64)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def open(
        cls, redis: Any, run: str, settings: BufferSettings | None = None, *, max_connections: int = 256,
        role: str = "client", timeline: bool = True,
    ) -> "ReplayBuffer":
        """Open (create on first use) the keyspace of ``run``.

        Args:
            redis: ``redis://[USER:PASSWORD@]HOST:PORT/DB`` URL (``str`` or pydantic ``SecretStr``)
                or a ``redis.asyncio.Redis`` created with ``decode_responses=False``.
            run: run name (``asyncrl:{<run>}:`` prefix).
            settings: the knobs; stored on first open, must equal the stored ones afterwards;
                None uses the stored ones (tools), or raises when the run does not exist.
            max_connections: pool size when a URL is given (peak concurrent calls).
            role: this process's role (``rollout``, ``trainer``, ``feeder``, ``controller``...),
                recorded with the host with every transition in the sample timelines.
            timeline: record the timeline of every sample's life (docs/buffer.md#timeline); False
                sends an empty origin and the scripts record nothing.

        Raises:
            SchemaMismatch: another schema version, or foreign keys under the prefix.
            SettingsMismatch: ``settings`` differ from the stored ones.
            UnknownItem: ``settings`` is None and the run does not exist, or the run does not exist
                and these credentials (a role's Redis user) may not create it.
            MalformedData: stored settings cannot be parsed.
        """
        owns = isinstance(redis, str) or hasattr(redis, "get_secret_value")
        if owns:
            import redis.asyncio as aioredis

            from asyncrl.core.secret_values import reveal

            client = aioredis.Redis.from_url(reveal(redis) or "", decode_responses=False, max_connections=max_connections)
        else:
            client = redis
            if client.connection_pool.connection_kwargs.get("decode_responses"):
                raise BadRequest("the buffer needs a redis client with decode_responses=False (arrays are packed bytes)")
        prefix = key_prefix(run)
        try:
            stored = await client.get(prefix + "schema")
            if stored is None:
                async for _key in client.scan_iter(match=prefix.replace("{", "\\{").replace("}", "\\}") + "*", count=100):
                    if await client.get(prefix + "schema") is not None:
                        break  # another role created the run concurrently
                    raise SchemaMismatch(
                        f"keyspace {prefix} holds keys but no schema key: foreign data; "
                        f"use another run name or `asyncrl buffer drain --run {run}`"
                    )
                if settings is None:
                    raise UnknownItem(f"run {run!r} has no buffer yet; open it with settings first")
                from redis.exceptions import NoPermissionError, ResponseError

                try:
                    async with client.pipeline(transaction=True) as pipe:
                        pipe.set(prefix + "schema", SCHEMA_VERSION, nx=True)
                        pipe.set(prefix + "settings", settings.to_json(), nx=True)
                        await pipe.execute()
                except (NoPermissionError, ResponseError) as exc:
                    if "NOPERM" not in str(exc) and not isinstance(exc, NoPermissionError):
                        raise
                    raise UnknownItem(
                        f"run {run!r} has no buffer yet and these Redis credentials may not create it: "
                        "the controller (or feeder) creates it; start it first (docs/security.md)"
                    ) from None
                stored = await client.get(prefix + "schema")
            if _s(stored) != SCHEMA_VERSION:
                raise SchemaMismatch(
                    f"keyspace {prefix} was written with schema {_s(stored)!r}; this asyncrl reads "
                    f"{SCHEMA_VERSION!r}: use a matching asyncrl version or another run name"
                )
            raw = await client.get(prefix + "settings")
            try:
                stored_settings = BufferSettings.from_stored(raw)
            except (TypeError, ValueError) as exc:
                raise MalformedData(f"stored settings of run {run!r} cannot be read: {exc}") from None
            if settings is not None and settings != stored_settings:
                raise SettingsMismatch(
                    f"run {run!r} was opened with {stored_settings}, now {settings}: every role must use "
                    "the same rollout/buffer settings (drain the run to change them)"
                )
        except BaseException:
            if owns:
                await client.aclose()
            raise
        return cls(client, run, stored_settings, owns, role=role, timeline=timeline)

    @classmethod
    async def open_for(cls, cfg: Any, role: str, url: Any = None) -> "ReplayBuffer":
        """Open ``cfg``'s run as ``role`` (``rollout``, ``trainer``, ``feeder``, ``controller``): the one way
        every role does. ``url`` (default ``cfg.buffer.redis_url``), ``cfg.run.name``, the settings of
        :meth:`BufferSettings.from_config`, and ``cfg.buffer.timeline`` (false: this role records no
        timeline event, docs/buffer.md#timeline). Raises what :meth:`open` raises."""
        return await cls.open(url or cfg.buffer.redis_url, run=cfg.run.name, settings=BufferSettings.from_config(cfg),
                              role=role, timeline=cfg.buffer.timeline)

    async def close(self) -> None:
        """Close the client if this buffer created it."""
        if self._owns:
            await self.redis.aclose()

    async def __aenter__(self) -> "ReplayBuffer":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, name: str, *args: Any) -> Any:
        return await self._scripts.run(name, self._head, [*self._argv, *args])

    # ------------------------------------------------------------------ feeder
    async def dataset_cursor(self) -> int:
        """Index of the next dataset prompt to feed."""
        return int(await self.redis.get(self.prefix + "cursor") or 0)

    async def pending_groups(self) -> int:
        """Groups fed but not admitted yet (feed while this is below R)."""
        return int(await self.redis.llen(self.prefix + "pending"))

    async def feed(self, groups: Sequence[PromptGroup], start_cursor: int, skip: int = 0,
                   predicted: Sequence[tuple[int, str]] = ()) -> int:
        """Append ``groups`` and move the dataset cursor to ``start_cursor + len(groups) + skip +
        len(predicted)``, atomically.

        ``skip``: dataset positions right after the groups that are not fed because the pass-rate
        filter removed their prompts (counted ``skipped_prompts:pass_rate_filter``); ``predicted``:
        ``(train problem key, "easy" | "hard")`` of the positions after the groups that the
        selective-rollout rule skipped (:mod:`asyncrl.feeder.selective_rollout`; counted
        ``skipped_prompts:zero_variance_predicted`` and ``predicted_skips:<kind>``, and each
        problem's ``prompt_skips`` += 1). So cursor = groups fed + prompts skipped, by reason.

        Returns:
            the new cursor.

        Raises:
            CursorMismatch: the stored cursor is not ``start_cursor`` (nothing written).
            DuplicateItem: a group id exists already (nothing written).
            BadRequest: bad group id, empty prompt, n outside [1, 1024], a negative ``skip``, or a
                predicted skip with a negative problem key or a kind other than easy/hard.
        """
        if skip < 0:
            raise BadRequest(f"skip must be >= 0, got {skip}")
        pred_args: list[Any] = [len(predicted)]
        for problem, kind in predicted:
            if not isinstance(problem, int) or problem < 0 or kind not in ("easy", "hard"):
                raise BadRequest(f"predicted skip ({problem!r}, {kind!r}) needs a problem key >= 0 and kind "
                                 f"'easy' or 'hard'")
            pred_args += [problem, kind]
        args: list[Any] = [int(start_cursor), len(groups)]
        for g in groups:
            if not GROUP_ID.match(g.group_id):
                raise BadRequest(f"group_id {g.group_id!r} must match {GROUP_ID.pattern}")
            if not g.prompt_ids:
                raise BadRequest(f"prompt group {g.group_id} has no prompt tokens")
            if not 1 <= g.n_samples <= 1024:
                raise BadRequest(f"prompt group {g.group_id}: n_samples={g.n_samples} must be in [1, 1024]")
            args += [g.group_id, pack_i32(g.prompt_ids), json.dumps(g.metadata), int(g.n_samples)]
        if len({g.group_id for g in groups}) != len(groups):
            raise BadRequest("feed got the same group_id twice")
        return int(await self._run("feed", *args, int(skip), *pred_args))

    def make_group(self, group_id: str, prompt_ids: Sequence[int], metadata: dict | None = None) -> PromptGroup:
        """A :class:`PromptGroup` generating this run's ``samples_generated`` (G with best-of-n, else n)."""
        return PromptGroup(group_id, list(prompt_ids), dict(metadata or {}), self.settings.samples_generated)

    # ------------------------------------------------------------------ rollout worker
    async def claim(self, worker_id: str, max_items: int = 1) -> list[WorkItem]:
        """Lease up to ``max_items`` work items (order in docs/buffer.md); [] when there is none.

        Raises:
            MalformedData: a stored sample or group is damaged.
        """
        if max_items < 1:
            raise BadRequest(f"max_items must be >= 1, got {max_items}")
        return await self._claims.submit([worker_id, int(max_items)])

    @staticmethod
    def _decode_claim(rows: Any) -> Any:
        """One request's rows -> WorkItems; ``!<CODE> <message>`` -> its exception."""
        if isinstance(rows, (bytes, str)):
            return decode_error(_s(rows)[1:])
        items = []
        for r in rows:
            ids = unpack_i32(r[6])
            items.append(
                WorkItem(
                    kind=WorkKind(_s(r[0])), sample_id=_s(r[1]), group_id=_s(r[2]), index=int(r[3]),
                    claim_token=_s(r[4]), prompt_ids=unpack_i32(r[5]), response_ids=ids,
                    metadata=json.loads(r[7]), max_new_tokens=int(r[8]),
                    produced_under_version_tokens=int(r[9]), clock_version=int(r[10]), lineage=int(r[11]),
                    num_resumes=int(r[12]), length_tokens=len(ids),
                )
            )
        return items

    async def append(
        self, item: WorkItem, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
        trajectory: int | None = None,
    ) -> int:
        """Append one chunk of generated tokens (exactly once, at ``item.length_tokens``).

        Args:
            ids, logprobs, versions: shape (T,) each: token ids, behaviour logprobs, policy versions.

        Returns:
            the response length after the append (also stored in ``item.length_tokens``).

        Raises:
            LeaseLost, VersionAhead, BadRequest, BadOffset, UnknownItem: nothing appended.
        """
        return (await self._append(item, ids, logprobs, versions, _tagged("", trajectory)))[0]

    async def end_segment(
        self,
        item: WorkItem,
        finish_reason: str,
        ids: Sequence[int] = (),
        logprobs: Sequence[float] = (),
        versions: Sequence[int] = (),
        trajectory: int | None = None,
    ) -> SampleStatus:
        """Append an optional last chunk and end the engine call (one script).

        ``stop`` → COMPLETE; ``length`` at ``max_response_len`` → COMPLETE; ``length`` below it
        or ``budget`` → PARTIAL (parked at the budget); ``abort`` → PARTIAL (resumable now; a
        sample with no tokens goes back to PENDING).

        Raises:
            LeaseLost, VersionAhead, BadRequest, BadOffset, UnknownItem: nothing changed.
        """
        if finish_reason not in FINISH_REASONS:
            raise BadRequest(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
        _, status = await self._append(item, ids, logprobs, versions, _tagged(finish_reason, trajectory))
        return SampleStatus(status)

    async def append_observation(self, item: WorkItem, ids: Sequence[int], version: int,
                                 trajectory: int | None = None, kind: str = "obs") -> int:
        """Append an episode's environment tokens as their own ``obs`` segment (docs/agents.md).

        ``kind="ctx"`` appends the prompt of a further trajectory instead (docs/agents.md);
        ``trajectory`` (0-15) tags the segment. Only at a segment boundary (the current model call
        ended with ``turn``). The tokens get
        behaviour logprob 0 and policy version ``version`` (the version of the call before them,
        <= the clock); they count toward ``max_response_len`` but not toward the budget or staleness.

        Returns:
            the response length after the append.

        Raises:
            LeaseLost, BadRequest (empty, an open model call, a version outside [0, clock], past
            ``max_response_len``), BadOffset, UnknownItem: nothing appended.
        """
        if not ids:
            raise BadRequest(f"an observation of sample {item.sample_id} has no tokens")
        if kind not in ("obs", "ctx"):
            raise BadRequest(f"kind must be obs (an observation) or ctx (a trajectory's prompt), got {kind!r}")
        return (await self._append(item, ids, [0.0] * len(ids), [int(version)] * len(ids), _tagged(kind, trajectory)))[0]

    async def restart_episode(self, item: WorkItem) -> None:
        """Send a claimed episode back to its pristine prompt (a non-deterministic workflow, docs/agents.md).

        Counted as ``restarted_samples:nondeterministic``; works on a RUNNING sample and on a
        COMPLETE one being scored.

        Raises:
            LeaseLost, UnknownItem: nothing changed.
        """
        await self._append(item, (), (), (), "restart")
        item.length_tokens = 0

    async def _append(self, item: WorkItem, ids: Any, logprobs: Any, versions: Any, finish: str) -> tuple[int, str]:
        if not (len(ids) == len(logprobs) == len(versions)):
            raise BadRequest(
                f"chunk arrays differ in length: ids {len(ids)}, logprobs {len(logprobs)}, versions {len(versions)}"
            )
        try:
            packed = (pack_i32(ids), pack_f32(logprobs), pack_i32(versions))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        length, status = await self._appends.submit([item.sample_id, item.claim_token, item.length_tokens, *packed, finish])
        item.length_tokens = length
        return length, status

    async def score(
        self,
        item: WorkItem,
        reward: float | None = None,
        error: str | None = None,
        advantages: float | Sequence[float] | None = None,
        info: dict | None = None,
    ) -> GroupState:
        """Record the reward (or the reward function's ``error``) of a COMPLETE sample.

        Exactly one of ``reward`` / ``error``. ``advantages``: optional precomputed scalar or
        per-token list (length = response length). ``info``: an episode's termination reason and
        counts (a JSON object of at most 4096 bytes, docs/agents.md), kept on the sample.

        Returns:
            the group's state afterwards (GENERATING, READY, or DROPPED with ``reward_error`` or, with
            dynamic sampling, ``zero_variance``).

        Raises:
            LeaseLost, InvalidTransition (not COMPLETE), BadRequest, UnknownItem: nothing changed.
        """
        if (reward is None) == (error is None):
            raise BadRequest("score needs exactly one of reward= or error=")
        if reward is not None and not math.isfinite(float(reward)):
            raise BadRequest(f"reward must be finite, got {reward}")
        advk, adv = "", b""
        if advantages is not None:
            if isinstance(advantages, (int, float)):
                if not math.isfinite(float(advantages)):
                    raise BadRequest("advantage must be finite")
                advk, adv = "scalar", repr(float(advantages)).encode()
            else:
                advk = "tokens"
                try:
                    adv = pack_f32(list(advantages))
                except ValueError as exc:
                    raise BadRequest(str(exc)) from None
        raw_info = b""
        if info is not None:
            try:
                raw_info = json.dumps(info, sort_keys=True, allow_nan=False).encode()
            except (TypeError, ValueError) as exc:
                raise BadRequest(f"episode info must be a JSON object of finite values: {exc}") from None
            if not isinstance(info, dict) or len(raw_info) > 4096:
                raise BadRequest(f"episode info must be a JSON object of at most 4096 bytes, got {len(raw_info)} bytes")
        kind, value = ("reward", repr(float(reward))) if reward is not None else ("error", str(error))
        return await self._scores.submit([item.sample_id, item.claim_token, kind, value, advk, adv, raw_info])

    async def renew(self, items: Iterable[WorkItem]) -> int:
        """Extend the leases of ``items`` by ``lease_seconds``; returns how many are still held."""
        args: list[Any] = []
        for it in items:
            args += [it.sample_id, it.claim_token]
        if not args:
            return 0
        return int(await self._run("renew", *args))

    # ------------------------------------------------------------------ trainer
    async def next_batch(self, step: int, min_groups: int | None = None) -> Batch | None:
        """The train batch for ``step`` (B groups, oldest first), or None when fewer are READY.

        An open batch (handed out, not acknowledged) is returned again with ``redelivered=True``.
        ``min_groups`` (default B) lets the trainer take a smaller last batch at the end of a
        finite dataset (see :meth:`only_ready_left`).
        """
        m = self.settings.train_batch_groups if min_groups is None else int(min_groups)
        if not 1 <= m <= self.settings.train_batch_groups:
            raise BadRequest(f"min_groups must be in [1, B={self.settings.train_batch_groups}], got {min_groups}")
        kind, ref = await self._run("next_batch", int(step), m)
        if _s(kind) == "none":
            return None
        return await self._load_batch(_s(ref), redelivered=_s(kind) == "open")

    async def only_ready_left(self) -> bool:
        """True when nothing is pending or generating: every group in flight is READY.

        At the end of a finite dataset the last READY groups may be fewer than B; the trainer
        then calls ``next_batch(step, min_groups=1)``.
        """
        p = self.prefix
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.llen(p + "pending")
            pipe.zcard(p + "inflight")
            pipe.zcard(p + "ready")
            pipe.llen(p + "replay")
            pending, inflight, ready, replay = await pipe.execute()
        return pending == 0 and inflight == ready + replay

    async def wait_batch(self, step: int, timeout_seconds: float | None = None, poll_seconds: float = 0.05) -> Batch:
        """Poll :meth:`next_batch` until a batch forms.

        Raises:
            TimeoutError: none within ``timeout_seconds``.
        """
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        while True:
            batch = await self.next_batch(step)
            if batch is not None:
                return batch
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no train batch of {self.settings.train_batch_groups} READY groups within {timeout_seconds}s")
            await asyncio.sleep(poll_seconds)

    async def _load_batch(self, bid: str, redelivered: bool) -> Batch:
        raw = await self.redis.hgetall(self.prefix + f"batch:{bid}")
        if not raw or b"groups" not in raw:
            raise MalformedData(f"batch {bid} record is missing")
        h = {k.decode(): v for k, v in raw.items()}
        version = int(h["version"])
        groups = []
        for gid in _s(h["groups"]).split(","):
            group, samples = await self.get_group(gid)
            scored = [s for s in samples if s.status == SampleStatus.SCORED]
            olds = [s.oldest_version for s in scored if s.oldest_version is not None]
            oldest = min(olds) if olds else version
            groups.append(
                BatchGroup(group, scored, oldest, version - oldest, sum(s.status == SampleStatus.FAILED for s in samples))
            )
        return Batch(bid, int(h["step"]), version, int(h.get("lineage", 0)), groups, redelivered)

    async def acknowledge(self, batch: Batch | str, step: int) -> bool:
        """Mark the batch trained at ``step``; True the first time, False for a harmless repeat.

        Raises:
            InvalidTransition: acknowledged before at another step, or ``step`` not after the last one.
            UnknownItem: no such batch (reverted by recover, or never handed out).
        """
        bid = batch.batch_id if isinstance(batch, Batch) else batch
        return bool(await self._run("ack", bid, int(step)))

    async def commit(self, step: int) -> int:
        """A checkpoint covers ``step``: delete groups acknowledged at steps <= ``step``; returns how many."""
        return int(await self._run("commit", int(step)))

    async def recover(self, step: int, version: int, uri: str = "", checksum: str = "") -> dict[str, int]:
        """The trainer resumed from the checkpoint of ``step`` holding policy ``version``.

        ``uri``/``checksum`` of the checkpoint's weights are announced with the rewind; when
        omitted, the ones published for ``version`` in this lineage are used (for version 0,
        the initial model, the announcement has an empty uri: load the configured model).

        Returns:
            ``{"replayed_groups", "restarted_groups", "dropped_groups", "lineage", "revoked_leases"}``.

        Raises:
            BadRequest: ``version`` ahead of the clock, rewinding to a version > 0 that was never
                published without ``uri``, or ``step`` before the last committed step.
        """
        r = await self._run("recover", int(step), int(version), uri, checksum, self.clock.channel)
        keys = ("replayed_groups", "restarted_groups", "dropped_groups", "lineage", "revoked_leases")
        return {k: int(v) for k, v in zip(keys, r)}

    # ------------------------------------------------------------------ timeline
    async def export_timeline(self, trace_dir: Any, max_file_bytes: int | None = None, max_files: int | None = None) -> int:
        """Move the timeline records waiting in Redis to the rotated files of ``trace_dir``.

        Records reach the ``timeline`` list when groups are committed or dropped, batches committed,
        versions published and the trainer recovers (docs/buffer.md#timeline). They are appended to
        ``trace_dir`` (:class:`buffers.timeline.TimelineWriter`), fsynced, and only then removed from
        Redis, so a crash in between exports a record twice (readers drop duplicates), never loses one.

        Returns:
            how many records were exported.
        """
        from buffers.timeline import TimelineWriter, export_list

        writer = TimelineWriter(trace_dir, **{k: v for k, v in (("max_file_bytes", max_file_bytes),
                                                              ("max_files", max_files)) if v is not None})
        return await export_list(self.redis, self.prefix + "timeline", writer)

    # ------------------------------------------------------------------ operations
    async def drain(self) -> int:
        """Delete every key of the run (including the schema key); returns how many."""
        n = 0
        pattern = self.prefix.replace("{", "\\{").replace("}", "\\}") + "*"
        batch: list[Any] = []
        async for key in self.redis.scan_iter(match=pattern, count=500):
            batch.append(key)
            if len(batch) >= 500:
                n += await self.redis.unlink(*batch)
                batch = []
        if batch:
            n += await self.redis.unlink(*batch)
        return n
