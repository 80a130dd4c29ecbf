"""The ``chain`` task's own reward, ``data.reward: chain_partial`` (docs/tasks.md, "Partial credit").

Kept apart from :mod:`asyncrl.tasks.generated` (the task) and :mod:`asyncrl.tasks.rewards` (the
scorer): it needs the scorer's answer check, and the scorer finds it by name through
``importlib`` (:func:`asyncrl.tasks.rewards.load_reward_fn`), so no module imports the other both
ways.
"""

from __future__ import annotations

import re
from typing import Sequence

from asyncrl.tasks.rewards import check_answer

__all__ = ["CHAIN_PARTIAL_WEIGHT", "chain_correct_steps", "chain_partial_reward"]

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

    Raises:
        ValueError: ``metadata`` has no ``numbers`` list of at least two ints or no ``gold`` (not
            a chain problem).
    """
    numbers, gold = metadata.get("numbers"), metadata.get("gold")
    if not isinstance(numbers, list) or len(numbers) < 2 or not all(isinstance(n, int) for n in numbers) \
            or gold is None:
        raise ValueError("data.reward=chain_partial needs the chain task's metadata ('numbers', 'gold'); "
                         "use it with data.task: chain")
    if check_answer(response, str(gold)).correct:
        return 1.0
    return CHAIN_PARTIAL_WEIGHT * chain_correct_steps(response, numbers) / len(numbers)
