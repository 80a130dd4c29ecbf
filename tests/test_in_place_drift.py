"""bench/in_place_drift.py: A's cache under B's decode, checked where the answer is known."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_bench
import yaml

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mod():
    return load_bench("in_place_drift")


@pytest.fixture
def config(tiny_model_dir, tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "smollm2_arith.yaml").read_text())
    cfg["model"]["path"] = str(tiny_model_dir)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_same_weights_give_no_drift_and_other_weights_do(mod, tiny_model_dir, config, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    same = mod.drift(str(tiny_model_dir), str(tiny_model_dir), config, num_problems=4, splits=[1, 2], max_new_tokens=6)
    for k in ("1", "2"):
        s = same["splits"][k]
        assert s["mixed_vs_new"]["tokens"] > 0
        assert s["mixed_vs_new"]["max_abs"] < 1e-4  # A's cache decoded by A: the clean forward's logprobs
        assert s["old_vs_new"]["max_abs"] == 0.0
    other = tmp_path / "other"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(other)
    moved = mod.drift(str(tiny_model_dir), str(other), config, num_problems=4, splits=[1], max_new_tokens=6)
    s = moved["splits"]["1"]
    assert s["old_vs_new"]["mean_abs"] > 1e-3 and s["mixed_vs_new"]["mean_abs"] > 1e-4
    assert s["mixed_vs_new"]["k3"] >= 0.0


def test_stats_and_bad_splits(mod, tiny_model_dir, config):
    import math

    st = mod._stats([math.log(0.5), math.log(0.25)], [math.log(0.25), math.log(0.25)])
    assert st["tokens"] == 2 and st["max_abs"] == pytest.approx(math.log(2))
    assert st["k3"] == pytest.approx((0.5 - 1 + math.log(2)) / 2)
    assert mod._stats([], [])["tokens"] == 0
    with pytest.raises(ValueError, match=">= 1"):
        mod.drift(str(tiny_model_dir), str(tiny_model_dir), config, 2, [0], 4)
