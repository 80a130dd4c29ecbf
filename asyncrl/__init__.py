"""asyncrl: asynchronous partial-rollout RL for LLM post-training.

Core shared by every role: configuration (:mod:`asyncrl.config`), the CLI
(:mod:`asyncrl.cli`), the data model, model loading, tasks and rewards, and the
single-machine controller. See ``docs/architecture.md`` for the contract between the parts.
"""

__version__ = "0.1.0"
