"""``asyncrl config show [--config F] [flags]``: print the resolved configuration.

Also home of :func:`config_from_argv`, the one way every role turns its argv into a config and
reports a bad one (message on stderr, exit code 2).
"""

from __future__ import annotations

import sys

from asyncrl.core.config import AsyncRLConfig, ConfigError, HEADLINE_FLAGS, field_help, load_config

USAGE = "usage: asyncrl config show [--config FILE] [--json] [--FIELD VALUE ...]"


def config_help(command: str) -> str:
    """Help text listing every config field with its default, bounds and docstring."""
    lines = [
        f"usage: asyncrl {command} [--config FILE] [--FIELD VALUE ...]",
        "",
        "Sources, highest first: flags, ASYNCRL_* environment (ASYNCRL_ROLLOUT__TEMPERATURE), --config YAML, defaults.",
        "",
        "headline flags:",
        *(f"  --{flat:<22} = --{dotted}" for flat, dotted in HEADLINE_FLAGS.items()),
        "",
        "fields:",
    ]
    for dotted, default, doc in field_help():
        lines.append(f"  --{dotted}  ({default})")
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)


def config_from_argv(argv: list[str], command: str) -> AsyncRLConfig | int:
    """Resolve a config from a role's argv, or print the problem and return an exit code.

    Returns:
        the config, or 0 after printing ``--help``, or 2 after printing a config error.
    """
    if any(a in ("-h", "--help") for a in argv):
        print(config_help(command))
        return 0
    try:
        return load_config(argv)
    except ConfigError as exc:
        print(f"asyncrl {command}: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl config``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "show":
        print(f"asyncrl config: unknown action {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    rest = argv[1:]
    as_json = "--json" in rest
    rest = [a for a in rest if a != "--json"]
    cfg = config_from_argv(rest, "config show")
    if isinstance(cfg, int):
        return cfg
    if as_json:
        print(cfg.model_dump_json(indent=2))
    else:
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0
