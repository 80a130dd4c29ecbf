"""docs/migrating.md stays true: every asyncrl field it names exists, and every worked example's
``asyncrl train`` command line loads as a valid config."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from asyncrl.core.config import AsyncRLConfig, load_config

DOC = Path(__file__).resolve().parent.parent / "docs" / "migrating.md"
SECTIONS = ("run", "model", "data", "reward", "rollout", "buffer", "trainer", "weight_sync", "monitoring", "security", "resources")


def _has_field(dotted: str) -> bool:
    model = AsyncRLConfig
    for part in dotted.split("."):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        model = fields[part].annotation
    return True


def test_every_named_field_exists():
    # the asyncrl column (the second) of every mapping table; the first holds the other system's keys
    cells = [row.split("|")[2] for row in DOC.read_text().splitlines()
             if row.startswith("|") and not row.startswith("|---") and row.count("|") >= 4]
    names = set(re.findall(r"`((?:%s)\.[a-z_.]+[a-z_])" % "|".join(SECTIONS), " ".join(cells)))
    assert len(names) > 40  # the tables are there
    missing = sorted(n for n in names if not _has_field(n.rstrip(".")))
    assert not missing, f"docs/migrating.md names fields asyncrl does not have: {missing}"


def _examples() -> list[list[str]]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S):
        lines = [ln for ln in block.splitlines() if not ln.lstrip().startswith("#")]
        command = " ".join(ln.rstrip("\\").strip() for ln in lines)
        if command.startswith("asyncrl train"):
            out.append(shlex.split(command)[2:])
    return out


@pytest.mark.parametrize("argv", _examples(), ids=lambda a: " ".join(a[:2]))
def test_worked_examples_load(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(DOC.parent.parent)
    argv = [str(tmp_path / "gsm8k.jsonl") if a == "gsm8k.jsonl" else a for a in argv]
    (tmp_path / "gsm8k.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    cfg = load_config(argv)
    assert cfg.trainer.advantage in ("gae", "grpo")


def test_there_are_three_worked_examples():
    assert len(_examples()) == 3
