"""Shared output of the benchmark scripts: print the result and keep it as JSON, with portable paths.

A record is read on other machines (docs/bench/*.json), so it never holds an absolute path of the
machine that measured it: :func:`record_path` names one file or directory the way the records in
docs/bench do, and :func:`portable` rewrites every path under known roots in a whole record.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["emit", "record_path", "portable", "write_record"]

#: A run directory holds this file (asyncrl.controller writes it).
RUN_MARKER = "run_state.json"


def emit(result: dict[str, Any], path: Path | None) -> None:
    """Print ``result`` as indented JSON and, when ``path`` is given, write it there (parents created)."""
    print(json.dumps(result, indent=2))
    write_record(result, path)


def write_record(result: dict[str, Any], path: Path | None) -> None:
    """Write ``result`` as indented JSON to ``path`` (parents created); nothing when ``path`` is None."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


def record_path(path: str | os.PathLike) -> str:
    """How a benchmark record names ``path``: never an absolute path of the measuring machine.

    * inside a run directory (a folder holding ``run_state.json``): relative to the folder that
      holds the run, ``<run>/weights/v000050``, as docs/bench's records name run files;
    * a model prepared in asyncrl's cache (``<cache>/models/<name>``): its name;
    * any other existing path: its last component (the directory's or file's name);
    * anything else (a model name, ``base``, a URI): as given.
    """
    text = os.fspath(path)
    p = Path(text).expanduser()
    if not p.exists():
        return text
    p = p.resolve()
    for parent in (p, *p.parents):
        if (parent / RUN_MARKER).is_file():
            return str(p.relative_to(parent.parent))
    try:
        from asyncrl.models.cache import models_dir

        return str(p.relative_to(models_dir().resolve()))
    except (ImportError, ValueError):
        return p.name


def portable(obj: Any, roots: dict[str | os.PathLike, str]) -> Any:
    """``obj`` (JSON-like: dicts, lists, strings) with every path under one of ``roots`` rewritten.

    Each root's prefix becomes its label, in strings anywhere (``"--out=/tmp/x/runs"`` too): a
    label ``"<work>"`` gives ``<work>/runs``, an empty label a path relative to the root (the root
    itself becomes ``.``). The longest root is tried first. Keys and non-strings are kept.

    Args:
        obj: the record.
        roots: absolute path (a directory, or a file such as the interpreter) -> its label.
    """
    pairs = sorted(((os.fspath(r).rstrip("/"), label) for r, label in roots.items() if os.fspath(r).rstrip("/")),
                   key=lambda x: -len(x[0]))
    if not pairs:
        return obj
    pattern = re.compile("|".join(f"({re.escape(r)})(/|(?=$|[\\s'\",:;)]))" for r, _ in pairs))

    def sub(m: re.Match) -> str:
        i = next(k for k in range(len(pairs)) if m.group(2 * k + 1) is not None)
        label, slash = pairs[i][1], m.group(2 * i + 2)
        if label:
            return label + slash
        return "" if slash else "."

    def walk(x: Any) -> Any:
        if isinstance(x, str):
            return pattern.sub(sub, x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        return x

    return walk(obj)
