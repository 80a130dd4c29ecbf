"""``asyncrl train``: resolve a run's config (new, or ``--resume RUN_DIR``) and run its session."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from asyncrl.controller.controller import run_session
from asyncrl.controller.errors import ControllerError

__all__ = ["parse_controller_flags", "resolve_run", "main"]

USAGE = """usage: asyncrl train --config FILE [--FIELD VALUE ...] [--resume RUN_DIR] [--overwrite]

  --resume RUN_DIR   continue the run in RUN_DIR (its config.yaml; flags override, e.g. --total_steps)
  --overwrite        delete an existing run directory of the same name and start afresh
Every config field is a flag (`asyncrl config show --help`); the headline ones are
--partial_percent P --max_budget M --max_staleness ETA."""


def parse_controller_flags(argv: list[str]) -> tuple[Path | None, bool, list[str]]:
    """Split ``--resume RUN_DIR`` and ``--overwrite`` from the config flags.

    Returns:
        ``(resume_dir, overwrite, remaining argv)``.

    Raises:
        ControllerError: ``--resume`` without a directory, or with ``--overwrite``.
    """
    resume: Path | None = None
    overwrite = False
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--resume" or a.startswith("--resume="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            if not value or value.startswith("--"):
                raise ControllerError("--resume needs the run directory, e.g. --resume runs/tiny")
            resume = Path(value)
            i += 1 if "=" in a else 2
            continue
        if a == "--overwrite":
            overwrite = True
            i += 1
            continue
        rest.append(a)
        i += 1
    if resume is not None and overwrite:
        raise ControllerError("--resume and --overwrite contradict each other: choose one")
    return resume, overwrite, rest


def resolve_run(argv: list[str]) -> tuple[Any, bool] | int:
    """The run's config and whether it resumes, from ``asyncrl train``'s argv.

    Returns:
        ``(config, resumed)``, or an exit code after printing help or an error.
    """
    from asyncrl.core.config import ConfigError, load_config
    from asyncrl.core.config_cli import config_help

    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n\n" + config_help("train"))
        return 0
    try:
        resume, overwrite, rest = parse_controller_flags(argv)
        if resume is not None:
            cfg_path = resume / "config.yaml"
            if not cfg_path.exists():
                raise ControllerError(f"--resume {resume}: no config.yaml there; is it a run directory of `asyncrl train`?")
            if "--config" in rest or any(a.startswith("--config=") for a in rest):
                raise ControllerError("--resume takes the config from RUN_DIR/config.yaml: drop --config")
            overrides = {"run": {"output_dir": str(resume.parent), "name": resume.name}}
            cfg = load_config(["--config", str(cfg_path), *rest], overrides=overrides)
            return cfg, True
        cfg = load_config(rest)
    except (ControllerError, ConfigError) as exc:
        print(f"asyncrl train: {exc}", file=sys.stderr)
        return 2
    run_dir = cfg.run.run_dir
    if (run_dir / "config.yaml").exists():
        if not overwrite:
            print(f"asyncrl train: run directory {run_dir} holds a previous run: continue it with "
                  f"--resume {run_dir}, start another with --run_name NEW, or replace it with --overwrite",
                  file=sys.stderr)
            return 2
        shutil.rmtree(run_dir)
    return cfg, False


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl train``; returns the exit code (0 done or stopped, 1 failed, 2 bad config)."""
    resolved = resolve_run(argv)
    if isinstance(resolved, int):
        return resolved
    return run_session(*resolved)
