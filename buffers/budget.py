"""The per-version token budget (``rollout.max_budget``, M), in Python, for a worker between two appends.

The buffer's scripts decide the budget, atomically in Redis: per sample they keep the version
whose budget window is open (``bver``) and the model tokens produced under it (``bused``).

* ``append.lua``: for every appended model token of version ``tv``: ``tv > bver`` opens a new
  window (``bver = tv, bused = 0``), then ``tv == bver`` counts it (``bused += 1``). Environment
  tokens (``obs``, ``ctx``) are not counted. A segment ended with ``length`` or ``budget``, or an
  ``abort`` with ``bused >= M``, parks the sample at the budget (PARTIAL, finish ``budget``).
* ``claim.lua``: a claim hands out ``produced_under_version_tokens = bused if bver == clock
  else 0`` and ``max_new_tokens = min(M - that, max_response_len - len)`` (an idle resume first
  restarts the window at the clock).

A single-turn request needs nothing more: it asks the engine for ``WorkItem.max_new_tokens``,
which the buffer decided. An episode makes several model calls under one claim
(:mod:`rollout_server.episodes`), so between two appends it has to know how much of the window
is left; :class:`VersionBudget` is the one Python copy of the counting rule for that, started
from what the claim returned. ``tests/test_budget_rule.py`` runs the same cases through the real
scripts (a real redis-server) and through this class and checks that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["VersionBudget"]


@dataclass
class VersionBudget:
    """The budget window of one claimed sample, counted as ``append.lua`` counts it.

    Attributes:
        version: the policy version whose window is open (``bver`` in the scripts).
        used: model tokens produced under ``version`` so far (``bused``), >= 0.

    After :meth:`from_claim` and any tokens of versions >= the claim's clock, ``(version, used)``
    equals the buffer's stored ``(bver, bused)``, except right after a claim that found a window
    of a version older than the clock: the buffer keeps that old window until the next token,
    this class starts at ``(clock, 0)``; both count every later token the same way.
    """

    version: int
    used: int = 0

    @classmethod
    def from_claim(cls, item: Any) -> "VersionBudget":
        """The window as the buffer handed it out with ``item`` (an :class:`asyncrl.core.types.WorkItem`):
        ``(item.clock_version, item.produced_under_version_tokens)``."""
        return cls(int(item.clock_version), int(item.produced_under_version_tokens))

    def count(self, versions: Iterable[int]) -> None:
        """Count appended model tokens, one policy version per token, in order (``append.lua``'s loop).

        A token of a newer version than the window opens a new one; tokens of an older version
        are not counted (their window is closed). Environment tokens must not be passed.
        """
        for tv in versions:
            if tv > self.version:
                self.version, self.used = int(tv), 0
            if tv == self.version:
                self.used += 1

    def left(self, max_budget: int) -> int:
        """Tokens the open window still allows, ``max(0, max_budget - used)``; 0 means parked at the budget.

        Args:
            max_budget: M, tokens per sample per policy version (``rollout.max_budget``), >= 1.
        """
        return max(0, int(max_budget) - self.used)
