"""The Redis side of the pass-rate dataset filter: recorded group means and the removed prompts.

The filter itself (which prompts to remove, AReaL's rule) is :mod:`asyncrl.feeder.prompt_filter`; the
feeder is its only writer. Keys of the run (docs/buffer.md#pass-rate-dataset-filter):

* ``pass_rates`` (hash group id -> mean reward of the group's scored samples): written by
  ``lua/score.lua`` when a group finishes and ``record_pass_rates`` is set; the feeder takes
  the entries it has folded into ``prompt_pass_rate``.
* ``prompt_pass_rate`` (hash train problem index -> the latest mean reward of one of its groups).
* ``filtered_prompts`` (hash train problem index -> mean reward when it was removed) and
  ``filter_epoch`` (the last epoch the filter ran for): written together in one transaction,
  so a resumed run (same Redis, AOF) keeps the removed prompts out and never filters an epoch twice.

The selective-rollout rule (:mod:`asyncrl.feeder.selective_rollout`; docs/buffer.md#selective-rollout-skipping-predicted-zero-variance-prompts)
reads two more hashes, both keyed by train problem key (``asyncrl.tasks.base.problem_key``, a hash of
the problem's text, the group metadata's ``problem_key``: the same problem recurs at many positions
of a generated task's epoch, and its history must follow it):

* ``prompt_history`` -> ``"z r cursor base_z base_r"``: the zero-variance streak of the problem's
  finished groups, written by ``lua/score.lua`` when a group finishes and ``record_prompt_history`` is set.
* ``prompt_skips`` -> visits skipped in a row since its last finished group: incremented by
  ``lua/feed.lua`` for each predicted skip, cleared by ``lua/score.lua`` when a group of it finishes.

:class:`PassRateStore` is a base of :class:`buffers.ReplayBuffer` (it needs ``redis`` and ``prefix``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from buffers.scripts import _s

__all__ = ["PassRateStore", "PromptHistory"]


class PromptHistory(NamedTuple):
    """One train problem's record for the selective-rollout rule.

    Attributes:
        streak: finished visits in a row (the latest included) whose groups were zero-variance with the
            same common reward; 0 when the latest was mixed or none finished.
        reward: that common raw reward (None when ``streak`` is 0).
        skips: visits skipped in a row by the rule since the problem's last finished group.
    """

    streak: int
    reward: float | None
    skips: int


class PassRateStore:
    """Reads and writes the pass-rate filter's keys (a base of :class:`buffers.ReplayBuffer`)."""

    redis: Any
    prefix: str

    async def recorded_pass_rates(self) -> dict[str, float]:
        """Group id -> mean reward of its scored samples, for groups finished since the last :meth:`fold_pass_rates`."""
        raw = await self.redis.hgetall(self.prefix + "pass_rates")
        return {_s(k): float(v) for k, v in raw.items()}

    async def fold_pass_rates(self, by_problem: dict[int, float], group_ids: list[str]) -> None:
        """Store ``by_problem`` (problem index -> latest mean reward) in ``prompt_pass_rate`` and
        delete ``group_ids`` from ``pass_rates``, in one transaction (a repeat is harmless)."""
        p = self.prefix
        async with self.redis.pipeline(transaction=True) as pipe:
            if by_problem:
                pipe.hset(p + "prompt_pass_rate", mapping={str(k): repr(float(v)) for k, v in by_problem.items()})
            if group_ids:
                pipe.hdel(p + "pass_rates", *group_ids)
            await pipe.execute()

    async def prompt_pass_rates(self) -> dict[int, float]:
        """Train problem index -> the latest mean reward of one of its groups."""
        raw = await self.redis.hgetall(self.prefix + "prompt_pass_rate")
        return {int(k): float(v) for k, v in raw.items()}

    async def prompt_histories(self, problems: Sequence[int]) -> dict[int, PromptHistory]:
        """``key -> PromptHistory`` for each of ``problems``, train problem keys (streak 0 and skips 0 without a record).

        One round trip (two ``HMGET``). A damaged ``prompt_history`` entry reads as no history.
        """
        keys = [str(int(p)) for p in problems]
        if not keys:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(self.prefix + "prompt_history", keys)
            pipe.hmget(self.prefix + "prompt_skips", keys)
            hist, skips = await pipe.execute()
        out: dict[int, PromptHistory] = {}
        for key, h, s in zip(keys, hist, skips):
            streak, reward = 0, None
            parts = _s(h).split(" ") if h is not None else []
            if len(parts) == 5 and parts[0].isdigit() and int(parts[0]) > 0:
                try:
                    streak, reward = int(parts[0]), float(parts[1])
                except ValueError:
                    streak, reward = 0, None
            out[int(key)] = PromptHistory(streak, reward, int(s) if s is not None else 0)
        return out

    async def filter_epoch(self) -> int:
        """The last epoch the pass-rate filter ran for (0: never)."""
        return int(await self.redis.get(self.prefix + "filter_epoch") or 0)

    async def filtered_prompts(self) -> dict[int, float]:
        """Train problem index -> mean reward when the pass-rate filter removed it."""
        raw = await self.redis.hgetall(self.prefix + "filtered_prompts")
        return {int(k): float(v) for k, v in raw.items()}

    async def record_filter(self, epoch: int, removed: dict[int, float]) -> bool:
        """Add ``removed`` to ``filtered_prompts`` and set ``filter_epoch`` to ``epoch``, atomically,
        only if the filter has not run for ``epoch`` yet (optimistic ``WATCH`` on ``filter_epoch``).

        Returns:
            True when written; False when another feeder ran the filter for this epoch first.
        """
        from redis.exceptions import WatchError

        p = self.prefix
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(p + "filter_epoch")
                if int(await pipe.get(p + "filter_epoch") or 0) >= epoch:
                    return False
                pipe.multi()
                if removed:
                    pipe.hset(p + "filtered_prompts", mapping={str(k): repr(float(v)) for k, v in removed.items()})
                    pipe.hincrby(p + "stats", "filtered_prompts:pass_rate", len(removed))
                pipe.set(p + "filter_epoch", epoch)
                await pipe.execute()
            except WatchError:
                return False
        return True
