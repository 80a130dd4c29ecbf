"""The environment-server role: the tools of agent workflows served over HTTP (docs/agents.md).

A sandbox service is how agentic RL runs tools: every tool call is a request to another
process, with a deadline and a latency of its own. Modules, one job each:
:mod:`~asyncrl.env_server.tools` (the tools as plain functions), :mod:`~asyncrl.env_server.latency`
(the documented latency distribution and the published measurements it is fitted to),
:mod:`~asyncrl.env_server.schemas` (one pydantic schema per endpoint, bounded),
:mod:`~asyncrl.env_server.server` (the aiohttp server: deadline, concurrency, drain),
:mod:`~asyncrl.env_server.role` (``asyncrl env-server``: the process),
:mod:`~asyncrl.env_server.client` (what a rollout worker calls) and
:mod:`~asyncrl.env_server.errors`. Importing this package imports no server code.
"""

from __future__ import annotations

from asyncrl.env_server.client import EnvServerClient, deadline_observation
from asyncrl.env_server.errors import EnvServerUnavailable, ToolCallError
from asyncrl.env_server.latency import MEASURED, LatencyModel, fit_lognormal
from asyncrl.env_server.tools import safe_calculate

__all__ = ["EnvServerClient", "EnvServerUnavailable", "ToolCallError", "LatencyModel", "MEASURED", "fit_lognormal",
           "deadline_observation", "safe_calculate"]
