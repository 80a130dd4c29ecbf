"""The reward-model role: a learned reward served over HTTP to the rollout workers (docs/reward_model.md).

Modules, one job each: :mod:`~asyncrl.reward_model.server` (the model, ``POST /score``, the
dynamic batcher, the drain), :mod:`~asyncrl.reward_model.role` (``asyncrl reward-model``: the
process, its signals and exit codes), :mod:`~asyncrl.reward_model.client` (what a rollout
worker calls, and the score's scaling). Importing this package imports neither torch nor
transformers; the server module does when it loads a model.
"""

from __future__ import annotations

from asyncrl.reward_model.client import RewardModelClient, RewardModelError, scale_score

__all__ = ["RewardModelClient", "RewardModelError", "scale_score"]
