"""bench/answer_probe.py: the error classes, and a real probe of a model on the held-out problems."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_bench
import yaml

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ap():
    return load_bench("answer_probe")


@pytest.mark.parametrize("a, b, answer, kind", [
    (18, 3, " 21.", "correct"), (18, 3, " 11.", "dropped_carry"), (23, 2, " 35", "extra_carry"),
    (23, 2, " 15", "other"), (18, 3, " 31", "other"), (23, 2, " twenty", "no_number"), (23, 2, "", "no_number"),
])
def test_classify(ap, a, b, answer, kind):
    assert ap.classify(a, b, a + b, answer) == kind


def test_probe_a_real_model_on_the_heldout_problems(ap, tiny_model_dir, tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "smollm2_arith.yaml").read_text())
    cfg["model"]["path"] = str(tiny_model_dir)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = ap.probe("base", str(path), num_problems=6, max_new_tokens=3)
    assert r["n"] == 6 == sum(b["n"] for b in r["by_kind"].values())
    assert sum(b.get("correct", 0) for b in r["by_kind"].values()) + sum(r["errors"].values()) == 6
    assert 0.0 <= r["accuracy"] <= 1.0 and len(r["examples"]) == sum(r["errors"].values())
    bad = dict(cfg, data=dict(cfg["data"], arithmetic=dict(cfg["data"]["arithmetic"], operators="*")))
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="two-operand addition"):
        ap.probe("base", str(path), num_problems=2)
