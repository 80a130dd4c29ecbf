"""Shared output of the benchmark scripts: print the result and keep it as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], path: Path | None) -> None:
    """Print ``result`` as indented JSON and, when ``path`` is given, write it there (parents created)."""
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
