"""The ``chain`` task's own rewards, ``data.reward: chain_partial`` and ``chain_partial_matched``
(docs/tasks.md, "Partial credit").

Kept apart from :mod:`asyncrl.tasks.generated` (the task) and :mod:`asyncrl.tasks.rewards` (the
scorer): it needs the scorer's answer check, and the scorer finds it by name through
``importlib`` (:func:`asyncrl.tasks.rewards.load_reward_fn`), so no module imports the other both
ways.
"""

from __future__ import annotations

import re
from typing import Sequence

from asyncrl.tasks.rewards import check_answer

__all__ = ["CHAIN_PARTIAL_WEIGHT", "chain_correct_steps", "chain_partial_reward", "chain_partial_matched_reward",
           "chain_step_lines"]

#: one worked step of a chain answer, ``total + number = new total`` (at most 12 digits per number:
#: bounded work and no oversized ``int`` conversion on a degenerate response)
_STEP_LINE = re.compile(r"(\d{1,12})\s*\+\s*(\d{1,12})\s*=\s*(\d{1,12})")

#: the most a wrong final answer can earn under :func:`chain_partial_reward` (strictly below it)
CHAIN_PARTIAL_WEIGHT = 0.5


def chain_correct_steps(response: str, numbers: Sequence[int]) -> int:
    """How many worked steps ``response`` gets right before its first mistake.

    Step ``j`` (1-based) must read ``s + numbers[j] = s + numbers[j]``, where ``s`` is the running
    sum of ``numbers[:j]``; steps are the ``a + b = c`` matches of the response in order (the
    assistant prefill ``"3 + 5 ="`` is part of the response the reward sees), and counting stops at
    the first one that is not the next right step.

    Returns:
        An int in ``[0, len(numbers) - 1]``.
    """
    total, k = numbers[0], 0
    for m in _STEP_LINE.finditer(response):
        if k == len(numbers) - 1:
            break
        a, b, c = (int(g) for g in m.groups())
        if a != total or b != numbers[k + 1] or c != total + numbers[k + 1]:
            break
        total, k = c, k + 1
    return k


def chain_step_lines(response: str) -> int:
    """How many worked-step lines (``a + b = c`` matches, right or wrong) ``response`` writes.

    Returns:
        An int >= 0 (the assistant prefill ``"3 + 5 ="`` counts once its sum is written).
    """
    return sum(1 for _ in _STEP_LINE.finditer(response))


def _chain_metadata(metadata: dict, name: str) -> tuple[list[int], str]:
    """The chain problem's ``numbers`` and ``gold``; ValueError naming ``data.reward=name`` otherwise."""
    numbers, gold = metadata.get("numbers"), metadata.get("gold")
    if not isinstance(numbers, list) or len(numbers) < 2 or not all(isinstance(n, int) for n in numbers) \
            or gold is None:
        raise ValueError(f"data.reward={name} needs the chain task's metadata ('numbers', 'gold'); "
                         "use it with data.task: chain")
    return numbers, str(gold)


def chain_partial_reward(prompt: str, response: str, metadata: dict) -> float:
    """``data.reward: chain_partial``: the chain task's outcome reward with partial credit per step.

    1.0 when the final answer equals the gold (:func:`asyncrl.tasks.rewards.check_answer`, as
    ``math_verify``); otherwise ``CHAIN_PARTIAL_WEIGHT * k / (steps + 1)`` with ``k`` the leading
    correct steps (:func:`chain_correct_steps`) and ``steps + 1`` counting the answer line, so a
    wrong answer earns less than 0.5 and never ties a correct one. Why: with the outcome reward
    alone only the 2-step problems' groups had reward variance, and GRPO taught 2-step answers to
    every problem (docs/tasks.md, the training check); partial credit gives a long problem's
    group a signal for each further step done right (a process reward in the sense of Lightman et
    al. 2023, "Let's Verify Step by Step", computed by rule rather than learned).

    Its loophole (docs/tasks.md): a response that keeps adding after the last number earns the
    same credit as one that stops (the counting stops at the problem's steps), so a policy can
    learn to overshoot every problem; :func:`chain_partial_matched_reward` scales the credit down for it.

    Raises:
        ValueError: ``metadata`` has no ``numbers`` list of at least two ints or no ``gold`` (not
            a chain problem).
    """
    numbers, gold = _chain_metadata(metadata, "chain_partial")
    if check_answer(response, gold).correct:
        return 1.0
    return CHAIN_PARTIAL_WEIGHT * chain_correct_steps(response, numbers) / len(numbers)


def chain_partial_matched_reward(prompt: str, response: str, metadata: dict) -> float:
    """``data.reward: chain_partial_matched``: ``chain_partial`` with its partial credit scaled by how
    well the response's number of worked steps matches the problem's.

    1.0 for a right final answer, as :func:`chain_partial_reward`. A wrong answer earns
    ``CHAIN_PARTIAL_WEIGHT * k / (steps + 1) * min(L, steps) / max(L, steps)``, where ``k`` counts
    the leading right steps (:func:`chain_correct_steps`) and ``L`` the worked-step lines written
    (:func:`chain_step_lines`): full partial credit for an answer of the problem's own length, less
    the further its length is off, in either direction. Why: under ``chain_partial`` two shapes
    that do not solve the problem kept their credit and were learned (docs/results.md section O):
    stopping after two additions on every problem (the leading right steps still pay), and adding
    on past the last number (``5, 7, 2`` answered ``5 + 7 = 12``, ``12 + 2 = 14``, ``14 + 2 = 16``,
    ``16 + 2 = 18``, ``Answer: 18``: both steps right, so 0.33, the most a wrong answer to a 2-step
    problem can earn; here 0.17). The factor makes the response's length follow the problem, which
    is what the task measures. It is a factor rather than a gate (credit only at the exact length)
    because at base only 2 of 28 answers to 6-10-step problems and none of 20 longer ones have the
    exact length (docs/tasks.md): a gate would leave long problems' groups without reward variance
    again, the failure partial credit was made for.

    Returns:
        A float in ``[0, 1]``; below ``CHAIN_PARTIAL_WEIGHT`` unless the answer is right.

    Raises:
        ValueError: as :func:`chain_partial_reward`.
    """
    numbers, gold = _chain_metadata(metadata, "chain_partial_matched")
    if check_answer(response, gold).correct:
        return 1.0
    steps, lines = len(numbers) - 1, chain_step_lines(response)
    match = min(lines, steps) / max(lines, steps)  # steps >= 1; no lines: 0
    return CHAIN_PARTIAL_WEIGHT * chain_correct_steps(response, numbers) / len(numbers) * match
