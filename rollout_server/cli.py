"""``asyncrl rollout-server --config F [flags]``: one rollout server = engine + rollout worker.

The command line only: the role itself (embedded or attached mode, draining on SIGTERM) is
:func:`rollout_server.role.run_rollout_server`.

Flags besides the config tree's: ``--server_index I`` (default 0), ``--worker_id ID`` (default
``<hostname>-<pid>-<i>``), ``--metrics_port P``. The Redis URL is ``buffer.redis_url``
(``--redis_url``), the run ``run.name``.

Exit 1 when the worker stops on an error (the message says why), 2 for a bad command line or
config.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from rollout_server.role import run_rollout_server

__all__ = ["main", "run_rollout_server"]

_OWN_FLAGS = ("server_index", "worker_id", "metrics_port")


def _split_own_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Take ``--server_index``/``--worker_id``/``--metrics_port`` out of ``argv``.

    Raises:
        ValueError: a flag without a value.
    """
    own: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        if key in _OWN_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"--{key} needs a value")
                value = argv[i + 1]
                i += 1
            own[key] = value
        else:
            rest.append(arg)
        i += 1
    return own, rest


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl rollout-server``; returns the exit code."""
    from asyncrl.core.config import ConfigError
    from asyncrl.core.config_cli import config_from_argv

    try:
        own, rest = _split_own_flags(list(argv))
        server_index = int(own["server_index"]) if "server_index" in own else None
        metrics_port = int(own["metrics_port"]) if "metrics_port" in own else None
    except ValueError as exc:
        print(f"asyncrl rollout-server: {exc} (--server_index and --metrics_port take integers)", file=sys.stderr)
        return 2
    cfg = config_from_argv(rest, "rollout-server")
    if isinstance(cfg, int):
        if cfg == 0:
            print("\nrollout-server flags: --server_index I (port base_port+I, or URL I of rollout.server_urls), "
                  "--worker_id ID, --metrics_port P (attached mode)")
        return cfg
    if not cfg.buffer.redis_url:
        print("asyncrl rollout-server: buffer.redis_url is not set (ASYNCRL_BUFFER__REDIS_URL=redis://USER:PASSWORD@HOST:PORT/0 "
              "in the environment: a password on the command line is visible in `ps`, docs/security.md)",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not cfg.rollout.server_urls and server_index is None:
        server_index = 0
    try:
        return asyncio.run(run_rollout_server(cfg, server_index, own.get("worker_id"), metrics_port))
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"asyncrl rollout-server: {exc}", file=sys.stderr)
        return 2
