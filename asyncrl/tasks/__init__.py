"""Tasks and rewards: where prompts come from and how responses are scored.

:mod:`asyncrl.tasks.base` holds the task interface (the problem, its split by hash, ``Task``),
:mod:`asyncrl.tasks.generated` the generated built-in tasks (arithmetic, chain), :mod:`asyncrl.tasks.tasks`
the file tasks, the task loader and the train-prompt stream; :mod:`asyncrl.tasks.registry` resolves ``data.task`` (a registered name or a
``module:Class`` outside asyncrl); :mod:`asyncrl.tasks.rewards` the reward functions, the answer checker and the scorer the
rollout workers call.
"""
