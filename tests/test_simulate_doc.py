"""docs/scaling.md's generated tables are what the simulator prints (bench/simulate/tables.py).

The validation tables (the simulator against every run this machine measured) and the reduced
scaling table (the scaling code on 16 prompt groups per step) are rendered from the code and
compared with the page, block by block. A failure means the model, its inputs or the page
changed without the other: ``python -m bench.simulate doc --write`` puts the code's tables in.
About ten seconds of one core.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.simulate.tables import BLOCKS, doc_blocks, read_blocks, write_blocks

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "scaling.md"


@pytest.fixture(scope="module")
def blocks() -> dict[str, str]:
    return doc_blocks()


def test_the_page_marks_every_generated_table():
    assert list(read_blocks(DOC.read_text())) == list(BLOCKS)


@pytest.mark.parametrize("name", BLOCKS)
def test_the_pages_table_is_the_codes(name, blocks):
    page = read_blocks(DOC.read_text())[name]
    assert page == blocks[name], (f"docs/scaling.md's {name!r} differs from what the code prints; "
                                  "run `python -m bench.simulate doc --write` and read the diff")


def test_tables_carry_the_measured_and_predicted_figures(blocks):
    """The rendered tables hold the figures the page discusses (so a renderer that drops rows fails)."""
    main = blocks["validation-main"].splitlines()
    assert len(main) == 2 + 5 + 5 + 3  # header, the async and sync runs' 5 rows, the 20-minute check's 3
    assert "| async (p 0.75, M 32, η 2; 1 core each) | seconds per step | 35.9 |" in main[2]
    assert len(blocks["validation-bench-b"].splitlines()) == 2 + 4 * 2
    assert blocks["validation-summary"].startswith("Summary: 37 of 48 quantities within 20%")
    agents = blocks["validation-agents"]
    assert "| sync-s1 |" in agents and "| async-s1 |" in agents and "| async |" in agents  # runs and the ratio
    longtail = blocks["validation-longtail"]
    assert "| sync-s1 | 18 |" in longtail and "| async-s1 | 12 |" in longtail and "| async | 3 (3) | 0.96 |" in longtail
    gpus = [line.split("|")[1].strip() for line in blocks["scaling-reduced"].splitlines() if line[:3] in ("| 8", "| 1")]
    assert gpus == ["8", "16", "8", "16"]  # two workloads, two scales


def test_blocks_are_read_and_written_between_their_markers():
    page = "intro\n<!-- bench.simulate: a -->\nold\n<!-- /bench.simulate -->\nmiddle\n" \
           "<!-- bench.simulate: b -->\nkept\n<!-- /bench.simulate -->\n"
    new = write_blocks(page, {"a": "| new |\n|---|"})
    assert read_blocks(new) == {"a": "| new |\n|---|", "b": "kept"}
    assert new.startswith("intro\n") and "\nmiddle\n" in new
    with pytest.raises(KeyError, match="no markers"):
        write_blocks(page, {"c": "x"})
    with pytest.raises(ValueError, match="twice"):
        read_blocks(page + page)


@pytest.mark.parametrize("argv", [["-m", "bench.simulate"], ["bench/simulate"]])
def test_both_invocations_run(argv, tmp_path):
    """``python -m bench.simulate`` from the repository root, and ``python bench/simulate`` (the folder)."""
    proc = subprocess.run([sys.executable, *argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "validate" in proc.stdout and "scaling" in proc.stdout and "doc" in proc.stdout
