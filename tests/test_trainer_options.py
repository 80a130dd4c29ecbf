"""Engine options end to end on the tiny model: activation checkpointing (same loss and grad
norm as without), bf16 training (fp32 logprobs, fp32 published weights), KL to the frozen
reference and entropy bonus inside the Trainer, and the stale-without-correction config rule."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.core.config import ConfigError, load_config
from tests.test_trainer import make_cfg, make_groups, tiny_model  # noqa: F401 (fixture)
from trainer.loop import ListBatchSource, train_loop


def _run(cfg, model, batches):
    from trainer.trainer import Trainer

    trainer = Trainer(cfg, model=copy.deepcopy(model))
    try:
        res = train_loop(trainer, ListBatchSource(batches), max_steps=len(batches))
        return trainer, res.history
    finally:
        trainer.close()


@pytest.mark.slow
def test_activation_checkpointing_kl_and_entropy(tmp_path, tiny_model_dir, tiny_model):
    vocab = tiny_model.config.vocab_size
    batches = [make_groups(2, vocab, seed=s) for s in range(2)]
    loss_cfg = {"kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": 0.01}
    _, plain = _run(make_cfg(tmp_path / "a", tiny_model_dir, loss=loss_cfg), tiny_model, batches)
    trainer, ckpt = _run(make_cfg(tmp_path / "b", tiny_model_dir, loss=loss_cfg, activation_checkpointing=True), tiny_model, batches)
    assert getattr(trainer.module, "is_activation_checkpointing", None) or trainer.module.is_gradient_checkpointing
    for a, b in zip(plain, ckpt):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert plain[0]["ref_kl"] == pytest.approx(0.0, abs=1e-7)  # same weights as the reference at step 1
    assert plain[1]["ref_kl"] > 0 and plain[1]["kl_loss"] > 0
    assert plain[0]["entropy"] > 0 and plain[0]["entropy_loss"] == pytest.approx(-0.01 * plain[0]["entropy"], rel=1e-4)


def test_bf16_training_publishes_engine_dtype(tmp_path, tiny_model_dir, tiny_model):
    cfg = make_cfg(tmp_path, tiny_model_dir, precision="bf16")
    trainer, hist = _run(cfg, tiny_model, [make_groups(2, tiny_model.config.vocab_size)])
    assert all(p.dtype == torch.bfloat16 for p in trainer.module.parameters())
    assert math.isfinite(hist[0]["loss"]) and math.isfinite(hist[0]["grad_norm"])
    weights = load_file(trainer.weights_dir / "v000001" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}  # model.dtype (the engine's), not bf16


def test_stale_samples_without_correction_are_rejected_at_start():
    with pytest.raises(ConfigError, match="correction"):
        load_config([], environ={}, overrides={"buffer": {"max_staleness": 1}, "trainer": {"loss": {"correction": "none"}}})
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config([], environ={}, overrides={"rollout": {"partial_percent": 0.5}})
