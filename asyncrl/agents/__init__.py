"""Agentic RL: multi-turn workflows with tools, as durable episodes (docs/agents.md).

The workflow API (:mod:`asyncrl.agents.workflow`), observation tokenisation
(:mod:`asyncrl.agents.chat`), built-in workflows (:mod:`asyncrl.agents.builtin`) and
loading of user workflows (:mod:`asyncrl.agents.loader`). The rollout worker runs episodes in
``rollout_server/episodes.py``; the trainer turns them into samples in ``trainer/episodes.py``.
"""

from asyncrl.agents.chat import ChatFormat, ChatFormatError
from asyncrl.agents.model import EpisodeModel
from asyncrl.agents.loader import LoadedWorkflow, WorkflowError, load_workflow
from asyncrl.agents.workflow import (
    TERMINATIONS,
    Episode,
    EpisodeTask,
    EpisodeTimeout,
    ModelOutput,
    NonDeterministicWorkflow,
    Step,
    TokenLimit,
)

__all__ = [
    "TERMINATIONS", "Episode", "EpisodeModel", "EpisodeTask", "EpisodeTimeout", "ModelOutput",
    "NonDeterministicWorkflow", "Step", "TokenLimit", "ChatFormat", "ChatFormatError", "LoadedWorkflow",
    "WorkflowError", "load_workflow",
]
