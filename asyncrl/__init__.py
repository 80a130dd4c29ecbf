"""asyncrl: asynchronous partial-rollout RL for LLM post-training.

One package per layer or role (``docs/architecture.md`` has the layout table and the contracts
that ``.importlinter`` enforces): :mod:`asyncrl.core` (types, config, net, weights: imports
nothing else of the project), :mod:`asyncrl.models`, :mod:`asyncrl.metrics`,
:mod:`asyncrl.reward_model`, :mod:`asyncrl.tasks` (tasks and rewards), :mod:`asyncrl.agents`,
the roles (:mod:`asyncrl.feeder`; ``rollout_server``, ``trainer`` and ``buffers`` beside this
package), :mod:`asyncrl.evaluation`, :mod:`asyncrl.controller` (the single-machine
orchestration) and the CLI (:mod:`asyncrl.cli`).
"""

__version__ = "0.1.0"
