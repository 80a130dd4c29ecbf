"""The ``asyncrl`` console script: one entry point, one subcommand per role or tool.

Each subcommand lives in the package of the component it drives and is imported only when
called, so ``asyncrl --help`` is instant (no torch, deepspeed or transformers import).
Every handler takes the remaining argv and returns a process exit code.
"""

from __future__ import annotations

import importlib
import sys

#: subcommand -> ("module:function", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("asyncrl.controller.train:main", "run asynchronous partial-rollout RL end to end on this machine"),
    "config": ("asyncrl.core.config_cli:main", "show the resolved configuration (`asyncrl config show`)"),
    "redis": ("asyncrl.controller.redis_server:main", "start a local redis-server (AOF on, loopback, password) for a run"),
    "models": ("asyncrl.models:main", "prepare and list local models (`asyncrl models prepare smollm2-135m-instruct`)"),
    "buffer": ("buffers.cli:main", "inspect a run's replay buffer (`stats`, `inspect`, `drain`)"),
    "rollout-server": ("rollout_server.cli:main", "run a rollout server: embedded engine + rollout worker"),
    "reward-model": ("asyncrl.reward_model.role:main", "serve a reward model (sequence classification) to the rollout workers"),
    "env-server": ("asyncrl.env_server.role:main", "serve the agent workflows' tools over HTTP (deadline, latency, /metrics)"),
    "trainer": ("trainer.cli:main", "run the DeepSpeed trainer (works under torchrun and the deepspeed launcher)"),
    "eval": ("asyncrl.evaluation.cli:main", "held-out accuracy of a model or checkpoint on a task"),
    "report": ("asyncrl.metrics.report:main", "curves (PNG) and a markdown summary of a run directory"),
    "trace": ("asyncrl.metrics.trace:main", "every sample's life as a Perfetto trace (`asyncrl trace RUN_DIR [--png]`)"),
}

USAGE = "usage: asyncrl [-h] [--version] COMMAND [ARGS...]"


def _help() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = [
        USAGE,
        "",
        "asyncrl: asynchronous partial-rollout RL for LLM post-training.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()),
        "",
        "Headline flags (any command that takes a config): --partial_percent P --max_budget M",
        "--max_staleness ETA; any field as a dotted flag, e.g. --rollout.temperature 0.8.",
        "`asyncrl COMMAND --help` shows a command's options.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``asyncrl COMMAND ...`` to the command's handler; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_help())
        return 0 if argv else 2
    if argv[0] == "--version":
        from asyncrl import __version__

        print(f"asyncrl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f" (did you mean `asyncrl {close[0]}`?)" if close else ""
        print(f"asyncrl: unknown command {name!r}{hint}\n{USAGE}", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    module_name, func_name = target.split(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    return int(handler(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
