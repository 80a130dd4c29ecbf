"""The closed vocabularies the config's choices are built from, one place each.

* :data:`GROUP_ESTIMATORS` / :data:`ADVANTAGE_ESTIMATORS`: the advantage estimators.
  ``trainer.advantage`` takes one of :data:`ADVANTAGE_ESTIMATORS`; trainer/advantages.py implements
  one function per name of :data:`GROUP_ESTIMATORS` (its ``ESTIMATORS`` is this tuple), ``gae`` is
  the critic's (trainer/critic.py). tests/test_vocabularies.py checks the two agree.
* :data:`BUILTIN_TASKS` / :data:`FILE_TASKS`: the tasks asyncrl ships, registered in
  asyncrl/tasks/generated.py and asyncrl/tasks/tasks.py; ``data.task`` is one of them or a
  ``module:Class`` (:data:`TASK_CLASS`) outside asyncrl, loaded by asyncrl/tasks/registry.py.

The finish reasons are :class:`asyncrl.core.types.FinishReason` (the data model's vocabulary).
"""

from __future__ import annotations

import re

__all__ = ["ADVANTAGE_ESTIMATORS", "BUILTIN_TASKS", "FILE_TASKS", "GROUP_ESTIMATORS", "TASK_CLASS"]

#: The critic-free advantage estimators (group or batch baselines), one function each in trainer/advantages.py.
GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
#: The choices of ``trainer.advantage``: the critic-free estimators and ``gae`` (PPO with a critic).
ADVANTAGE_ESTIMATORS: tuple[str, ...] = (*GROUP_ESTIMATORS, "gae")

#: The built-in tasks, registered in asyncrl/tasks/generated.py and asyncrl/tasks/tasks.py like any other task.
BUILTIN_TASKS: tuple[str, ...] = ("arithmetic", "chain", "gsm8k", "jsonl", "parquet")
#: The built-in tasks that read ``data.path``.
FILE_TASKS: tuple[str, ...] = ("gsm8k", "jsonl", "parquet")
#: ``data.task`` naming a task class (or factory) outside asyncrl: ``module:Class``.
TASK_CLASS = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
