"""Resolving ``agent.workflow`` / ``agent.env`` / ``agent.trajectory_grouping_hook`` to Python callables."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from asyncrl.agents.model import Workflow

__all__ = ["LoadedWorkflow", "WorkflowError", "load_workflow", "load_callable"]


class WorkflowError(ValueError):
    """A workflow, environment or hook that cannot be loaded; the message says what to fix."""


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """``module:function`` -> the function.

    Raises:
        WorkflowError: not ``module:function``, the module does not import, or no such callable.
    """
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise WorkflowError(f"{what} must be 'module:function', got {spec!r}")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise WorkflowError(f"{what} {spec!r}: cannot import module {mod_name!r}: {exc}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise WorkflowError(f"{what} {spec!r}: module {mod_name!r} has no callable {fn_name!r}")
    return fn


@dataclass
class LoadedWorkflow:
    """A workflow ready to run: ``run(task, model, env)`` and the env factory (or None).

    ``env_client`` is the environment server's client when a built-in workflow calls its tool
    there (``agent.env_server.enabled``), else None; :meth:`aclose` closes it.
    """

    name: str
    run: Workflow
    make_env: Callable[[Any], Any] | None
    env_client: Any = None

    async def aclose(self) -> None:
        """Close what the workflow holds open (the environment server's connection pool)."""
        if self.env_client is not None:
            await self.env_client.aclose()


def load_workflow(agent: Any, api_key: Any = None) -> LoadedWorkflow:
    """The workflow of the ``agent`` config section.

    Args:
        agent: the ``agent`` config section.
        api_key: ``security.api_key`` (str or SecretStr), sent to the environment server when
            ``agent.env_server.api_key_required``.

    Raises:
        WorkflowError: no workflow configured, an unknown built-in, a ``run`` that is not an
            ``async def``, or ``agent.env_server.enabled`` with a built-in workflow that has no
            tool to run there.
    """
    from asyncrl.agents.builtin import BUILTIN_WORKFLOWS, ENV_SERVER_WORKFLOWS

    spec = agent.workflow
    if not spec:
        raise WorkflowError("agent.workflow is not set")
    env_server = getattr(agent, "env_server", None)
    remote = env_server is not None and env_server.enabled
    if spec in BUILTIN_WORKFLOWS:
        if remote and spec not in ENV_SERVER_WORKFLOWS:
            raise WorkflowError(f"agent.env_server.enabled with agent.workflow {spec!r}: only "
                                f"{', '.join(ENV_SERVER_WORKFLOWS)} call(s) a tool on the environment server")
        run, env_builder = BUILTIN_WORKFLOWS[spec]
        client = None
        if remote:
            from asyncrl.env_server.client import EnvServerClient

            client = EnvServerClient.from_config(env_server, api_key)
        make_env = env_builder(agent, client)
        if agent.env:
            make_env = load_callable(agent.env, "agent.env")
        return LoadedWorkflow(spec, run, make_env, client)
    if ":" not in spec:
        raise WorkflowError(f"agent.workflow {spec!r} is neither a built-in ({', '.join(BUILTIN_WORKFLOWS)}) nor "
                            "'module:function'")
    run = load_callable(spec, "agent.workflow")
    if not inspect.iscoroutinefunction(run):
        raise WorkflowError(f"agent.workflow {spec!r} must be an 'async def run(task, model, env)'")
    return LoadedWorkflow(spec, run, load_callable(agent.env, "agent.env") if agent.env else None)
