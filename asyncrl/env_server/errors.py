"""Errors of environment-server calls, as the workflow's tool handle sees them.

* :class:`ToolCallError` — the call ended without a result: the tool refused its input, or the
  call ran past its deadline. It is an **observation** for the model, never a crash:
  :meth:`asyncrl.agents.model.EpisodeModel.tool` returns ``(False, exc.observation)``.
* :class:`EnvServerUnavailable` — the environment server could not be reached (or kept
  draining) for longer than ``agent.env_server.outage_seconds``. An infrastructure failure, not
  the model's: it is never shown to the model; the workflow fails and the sample is FAILED
  (``WorkflowError: EnvServerUnavailable: ...``).
"""

from __future__ import annotations

__all__ = ["ToolCallError", "EnvServerUnavailable"]


class ToolCallError(Exception):
    """A tool call that ended without a result; ``observation`` is the text the model sees.

    Attributes:
        observation: ``error: ...`` (e.g. ``error: the tool took longer than 10 s``).
        outcome: ``tool_error`` (the tool refused the input) or ``deadline``.
    """

    def __init__(self, observation: str, outcome: str = "tool_error") -> None:
        super().__init__(observation)
        self.observation = observation
        self.outcome = outcome


class EnvServerUnavailable(RuntimeError):
    """The environment server stayed unreachable or draining past ``agent.env_server.outage_seconds``."""
