"""AReaL's pass-rate dataset filter: train prompts the policy already solves leave the feeder's stream.

AReaL (``dataset_filter_threshold``, ``dataset_max_filter_percentage``; the ``filter`` method of
its math/code prompt datasets) removes, at the end of each epoch, the prompts whose score
exceeds the threshold — at most ``floor(active * max_filter_percentage)`` of the prompts still
active, highest score first. Here the score of a prompt is the mean reward over every scored
sample of its latest finished group (the pass rate, for a 0/1 correctness reward), recorded by
the buffer when the group finishes (``buffers/lua/score.lua``, before best-of-n selection and
whether or not dynamic sampling drops the group). The filter runs when the feeder is about to
feed the first prompt of epoch e >= 1 (once per epoch: ``filter_epoch`` in Redis), and the
removed prompts are kept in the buffer (``filtered_prompts``), so a resumed run keeps them out.
A removed prompt's dataset positions are skipped, counted by the feed script as
``skipped_prompts:pass_rate_filter`` (cursor = groups fed + prompts skipped). At least one
prompt always stays. docs/buffer.md#pass-rate-dataset-filter.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["PassRateFilter", "select_filtered"]

_FEEDER_GID = re.compile(r"^p(\d{9,})$")


def select_filtered(rates: dict[int, float], filtered: set[int] | dict[int, float], threshold: float,
                    max_percentage: float, num_prompts: int) -> dict[int, float]:
    """The prompts to remove this epoch (AReaL's rule).

    Args:
        rates: train problem index -> latest mean reward (pass rate).
        filtered: problem indices removed in earlier epochs (not considered again).
        threshold: a prompt is a candidate when its rate is strictly above this.
        max_percentage: at most ``floor(active * max_percentage)`` are removed, where ``active``
            = ``num_prompts`` - already removed; never all of them (at least one stays).
        num_prompts: train prompts per epoch.

    Returns:
        problem index -> rate of the removed prompts: highest rate first, ties by lower index.
    """
    active = num_prompts - len(filtered)
    budget = min(math.floor(active * max_percentage), active - 1)
    if budget <= 0:
        return {}
    candidates = sorted(((-r, i) for i, r in rates.items() if i not in filtered and r > threshold))
    return {i: -neg for neg, i in candidates[:budget]}


class PassRateFilter:
    """The feeder's view of the filter: which problem indices to skip, and running it once per epoch.

    Args:
        buffer: an open :class:`buffers.ReplayBuffer` (its :class:`buffers.pass_rates.PassRateStore` methods).
        stream: the run's :class:`asyncrl.tasks.tasks.TrainPromptStream` (``len`` and ``problem_index``).
        threshold, max_percentage: ``data.dataset_filter_threshold``, ``data.dataset_max_filter_percentage``.
    """

    def __init__(self, buffer: Any, stream: Any, threshold: float, max_percentage: float) -> None:
        if not 0.0 <= max_percentage <= 1.0:
            raise ValueError(f"max_percentage must be in [0, 1], got {max_percentage}")
        self.buffer = buffer
        self.stream = stream
        self.threshold = threshold
        self.max_percentage = max_percentage
        self.removed: set[int] = set()
        self._epoch: int | None = None

    @property
    def enabled(self) -> bool:
        return self.max_percentage > 0

    async def refresh(self, cursor: int) -> None:
        """Before feeding from ``cursor``: run the filter for its epoch if not done yet, and load
        the removed prompts (again only when ``filter_epoch`` moved)."""
        epoch = cursor // len(self.stream)
        stored = await self.buffer.filter_epoch()
        if stored < epoch:
            await self._fold()
            removed = select_filtered(await self.buffer.prompt_pass_rates(), await self.buffer.filtered_prompts(),
                                      self.threshold, self.max_percentage, len(self.stream))
            await self.buffer.record_filter(epoch, removed)
            stored = await self.buffer.filter_epoch()
        if stored != self._epoch:
            self.removed = set(await self.buffer.filtered_prompts())
            self._epoch = stored

    async def _fold(self) -> None:
        """Move the buffer's per-group means into per-problem rates (latest group of a problem wins)."""
        recorded = await self.buffer.recorded_pass_rates()
        by_problem: dict[int, float] = {}
        for gid in sorted(recorded, key=lambda g: (len(g), g)):  # p<cursor>: cursor order
            m = _FEEDER_GID.match(gid)
            if m:
                by_problem[self.stream.problem_index(int(m.group(1)))] = recorded[gid]
        await self.buffer.fold_pass_rates(by_problem, list(recorded))

    def skips(self, cursor: int) -> bool:
        """True when the prompt at ``cursor`` was removed by the filter."""
        return self.stream.problem_index(cursor) in self.removed
