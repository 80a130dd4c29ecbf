"""DeepSpeed config generation, shipped presets, LR schedule, and the CLI's fast error paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.core.config import load_config
from trainer.engine import PRESETS, deepspeed_config, lr_at, preset_configs

REPO = Path(__file__).resolve().parent.parent


def test_deepspeed_config_from_typed_tree():
    cfg = load_config([], environ={}, overrides={"trainer": {"zero_stage": 2, "precision": "bf16",
                                                              "optimizer": {"lr": 3e-6, "grad_clip": 0.5, "weight_decay": 0.1}}})
    ds = deepspeed_config(cfg)
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"] == {"enabled": True}
    assert ds["gradient_clipping"] == 0.5  # always explicit (DeepSpeed's default changed in 0.19.3)
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-6, "betas": [0.9, 0.999], "eps": 1e-8,
                                                             "weight_decay": 0.1, "torch_adam": True, "fused": True}}
    assert ds["managed_gradient_accumulation"] is False
    assert "train_batch_size" not in ds


def test_shipped_presets_match_the_generator():
    generated = preset_configs()
    assert set(generated) == set(PRESETS)
    for name, data in generated.items():
        shipped = json.loads((REPO / "configs" / "deepspeed" / f"{name}.json").read_text())
        assert shipped == data, f"configs/deepspeed/{name}.json drifted: run python -m trainer.engine configs/deepspeed"


def test_lr_schedules():
    opt = load_config([], environ={}, overrides={"trainer": {"optimizer": {"lr": 0.5, "warmup_steps": 2, "lr_schedule": "linear"}}}).trainer.optimizer
    assert [lr_at(s, opt, 12) for s in (0, 1, 2, 7, 12)] == pytest.approx([0.25, 0.5, 0.5, 0.25, 0.0])
    opt = load_config([], environ={}, overrides={"trainer": {"optimizer": {"lr": 0.5, "lr_schedule": "cosine"}}}).trainer.optimizer
    assert [lr_at(s, opt, 10) for s in (0, 5, 10)] == pytest.approx([0.5, 0.25, 0.0])
    opt = load_config([], environ={}, overrides={"trainer": {"optimizer": {"lr": 0.3}}}).trainer.optimizer
    assert lr_at(99, opt, 10) == 0.3


def _cli(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "trainer", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)


def test_cli_help_is_instant_and_lists_fields():
    code = ("import sys; from trainer.cli import main; main(['--help']); "
            "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'heavy import at --help'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "--trainer.zero_stage" in proc.stdout


def test_cli_errors_exit_2_with_a_message(tmp_path):
    proc = _cli("--trainer.zero_stage", "5")
    assert proc.returncode == 2 and "trainer.zero_stage" in proc.stderr
    proc = _cli()
    assert proc.returncode == 2 and "--buffer.redis_url" in proc.stderr
    proc = _cli(env_extra={"ASYNCRL_TRAINER_BATCHES": str(tmp_path / "missing.jsonl")})
    assert proc.returncode == 2 and "is not a file" in proc.stderr


def test_deepspeed_launcher_local_rank_argument_is_ignored():
    from trainer.cli import _strip_launcher_args

    assert _strip_launcher_args(["--local_rank=1", "--config", "f", "--local_rank", "0", "--x", "1"]) == ["--config", "f", "--x", "1"]


def test_file_batch_source_errors(tmp_path):
    from trainer.loop import FileBatchSource

    p = tmp_path / "b.jsonl"
    p.write_text('[{"group_id": "g"}]\n\n{"not": "a list"}\n')
    with pytest.raises(ValueError, match=r"b.jsonl:3: a batch must be a JSON list"):
        FileBatchSource(p)
    p.write_text("[1,\n")
    with pytest.raises(ValueError, match=r"b.jsonl:1: not JSON"):
        FileBatchSource(p)
    p.write_text('[{"group_id": "g", "prompt_ids": [1], "samples": []}]\n')
    src = FileBatchSource(p)
    assert src.next_batch(1)[0]["group_id"] == "g" and src.next_batch(2) is None
    assert src.state_dict() == {"cursor": 1}


def test_step_metrics_combine_minibatches():
    from trainer.loop import _combine

    out = _combine([{"loss": 1.0, "loss_tokens": 3.0, "importance_weight_max": 2.0, "grad_norm": 5.0, "lr": 0.1},
                    {"loss": 3.0, "loss_tokens": 4.0, "importance_weight_max": 1.5, "grad_norm": 1.0, "lr": 0.2}])
    assert out == {"loss": 2.0, "loss_tokens": 7.0, "importance_weight_max": 2.0, "grad_norm": 1.0, "lr": 0.2,
                   "grad_norm_max": 5.0, "minibatches": 2.0}
    assert _combine([]) == {}
