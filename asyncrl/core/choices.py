"""The closed vocabularies the config's choices are built from, one place each.

* :data:`GROUP_ESTIMATORS` / :data:`ADVANTAGE_ESTIMATORS`: the advantage estimators.
  ``trainer.advantage`` takes one of :data:`ADVANTAGE_ESTIMATORS`; trainer/advantages.py implements
  one function per name of :data:`GROUP_ESTIMATORS` (its ``ESTIMATORS`` is this tuple), ``gae`` is
  the critic's (trainer/critic.py). tests/test_vocabularies.py checks the two agree.

The finish reasons are :class:`asyncrl.core.types.FinishReason` (the data model's vocabulary).
"""

from __future__ import annotations

__all__ = ["ADVANTAGE_ESTIMATORS", "GROUP_ESTIMATORS"]

#: The critic-free advantage estimators (group or batch baselines), one function each in trainer/advantages.py.
GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
#: The choices of ``trainer.advantage``: the critic-free estimators and ``gae`` (PPO with a critic).
ADVANTAGE_ESTIMATORS: tuple[str, ...] = (*GROUP_ESTIMATORS, "gae")
