"""The generated tasks: problems drawn by index from a seeded generator, so a train split costs no memory.

:class:`GeneratedTask` is their base; ``arithmetic`` (:class:`ArithmeticTask`: integer expressions)
and ``chain`` (:class:`ChainTask`: running sums with a heavy-tailed number of steps,
docs/tasks.md) are registered as built-in tasks when this module is imported, which
:mod:`asyncrl.tasks.tasks` (``load_task``) does. Their splits follow :mod:`asyncrl.tasks.base`: a
problem is held out by its hash, and the held-out problems never depend on the seed.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.core.config import ArithmeticConfig, ChainConfig, DataConfig
from asyncrl.tasks.base import HELDOUT_PERCENT, Problem, Task, is_heldout, problem_hash
from asyncrl.tasks.registry import TaskError, register_task

__all__ = ["GeneratedTask", "ArithmeticTask", "ChainTask", "chain_steps", "chain_solution", "arithmetic_task",
           "chain_task"]


class GeneratedTask(Task):
    """A task whose problems are drawn from a seeded generator (``arithmetic``, ``chain``).

    Args:
        cfg: the task's config section (``data.arithmetic`` / ``data.chain``).
        num_train: how many train problems one epoch visits (``data.num_train_prompts``).
        seed: the generator's seed for train problems (``data.seed``); held-out problems never
            depend on it.
        heldout_percent: the share of hash buckets held out (``data.heldout_percent``).
    """

    def __init__(self, cfg: Any, num_train: int, seed: int = 0, heldout_percent: int = HELDOUT_PERCENT):
        self.cfg = cfg
        self._num_train = num_train
        self.seed = seed
        self.heldout_percent = heldout_percent

    def num_train(self) -> int:
        return self._num_train


# ------------------------------------------------------------------------------------------------
# arithmetic


class ArithmeticTask(GeneratedTask):
    """Procedurally generated integer arithmetic: ``What is 37 - 5 * 12?``.

    Operand ``i`` is uniform in ``[0, 10**digits[i] - 1]``; operators are drawn uniformly from
    ``operators``; the gold answer follows the usual precedence (``*`` before ``+``/``-``).
    Train problem ``i`` is drawn from ``Random("arith-train:{seed}:{i}:{attempt}")``, redrawn
    while its hash falls in the held-out buckets; the held-out problems are drawn from a fixed
    stream (``seed``-independent, so every run and every evaluation sees the same held-out set),
    kept only if their hash is held out, de-duplicated.
    """

    name = "arithmetic"
    cfg: ArithmeticConfig

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        terms = [rng.randint(0, 10**d - 1) for d in self.cfg.digits_per_term]
        ops = [rng.choice(self.cfg.operators) for _ in range(self.cfg.n_terms - 1)]
        expr = str(terms[0])
        for op, t in zip(ops, terms[1:]):
            expr += f" {op} {t}"
        # Only digits, spaces and + - * : evaluating it is safe and exact (Python ints).
        value = eval(expr, {"__builtins__": {}}, {})  # noqa: S307
        return expr, int(value)

    def _problem(self, expr: str, value: int, h: str, split: str, index: int) -> Problem:
        meta = {
            "task": self.name,
            "gold": str(value),
            "problem_hash": h,
            "split": split,
            "index": index,
            "expression": expr,
        }
        return Problem(text=f"What is {expr}?", gold=str(value), metadata=meta)

    def train_problem(self, index: int) -> Problem:
        if not 0 <= index < self._num_train:
            raise IndexError(f"train index {index} outside [0, {self._num_train})")
        for attempt in range(1000):
            expr, value = self._draw(random.Random(f"arith-train:{self.seed}:{index}:{attempt}"))
            h = problem_hash(expr)
            if not is_heldout(h, self.heldout_percent):
                return self._problem(expr, value, h, "train", index)
        raise TaskError("could not draw a train problem in 1000 attempts")  # p < 0.1**1000

    def heldout(self, n: int) -> list[Problem]:
        rng = random.Random("arith-heldout")
        seen: set[str] = set()
        out: list[Problem] = []
        max_draws = 200 * n + 10_000
        for _ in range(max_draws):
            if len(out) == n:
                break
            expr, value = self._draw(rng)
            h = problem_hash(expr)
            if is_heldout(h, self.heldout_percent) and h not in seen:
                seen.add(h)
                out.append(self._problem(expr, value, h, "heldout", len(out)))
        if len(out) < n:
            c = self.cfg
            raise TaskError(
                f"the arithmetic task (digits={c.digits}, operators={c.operators!r}, n_terms={c.n_terms}) "
                f"has only about {len(out)} distinct held-out problems ({self.heldout_percent}% held out), "
                f"{n} requested: ask for fewer (data.num_heldout_prompts / --num_problems), raise "
                "data.heldout_percent or make the task larger"
            )
        return out


# ------------------------------------------------------------------------------------------------
# chain: running sums with a heavy-tailed number of steps


def chain_steps(rng: random.Random, cfg: ChainConfig) -> int:
    """Draw a problem's number of steps from the truncated discrete Pareto law of ``cfg``.

    ``steps = min(max_steps, floor(min_steps * U ** (-1 / tail_index)))``, ``U = 1 - rng.random()``
    uniform on ``(0, 1]``; so ``P(steps >= s) = (min_steps / s) ** tail_index`` for
    ``min_steps <= s < max_steps`` and ``P(steps = max_steps) = (min_steps / max_steps) ** tail_index``
    (:class:`asyncrl.core.config.ChainConfig` gives the source of the law).

    Returns:
        The number of additions, in ``[min_steps, max_steps]``.
    """
    u = 1.0 - rng.random()  # (0, 1]: never 0, so the power is finite
    return min(cfg.max_steps, int(cfg.min_steps * u ** (-1.0 / cfg.tail_index)))


def chain_solution(numbers: list[int]) -> str:
    """The worked answer of a chain problem: one line per step, then the ``Answer:`` line.

    ``[3, 5, 2, 7]`` -> ``"3 + 5 = 8\n8 + 2 = 10\n10 + 7 = 17\nAnswer: 17"`` (``len(numbers) - 1``
    step lines). It is the format the system prompt of ``configs/smollm2_longtail.yaml`` shows.

    Raises:
        ValueError: fewer than two numbers.
    """
    if len(numbers) < 2:
        raise ValueError(f"a chain needs at least two numbers, got {numbers}")
    lines, total = [], numbers[0]
    for n in numbers[1:]:
        lines.append(f"{total} + {n} = {total + n}")
        total += n
    lines.append(f"Answer: {total}")
    return "\n".join(lines)


class ChainTask(GeneratedTask):
    """Running sums whose length follows a heavy-tailed law: ``Add these numbers step by step: 3, 5, 2, 7``.

    A problem has ``steps + 1`` numbers, each uniform in ``[1, 10**digits - 1]``; ``steps`` is drawn
    by :func:`chain_steps` (truncated discrete Pareto). The gold answer is the sum; the worked
    answer (:func:`chain_solution`) has one line per step, so the length of a correct response
    grows linearly with ``steps`` (about 10 tokens a step for one-digit numbers with SmolLM2's
    tokenizer): a heavy-tailed step count gives heavy-tailed response lengths.

    Splits as for arithmetic, with one difference: the step count is drawn first and only the
    numbers are redrawn until the problem's hash lands in the wanted split, so both splits follow
    the step-count law exactly (redrawing whole problems would under-represent the short steps,
    whose problem space is small: 729 three-number problems of one-digit numbers). Train problem
    ``i`` uses ``Random("chain-train:{seed}:{i}")``; the held-out problems come from the fixed
    stream ``Random("chain-heldout")`` (seed-independent), distinct by hash.

    Metadata: ``numbers`` (list of ints, ``steps + 1`` of them), ``steps`` (int), ``first_step``
    (``"3 + 5"``, for the assistant prefill ``"{first_step} ="``) and ``numbers_text`` (``"3, 5, 2, 7"``).
    """

    name = "chain"
    cfg: ChainConfig
    _MAX_REDRAWS = 1000

    def _numbers(self, rng: random.Random, steps: int) -> list[int]:
        top = 10**self.cfg.digits - 1
        return [rng.randint(1, top) for _ in range(steps + 1)]

    def _problem(self, numbers: list[int], h: str, split: str, index: int) -> Problem:
        text = ", ".join(str(n) for n in numbers)
        gold = str(sum(numbers))
        meta = {
            "task": self.name,
            "gold": gold,
            "problem_hash": h,
            "split": split,
            "index": index,
            "numbers": list(numbers),
            "numbers_text": text,
            "steps": len(numbers) - 1,
            "first_step": f"{numbers[0]} + {numbers[1]}",
        }
        return Problem(text=f"Add these numbers step by step: {text}", gold=gold, metadata=meta)

    def _draw(self, rng: random.Random, heldout: bool, seen: set[str]) -> Problem | None:
        steps = chain_steps(rng, self.cfg)
        for _ in range(self._MAX_REDRAWS):
            numbers = self._numbers(rng, steps)
            h = problem_hash(", ".join(str(n) for n in numbers))
            if is_heldout(h, self.heldout_percent) == heldout and h not in seen:
                return self._problem(numbers, h, "heldout" if heldout else "train", 0)
        return None

    def train_problem(self, index: int) -> Problem:
        if not 0 <= index < self._num_train:
            raise IndexError(f"train index {index} outside [0, {self._num_train})")
        p = self._draw(random.Random(f"chain-train:{self.seed}:{index}"), heldout=False, seen=set())
        if p is None:  # p < (heldout_percent / 100) ** 1000
            raise TaskError(f"could not draw a chain train problem in {self._MAX_REDRAWS} attempts")
        return Problem(p.text, p.gold, {**p.metadata, "index": index})

    def heldout(self, n: int) -> list[Problem]:
        rng = random.Random("chain-heldout")
        seen: set[str] = set()
        out: list[Problem] = []
        while len(out) < n:
            p = self._draw(rng, heldout=True, seen=seen)
            if p is None:
                c = self.cfg
                raise TaskError(
                    f"the chain task (digits={c.digits}, min_steps={c.min_steps}) ran out of distinct held-out "
                    f"problems after {len(out)} of {n} ({self.heldout_percent}% held out; its shortest problems "
                    "have the smallest space): ask for fewer (data.num_heldout_prompts / --num_problems), raise "
                    "data.heldout_percent, data.chain.digits or data.chain.min_steps"
                )
            seen.add(p.metadata["problem_hash"])
            out.append(Problem(p.text, p.gold, {**p.metadata, "index": len(out)}))
        return out


@register_task("arithmetic")
def arithmetic_task(data: DataConfig, seed: int) -> ArithmeticTask:
    """The built-in ``arithmetic`` task of ``data.arithmetic``; ``seed`` selects its train problems."""
    return ArithmeticTask(data.arithmetic, data.num_train_prompts, seed, data.heldout_percent)


@register_task("chain")
def chain_task(data: DataConfig, seed: int) -> ChainTask:
    """The built-in long-tailed ``chain`` task of ``data.chain``; ``seed`` selects its train problems."""
    return ChainTask(data.chain, data.num_train_prompts, seed, data.heldout_percent)
