"""The package layering is a contract (docs/architecture.md#layout): checked here, so CI fails on a violation.

- ``lint-imports`` (import-linter) with the repo's ``.importlinter``: the layers
  core < buffers < libraries < roles < evaluation < controller < cli, the rollout server and the
  trainer independent of each other, and ``asyncrl.core`` importing nothing else of the project;
- no import cycle between any two modules of the project (lazy imports inside functions count),
  read from the same import graph (grimp, import-linter's graph builder).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("asyncrl", "buffers", "rollout_server", "trainer")


def _env() -> dict[str, str]:
    """This checkout first on the path, whatever is installed."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def test_import_linter_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    cmd = [str(lint)] if lint.exists() else [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"]
    proc = subprocess.run([*cmd, str(REPO / ".importlinter")], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycles_helper_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    code = (
        "import json, grimp\n"
        f"g = grimp.build_graph(*{ROOTS!r}, include_external_packages=False)\n"
        "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    import json

    edges = {m: set(v) for m, v in json.loads(proc.stdout).items()}
    assert len(edges) > 100, "the graph should hold every module of the project"
    assert _cycles(edges) == []


def test_layout_table_and_contracts_name_every_package():
    """docs/architecture.md is the map: its layout table and .importlinter's layers name every package."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    contracts = (REPO / ".importlinter").read_text()
    packages = [f"asyncrl/{p.name}/" for p in sorted((REPO / "asyncrl").iterdir()) if (p / "__init__.py").exists()]
    packages += [f"{root}/" for root in ROOTS if root != "asyncrl"]
    assert "asyncrl/core/" in packages and "asyncrl/controller/" in packages
    for path in packages:
        assert f"| `{path}` |" in doc, f"docs/architecture.md's layout table has no row for {path}"
        module = path.rstrip("/").replace("/", ".")
        assert f"    {module}" in contracts or f"| {module}" in contracts or f"{module} |" in contracts, \
            f".importlinter's layers do not name {module}"
