"""Fair decode steps of the embedded engine: which rows run in a step while big and small requests share it.

One job: bound how much one request's samples slow the others' decode steps (issue #31 item 1;
docs/security.md, "Fairness"). :class:`EngineFair` is a mixin of :class:`rollout_server.engine.Engine`.

The problem. A decode step costs about ``c(S) = a + Σ_{r in S} w_r`` for the set S of rows it
runs: ``a`` is the per-step overhead (the weights' read, kernel launches, Python), ``w_r`` the
per-row cost in units of a plain row (``1 + γ · top_logprobs_num``: the top-k and the entries it
adds to the row's output). When every live row runs in every step, a request of 56 rows with 20 top
logprobs makes each step of a small request beside it several times dearer than the step it would
have alone, whatever the admission control does.

The policy (two classes, a guaranteed share, deficit round robin). The rows of requests of more
samples than ``reserve_rows`` are *big* (:attr:`EngineSample.big`, set at submission); the others
are *small*. While both classes have live rows, every small row runs in every step, and the big
class gets a per-step quantum of ``(F − 1) · c(small rows)`` cost units, where F is
``fair_slowdown`` (2 by default): so a step costs at most F times what the small rows' step
would cost alone, and the big class still always progresses (a bounded share, never starvation).
This is a two-flow weighted fair share in the sense of weighted fair queueing (Demers, Keshav and
Shenker, "Analysis and Simulation of a Fair Queueing Algorithm", SIGCOMM 1989), the cost being
the modelled step time rather than bytes, as "Fairness in Serving Large Language Models" (Sheng
et al., OSDI 2024) counts service in weighted tokens. The quantum is spent as in deficit round
robin (Shreedhar and Varghese, "Efficient Fair Queuing Using Deficit Round Robin", SIGCOMM 1995):
each step the big class's deficit grows by the quantum; once it covers a mixed step's overhead
(:data:`MIXED_STEP_OVERHEAD_ROWS`: the second sampling path and the big streams' wake-up that a
step of both kinds pays) and a row, the overhead is paid and the big rows run in order while their
weight fits; what is left carries over, and the deficit is dropped when the class is served
completely (nothing is owed to an empty or fully served queue). So over a small request's life its
modelled cost is at most F times its cost alone, plus one overhead and one big row's weight. Big
rows are served in arrival order (request, then sample), as big requests are admitted; when no
small row is live, or no big row, every row runs (nothing is throttled).

How a subset of rows runs. The KV cache keeps every row ending at one column
(:mod:`rollout_server.kv_cache`), and a forward pass reads a prefix of the slots as a view. So the
rows are kept *arranged*: small rows first, then big rows in their order; when an arrival breaks
that, the slots are permuted once (:meth:`KVCacheSlots._arrange`). A throttled step then runs the
prefix of slots that holds the small rows and the first big rows, and the others are untouched:
their KV cache, position, next token and sampler state stay as they were, and the step's column
becomes a masked *hole* in their rows (zeroed, as padding is). Holes are squeezed out when they
would double the cache's width (:meth:`KVCacheSlots._squeeze_holes`). A row's sampled sequence
does not depend on the steps it skipped: a seeded row draws from its own generator once per
token, and its logits depend only on its own tokens (attention masks the holes).

Accounting (deterministic, for tests and metrics): every live sample counts the decode steps it
ran in (``fair_steps``) and skipped (``fair_waits``) and the modelled cost of the steps it ran in
(``fair_cost``, cost units), and the engine counts throttled steps and skipped rows in ``stats``.

The cost model's constants (:data:`STEP_OVERHEAD_ROWS`, :data:`TOP_LOGPROB_WEIGHT`) were chosen
from measurements of the tiny model on a loaded 2-core CPU, erring low for ``a`` and high for ``γ``
(both give the big class less); ``python bench/fairness_bench.py --calibrate`` fits them for a
model and machine, and the engine's constructor takes others (docs/rollout.md, "Fair decode steps").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_server.engine_sample import EngineSample

__all__ = ["EngineFair", "MIXED_STEP_OVERHEAD_ROWS", "STEP_OVERHEAD_ROWS", "TOP_LOGPROB_WEIGHT"]

#: ``a`` of the step cost model, in plain rows: a decode step's cost that does not grow with its
#: rows. Chosen low (the tiny CPU model, where Python overhead dominates, measured about 16): a low
#: ``a`` gives the big class less, so the small requests' bound holds where a step's fixed cost is small
STEP_OVERHEAD_ROWS = 2.0
#: ``γ`` of the step cost model: the cost of one top logprob of one row, in plain rows. It covers the
#: engine's top-k and the server's side: a stream's chunks carry every top logprob (a cumulative stream
#: resends them, at most about 10 times in all), built on the same process's GIL as the decode loop; 0.05 left
#: the server's CPU time beside a maximal request at 1.6-2.3x the small requests' own, 0.1 gives it room
TOP_LOGPROB_WEIGHT = 0.1
#: the extra cost of a step that runs big rows beside small ones, in plain rows: a second sampling path
#: (temperature sampling and top-k beside greedy rows, sample_tokens) and a wake-up of the big
#: requests' streams, which do not grow with the rows; the big class pays it out of its quantum
MIXED_STEP_OVERHEAD_ROWS = 4.0


class EngineFair:
    """Fair decode steps (mixin of :class:`rollout_server.engine.Engine`; see the module docstring).

    Expects ``_rows`` (slots: ``_Row`` or None), ``stats``, ``torch`` and the KV cache's
    ``_arrange`` on the engine.
    """

    def _init_fair(self, slowdown: float | None, overhead_rows: float | None, logprob_weight: float | None) -> None:
        """Set the policy's constants.

        Args:
            slowdown: F ≥ 1.0: while small requests run, a step costs at most F × their step alone
                (None: 2.0; ``math.inf``: never throttle, every row runs in every step).
            overhead_rows: ``a`` ≥ 0, the step's fixed cost in plain rows (None: :data:`STEP_OVERHEAD_ROWS`).
            logprob_weight: ``γ`` ≥ 0, one top logprob's cost in plain rows (None: :data:`TOP_LOGPROB_WEIGHT`).

        Raises:
            ValueError: a constant out of its range (says which).
        """
        f = 2.0 if slowdown is None else float(slowdown)
        a = STEP_OVERHEAD_ROWS if overhead_rows is None else float(overhead_rows)
        g = TOP_LOGPROB_WEIGHT if logprob_weight is None else float(logprob_weight)
        if not f >= 1.0:
            raise ValueError(f"fair_slowdown must be at least 1.0 (a step may not cost less than the small rows' own), got {f}")
        if not (math.isfinite(a) and a >= 0 and math.isfinite(g) and g >= 0):
            raise ValueError(f"the step cost model needs finite overhead_rows >= 0 and logprob_weight >= 0, got {a}, {g}")
        self.fair_slowdown, self.fair_overhead_rows, self.fair_logprob_weight = f, a, g
        self.fair_mixed_rows = MIXED_STEP_OVERHEAD_ROWS
        self._fair_deficit = 0.0  # the big class's DRR deficit, cost units
        self._fair_next_seq = 0  # arrival order of samples (big rows are served in it)
        self.stats["fair_throttled_steps_total"] = 0  # decode steps that left big rows out
        self.stats["fair_skipped_rows_total"] = 0  # row-steps left out
        self.stats["fair_arrangements_total"] = 0  # slot permutations that put the rows in serving order
        self.stats["fair_squeezes_total"] = 0  # hole squeezes of the KV cache (kv_cache.KVCacheSlots._squeeze_holes)

    def _fair_enter(self, s: EngineSample) -> None:
        """Give a submitted sample its place in the arrival order."""
        s.fair_seq = self._fair_next_seq
        self._fair_next_seq += 1

    def fair_weight(self, s: EngineSample) -> float:
        """``w_r``: one row's cost in plain rows, ``1 + γ · top_logprobs_num``."""
        return 1.0 + self.fair_logprob_weight * (s.top_logprobs_num if s.return_logprob else 0)

    def _fair_width(self) -> int | None:
        """How many slots (a prefix) the next decode step runs, arranging the rows first if needed.

        Returns None when every row runs (one class live, or the big rows all fit the quantum);
        else W: the step runs slots ``[0, W)``, which hold every small row and the first big rows.
        """
        small_w = 0.0
        big: list[tuple[int, float, int]] = []  # (fair_seq, weight, slot)
        last_small = -1
        for i, r in enumerate(self._rows):
            if r is None:
                continue
            s = r.sample
            if s.big:
                big.append((s.fair_seq, self.fair_weight(s), i))
            else:
                small_w += self.fair_weight(s)
                last_small = i
        if not big or last_small < 0 or math.isinf(self.fair_slowdown):
            self._fair_deficit = 0.0
            return None
        self._fair_deficit += (self.fair_slowdown - 1.0) * (self.fair_overhead_rows + small_w)
        big.sort()
        k = 0
        if self._fair_deficit >= self.fair_mixed_rows + big[0][1]:  # big rows run: the step pays for mixing once
            self._fair_deficit -= self.fair_mixed_rows
            while k < len(big) and big[k][1] <= self._fair_deficit:
                self._fair_deficit -= big[k][1]
                k += 1
        if k == len(big):  # the class is served completely: nothing carries over (DRR)
            self._fair_deficit = 0.0
            return None
        # the rows must be arranged: every small row, then the big rows in order, so that a prefix runs
        slots = [b[2] for b in big]
        if last_small > slots[0] or slots != sorted(slots):
            small = [i for i, r in enumerate(self._rows) if r is not None and not r.sample.big]
            self._arrange(small + slots)
            self.stats["fair_arrangements_total"] += 1
            last_small, slots = len(small) - 1, list(range(len(small), len(small) + len(slots)))
        return slots[k] if k else last_small + 1

    def _fair_account(self, width: int | None, ran: list[EngineSample]) -> None:
        """Count the step: ``ran`` ran in it (at the cost of ``a + Σ w``, + the mixing overhead when it
        held big and small rows), the rows from ``width`` on waited."""
        kinds = {s.big for s in ran}
        cost = self.fair_overhead_rows + sum(self.fair_weight(s) for s in ran) + (self.fair_mixed_rows if len(kinds) == 2 else 0.0)
        for s in ran:
            s.fair_steps += 1
            s.fair_cost += cost
        if width is None:
            return
        skipped = 0
        for r in self._rows[width:]:
            if r is not None:
                r.sample.fair_waits += 1
                r.holes += 1
                skipped += 1
        self.stats["fair_throttled_steps_total"] += 1
        self.stats["fair_skipped_rows_total"] += skipped
