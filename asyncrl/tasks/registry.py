"""The task registry: ``data.task`` names a registered task or a ``module:Class`` outside asyncrl.

Tasks open the way rewards and workflows do. A task is built by a factory called with the
``data`` config section and the prompt-stream seed, ``factory(data, seed) -> Task``:

* the built-in tasks (``arithmetic``, ``chain``, ``gsm8k``, ``jsonl``, ``parquet``) are registered by
  :mod:`asyncrl.tasks.generated` (``arithmetic``, ``chain``) and :mod:`asyncrl.tasks.tasks` (the files)
  with :func:`register_task`, like any other;
* ``data.task: my_pkg.my_module:MyTask`` imports ``MyTask`` (a :class:`asyncrl.tasks.base.Task`
  subclass taking ``(data, seed)``, or any factory with that signature) in every process that
  loads the task (feeder, evaluation), as ``data.reward``'s ``module:function`` is.

This module knows no task itself, so it sits below the tasks it registers.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable

__all__ = ["TaskError", "TaskFactory", "register_task", "registered_tasks", "task_factory"]

#: ``factory(data, seed) -> Task``: ``data`` is the ``data`` config section, ``seed`` is ``data.seed``.
TaskFactory = Callable[[Any, int], Any]

_TASKS: dict[str, TaskFactory] = {}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class TaskError(ValueError):
    """A task that cannot be built or read (unknown name, missing file, malformed rows); the message says which."""


def register_task(name: str, factory: TaskFactory | None = None) -> Any:
    """Register ``factory`` as the task ``name``; without ``factory``, a decorator that does.

    Raises:
        ValueError: ``name`` is not an identifier, or is registered already.
    """
    def add(f: TaskFactory) -> TaskFactory:
        if not _NAME.match(name):
            raise ValueError(f"task name {name!r} must be an identifier (letters, digits, _)")
        if name in _TASKS and _TASKS[name] is not f:
            raise ValueError(f"task {name!r} is registered already")
        _TASKS[name] = f
        return f

    return add if factory is None else add(factory)


def registered_tasks() -> tuple[str, ...]:
    """The registered task names, in registration order."""
    return tuple(_TASKS)


def task_factory(spec: str) -> TaskFactory:
    """The factory of ``spec``: a registered name, or ``module:Class`` (imported now).

    Raises:
        TaskError: an unknown name, a module that cannot be imported or lacks the attribute, or
            an attribute that is not callable.
    """
    if spec in _TASKS:
        return _TASKS[spec]
    if not _SPEC.match(spec):
        known = ", ".join(_TASKS) or "none"
        raise TaskError(f"unknown task {spec!r}: use a registered task ({known}) or a class 'module:Class'")
    module_name, attr = spec.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"data.task={spec}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"data.task={spec}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TaskError(f"data.task={spec}: {attr!r} is not a class or function")
    return obj
