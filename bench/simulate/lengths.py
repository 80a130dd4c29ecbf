"""Response-length models: how long the n samples of a prompt group are (tokens), possibly by policy version."""

from __future__ import annotations

import bisect
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

__all__ = ["LengthModel", "PerSampleLength", "FixedLength", "UniformLength", "LogNormalLength", "CappedMixtureLength",
           "PhasedLength", "BenchParetoLength", "RecordedGroupLengths"]


class LengthModel(ABC):
    """Response lengths (tokens) of the n samples of a prompt group.

    ``lengths(rng, feed_index, version, n)`` draws them when the group is admitted (``version``
    is the clock then); ``resample_on_restart`` says whether a regenerated sample draws again (a
    new sample of the current policy, :meth:`redraw`) or keeps its length (lengths fixed by the prompt).
    """

    resample_on_restart = True

    @abstractmethod
    def lengths(self, rng: random.Random, feed_index: int, version: int, n: int) -> list[int]:
        """``n`` lengths for the group fed at ``feed_index``, admitted at policy ``version``."""

    def redraw(self, rng: random.Random, feed_index: int, version: int) -> int:
        """The new length (tokens) of a restarted sample of the group fed at ``feed_index``, at ``version``.

        Raises:
            NotImplementedError: a model without redraws (``resample_on_restart`` False).
        """
        raise NotImplementedError(f"{type(self).__name__} keeps a restarted sample's length")

    def describe(self) -> str:
        """One line for the tables."""
        return type(self).__name__


class PerSampleLength(LengthModel):
    """A length model whose samples are independent draws: subclasses give :meth:`one`."""

    def lengths(self, rng: random.Random, feed_index: int, version: int, n: int) -> list[int]:
        """``n`` independent draws of :meth:`one`."""
        return [self.one(rng, version) for _ in range(n)]

    def redraw(self, rng: random.Random, feed_index: int, version: int) -> int:
        """One draw of :meth:`one` (independent of the group)."""
        return self.one(rng, version)

    @abstractmethod
    def one(self, rng: random.Random, version: int) -> int:
        """One length (tokens) for a sample generated at policy ``version``."""


@dataclass
class FixedLength(PerSampleLength):
    """Every response has ``n`` tokens."""

    n: int

    def one(self, rng: random.Random, version: int) -> int:
        """``n``."""
        return self.n

    def describe(self) -> str:
        """One line for the tables."""
        return f"fixed {self.n}"


@dataclass
class UniformLength(PerSampleLength):
    """Uniform integer in [lo, hi]."""

    lo: int
    hi: int

    def one(self, rng: random.Random, version: int) -> int:
        """Uniform in [lo, hi]."""
        return rng.randint(self.lo, self.hi)

    def describe(self) -> str:
        """One line for the tables."""
        return f"uniform [{self.lo}, {self.hi}]"


@dataclass
class LogNormalLength(PerSampleLength):
    """Log-normal with the given median and sigma (of the log), rounded, clipped to [lo, cap]."""

    median: float
    sigma: float
    cap: int
    lo: int = 1

    def one(self, rng: random.Random, version: int) -> int:
        """``median * exp(sigma * z)``, z ~ N(0, 1), clipped."""
        return max(self.lo, min(self.cap, int(round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))))))

    def describe(self) -> str:
        """One line for the tables."""
        return f"log-normal median {self.median:g}, sigma {self.sigma:g}, cap {self.cap}"


@dataclass
class CappedMixtureLength(PerSampleLength):
    """With probability ``p_cap`` exactly ``cap`` tokens, else ``rest`` (clipped below cap)."""

    p_cap: float
    cap: int
    rest: LengthModel

    def one(self, rng: random.Random, version: int) -> int:
        """``cap`` or a draw of ``rest``."""
        if rng.random() < self.p_cap:
            return self.cap
        return min(self.cap - 1, self.rest.one(rng, version))

    def describe(self) -> str:
        """One line for the tables."""
        return f"{self.p_cap:.1%} at {self.cap}, else {self.rest.describe()}"


