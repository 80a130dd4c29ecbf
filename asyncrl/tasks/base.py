"""The task interface: a :class:`Problem`, the train/held-out split by hash, and the :class:`Task` every task implements.

A problem is held out iff ``sha256(canonical problem) mod 100 < data.heldout_percent`` (default
:data:`HELDOUT_PERCENT` = 10), so no problem can be in both splits whatever the seed, the file order
or the number of prompts requested. The built-in tasks are in :mod:`asyncrl.tasks.generated`
(``arithmetic``, ``chain``) and :mod:`asyncrl.tasks.tasks` (files); a task outside asyncrl subclasses
:class:`Task` and is named ``data.task: module:Class`` (:mod:`asyncrl.tasks.registry`).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HELDOUT_PERCENT", "Problem", "Task", "problem_hash", "problem_key", "is_heldout"]

#: Default percentage of the problem space (by hash) held out for evaluation (``data.heldout_percent``).
HELDOUT_PERCENT = 10


@dataclass(frozen=True)
class Problem:
    """One problem of a task.

    Attributes:
        text: the problem as shown to the model (the user message).
        gold: the gold final answer as a string (e.g. ``"68"``), what the verifier compares to.
        metadata: JSON-serialisable dict passed to reward functions; always has ``task``,
            ``gold``, ``problem_hash`` and ``split`` (``"train"`` or ``"heldout"``).
    """

    text: str
    gold: str
    metadata: dict[str, Any] = field(default_factory=dict)

def _canonical(text: str) -> str:
    return " ".join(text.split())


def problem_hash(text: str) -> str:
    """Hex sha256 (first 16 hex digits) of the whitespace-normalised problem text."""
    return hashlib.sha256(_canonical(text).encode("utf-8")).hexdigest()[:16]


def problem_key(text: str) -> int:
    """A problem's identity as an integer in [0, 2**40): the first 10 hex digits of :func:`problem_hash`.

    The same problem text gives the same key wherever it recurs in the train stream (a generated
    task draws each of its problems at many positions of one epoch; a file task's row recurs once
    per epoch), so per-problem history (selective rollout, docs/buffer.md) follows the problem, not
    its position. Below 10**14, so Redis' Lua (5.1, which prints numbers with ``%.14g``) keeps it
    exact. Two distinct problems share a key with probability about n**2 / 2**41 for n distinct
    problems (0.5% at 100,000); they would then share one history.
    """
    return int(problem_hash(text)[:10], 16)


def is_heldout(hash_hex: str, percent: int = HELDOUT_PERCENT) -> bool:
    """True when a problem with this :func:`problem_hash` belongs to the held-out split.

    Args:
        percent: share of the problem space held out, 1-90 (``data.heldout_percent``).
    """
    return int(hash_hex, 16) % 100 < percent

class Task(ABC):
    """A source of problems with a train and a held-out split (both deterministic)."""

    name: str = "task"

    @abstractmethod
    def num_train(self) -> int:
        """Number of distinct train indices (the epoch length of :class:`TrainPromptStream`)."""

    @abstractmethod
    def train_problem(self, index: int) -> Problem:
        """The train problem at ``0 <= index < num_train()``."""

    @abstractmethod
    def heldout(self, n: int) -> list[Problem]:
        """The first ``n`` held-out problems (distinct, deterministic, independent of the run seed).

        Raises:
            TaskError: the task has fewer than ``n`` held-out problems.
        """
