"""Held-out evaluation (``asyncrl eval``): accuracy of a model or checkpoint on a task's held-out split.

:mod:`asyncrl.evaluation.evaluate` answers single-turn prompts (HF generate, the embedded rollout
engine, or a running server); :mod:`asyncrl.evaluation.episodes` runs agent workflows' episodes.
It sits above the rollout server, whose engine it reuses.
"""
