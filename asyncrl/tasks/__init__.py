"""Tasks and rewards: where prompts come from and how responses are scored.

:mod:`asyncrl.tasks.tasks` holds the task interface, the built-in tasks and the train-prompt
stream; :mod:`asyncrl.tasks.registry` resolves ``data.task`` (a registered name or a
``module:Class`` outside asyncrl); :mod:`asyncrl.tasks.rewards` the reward functions, the answer checker and the scorer the
rollout workers call.
"""