@dataclass
class PhasedLength(PerSampleLength):
    """``early`` lengths at version <= v0, ``late`` from v1 on, linearly mixed in between.

    Stands for a policy whose answers change during training (docs/results.md: long answers
    in the first ~12 steps of the main job, 3-10 tokens after).
    """

    early: LengthModel
    late: LengthModel
    v0: int
    v1: int

    def one(self, rng: random.Random, version: int) -> int:
        """A draw of ``early`` with probability (v1 - version) / (v1 - v0), else ``late``."""
        w = 1.0 if version <= self.v0 else 0.0 if version >= self.v1 else (self.v1 - version) / (self.v1 - self.v0)
        return self.early.one(rng, version) if rng.random() < w else self.late.one(rng, version)

    def describe(self) -> str:
        """One line for the tables."""
        return f"{self.early.describe()} until v{self.v0}, {self.late.describe()} from v{self.v1}"


class BenchParetoLength(LengthModel):
    """The exact target lengths of ``bench/rollout_partial_bench.py`` (``target_lengths``).

    ``min(cap, floor(x_m * U**(-1/alpha)))``, U ~ (0, 1], from ``random.Random(seed)``; the group fed
    at index c gets ``lengths[c*n:(c+1)*n]`` (its metadata), so a restarted sample keeps its length.
    """

    resample_on_restart = False

    def __init__(self, x_m: float, alpha: float, cap: int, seed: int = 0, count: int = 200_000):
        self.x_m, self.alpha, self.cap, self.seed = x_m, alpha, cap, seed
        rng = random.Random(seed)
        self._seq = []
        for _ in range(count):
            u = 1.0 - rng.random()
            self._seq.append(max(1, min(cap, int(x_m * u ** (-1.0 / alpha)))))

    def lengths(self, rng: random.Random, feed_index: int, version: int, n: int) -> list[int]:
        """The benchmark's lengths of group ``feed_index``."""
        return self._seq[feed_index * n:(feed_index + 1) * n]

    def describe(self) -> str:
        """One line for the tables."""
        return f"Pareto x_m {self.x_m:g}, alpha {self.alpha:g}, cap {self.cap} (the benchmark's sequence)"


@dataclass
class RecordedGroupLengths(LengthModel):
    """A run's own groups: each admitted group takes the lengths of one recorded group, whole.

    ``by_version[v]`` holds the response lengths (tokens) of the groups a run trained whose oldest
    token was of policy version v (one tuple of n lengths per group). A group admitted at version
    ``version`` takes a uniformly drawn recorded group of the newest version <= ``version`` that has
    any (the oldest version's when ``version`` is older than all), so lengths change over the run as
    the measured policy's did, and the lengths of a group's samples stay together (in a long-tail
    task a group's lengths follow its problem). Each length is multiplied by ``scale`` and rounded
    (the buffer caps it at ``max_response_len``). A restarted sample (:meth:`redraw`) takes the
    length of one of its own group's recorded samples: a new answer to the same problem.

    Raises:
        ValueError: no group, an empty group, a length < 1, or ``scale`` <= 0.
    """

    by_version: dict[int, list[tuple[int, ...]]]
    scale: float = 1.0
    source: str = ""
    _keys: list[int] = field(default_factory=list, init=False, repr=False)
    _groups: dict[int, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.by_version = {int(v): [tuple(int(x) for x in g) for g in gs] for v, gs in self.by_version.items() if gs}
        if not self.by_version:
            raise ValueError("RecordedGroupLengths needs at least one group")
        if any(not g or min(g) < 1 for gs in self.by_version.values() for g in gs):
            raise ValueError("a recorded group needs >= 1 sample, each of >= 1 token")
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")
        self._keys = sorted(self.by_version)

    def _scaled(self, x: int) -> int:
        return max(1, int(round(x * self.scale)))

    def lengths(self, rng: random.Random, feed_index: int, version: int, n: int) -> list[int]:
        """One recorded group's lengths, scaled (drawn with replacement from it when its size is not ``n``)."""
        i = bisect.bisect_right(self._keys, version) - 1
        pool = self.by_version[self._keys[max(0, i)]]
        g = pool[rng.randrange(len(pool))]
        self._groups[feed_index] = g
        picked = list(g) if len(g) == n else [g[rng.randrange(len(g))] for _ in range(n)]
        return [self._scaled(x) for x in picked]

    def redraw(self, rng: random.Random, feed_index: int, version: int) -> int:
        """A length of the same recorded group, scaled (a new answer to the same prompt)."""
        g = self._groups.get(feed_index)
        if g is None:
            return self.lengths(rng, feed_index, version, 1)[0]
        return self._scaled(g[rng.randrange(len(g))])

    def describe(self) -> str:
        """One line for the tables."""
        groups = sum(len(gs) for gs in self.by_version.values())
        return f"{groups} recorded groups{f' of {self.source}' if self.source else ''}, scale {self.scale:g}"
