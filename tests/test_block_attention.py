"""Block (varlen) attention over packed rows (trainer/attention.py): equal to attention over the
whole row — logprobs and every parameter gradient — for plain and shared-prompt blocks, on the
tiny model loaded with sdpa and with eager attention, through the Trainer (estimators,
corrections, one-sample micro-batches, ZeRO 3); unchanged SDPA without blocks; bad blocks raise."""

from __future__ import annotations

import copy

import pytest
import torch

from test_shared_prompts import _assert_same_steps, _groups, _one_step, _rel
from trainer.attention import BLOCK_ATTENTION, block_attention_forward, check_block_spans
from trainer.losses import token_logprobs_and_entropy
from trainer.packing import build_micro_batch, packed_logits


def test_spans_and_masks_of_a_micro_batch():
    prompts = [[1, 2, 3], [1, 2, 3], [4], [5, 6]]
    responses = [[5, 6], [7, 8, 9], [10, 11], [12]]
    mb = build_micro_batch(prompts, responses, [0, 1, 2, 3], share_prompts=True)
    # block 0: prompt + 1 + 2 tokens (shared, masked); block 1: [4, 10] causal; block 2: [5, 6] causal
    assert mb.block_spans == [(0, 6), (6, 8), (8, 10)]
    assert mb.block_masks[1] is None and mb.block_masks[2] is None
    assert torch.equal(mb.block_masks[0], mb.block_mask[0:6, 0:6])
    plain = build_micro_batch(prompts, responses, [0, 1, 2, 3], share_prompts=False)
    assert plain.block_spans == [(0, 4), (4, 9), (9, 11), (11, 13)] and plain.block_masks == [None] * 4
    empty = build_micro_batch(prompts, responses, None)
    assert empty.block_spans == [(0, 1)]


@pytest.mark.parametrize("spans,length,msg", [
    ([(0, 3), (4, 6)], 6, "tile the row"),  # a gap
    ([(0, 3), (2, 6)], 6, "tile the row"),  # an overlap
    ([(0, 3), (3, 3), (3, 6)], 6, "non-empty"),
    ([(0, 3)], 6, "cover 3 tokens of a 6-token row"),
])
def test_bad_spans_raise(spans, length, msg):
    with pytest.raises(ValueError, match=msg):
        check_block_spans(spans, length)


def _model(model_dir, attn):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)


def _run(model, mb, weights):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = token_logprobs_and_entropy(packed_logits(model, mb), mb.targets, 0.7, True)
    ((logprobs + 0.1 * entropy) * weights).sum().backward()
    return logprobs.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("share", [False, True])
def test_blocks_equal_row_logprobs_and_gradients(tiny_model_dir, attn, share):
    row = _model(tiny_model_dir, attn)
    blocks = _model(tiny_model_dir, attn)
    blocks.set_attn_implementation(BLOCK_ATTENTION)
    prompts, responses = _groups(row.config.vocab_size)
    mb = build_micro_batch(prompts, responses, list(range(len(prompts))), share_prompts=share)
    assert len(mb.block_spans) == (3 if share else len(prompts))
    weights = torch.randn(mb.targets.numel(), generator=torch.Generator().manual_seed(3))
    lp_r, g_r = _run(row, mb, weights)
    lp_b, g_b = _run(blocks, mb, weights)
    assert torch.allclose(lp_b, lp_r, rtol=1e-5, atol=1e-6), (lp_b - lp_r).abs().max()
    for name in g_r:
        assert _rel(g_b[name], g_r[name]) <= 1e-5, name
    # the check has teeth: one block spanning two samples lets the second attend to the first
    leaky = copy.copy(mb)
    leaky.block_spans = [(0, mb.block_spans[1][1]), *mb.block_spans[2:]]
    leaky.block_masks = [None, *mb.block_masks[2:]]
    with torch.no_grad():
        bad = token_logprobs_and_entropy(packed_logits(blocks, leaky), mb.targets, 0.7)[0]
    assert not torch.allclose(bad, lp_r, atol=1e-4)


def test_without_blocks_it_is_sdpa(tiny_model_dir):
    """Other uses of the model (a padded batch, no spans) get transformers' SDPA attention unchanged."""
    ref = _model(tiny_model_dir, "sdpa")
    model = _model(tiny_model_dir, "sdpa")
    model.set_attn_implementation(BLOCK_ATTENTION)
    ids = torch.randint(3, ref.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        a = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
        b = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(a, b)


def test_bad_inputs_raise(tiny_model_dir):
    model = _model(tiny_model_dir, "sdpa")
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 6, 8)
    kv = torch.zeros(1, 2, 6, 8)
    with pytest.raises(ValueError, match="one packed row"):
        block_attention_forward(attn, q.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1),
                                None, block_spans=[(0, 6)])
    with pytest.raises(ValueError, match="2 block masks for 1 blocks"):
        block_attention_forward(attn, q, kv, kv, None, block_spans=[(0, 6)], block_masks=[None, None])
    with pytest.raises(ValueError, match="mask of shape"):
        block_attention_forward(attn, q, kv, kv, None, block_spans=[(0, 6)], block_masks=[torch.ones(5, 5, dtype=torch.bool)])


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from asyncrl.models import load_causal_lm

    return load_causal_lm(tiny_model_dir, "float32")


def _steps(tmp_path, tiny_model, tiny_model_dir, attention, share, **kw):
    return _one_step(tmp_path / attention, tiny_model, tiny_model_dir, share, attention=attention, **kw)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("kw", [
    {"advantage": "grpo", "ppo_n_minibatches": 2, "loss": {"correction": "decoupled"}},
    {"advantage": "dr_grpo", "micro_batch_tokens": 24, "loss": {"correction": "tis", "kl_coef": 0.05}},
    {"advantage": "grpo", "zero_stage": 3, "loss": {"correction": "decoupled", "kl_coef": 0.05}},
], ids=["decoupled-2mb", "tis-ref-24tok", "zero3-ref"])
def test_trainer_step_equal_with_blocks_and_row(tmp_path, tiny_model_dir, tiny_model, share, kw):
    from trainer.trainer import Trainer  # noqa: F401  (the Trainer switches its models to block attention)

    row = _steps(tmp_path, tiny_model, tiny_model_dir, "row", share, **copy.deepcopy(kw))
    blocks = _steps(tmp_path, tiny_model, tiny_model_dir, "blocks", share, **copy.deepcopy(kw))
    _assert_same_steps(row, blocks, same_tokens=True)


def test_trainer_uses_blocks_by_default_and_falls_back(tmp_path, tiny_model_dir, caplog):
    from test_shared_prompts import _cfg

    from trainer.trainer import Trainer

    tr = Trainer(_cfg(tmp_path / "a", tiny_model_dir, True), model=_model(tiny_model_dir, "sdpa"))
    try:
        assert tr.attention == "blocks" and tr.module.config._attn_implementation == BLOCK_ATTENTION
    finally:
        tr.close()
    model = _model(tiny_model_dir, "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    tr = Trainer(_cfg(tmp_path / "b", tiny_model_dir, True), model=model)
    try:
        assert tr.attention == "row" and "attention runs over the packed row" in caplog.text
    finally:
        tr.close()
