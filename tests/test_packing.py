"""Packing: next-fit by token count, rank dealing, and packed logprobs == unpacked (tiny model)."""

from __future__ import annotations

import pytest
import torch

from trainer.losses import token_logprobs_and_entropy
from trainer.packing import build_micro_batch, deal_to_ranks, pack_by_tokens, packing_efficiency, split_minibatches


def test_pack_by_tokens_order_preserving_next_fit():
    assert pack_by_tokens([3, 4, 2, 9, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert pack_by_tokens([10], 4) == [[0]]  # longer than the budget: alone
    with pytest.raises(ValueError, match="positive"):
        pack_by_tokens([1], 0)
    with pytest.raises(ValueError, match="at least one"):
        pack_by_tokens([1, 0], 8)


def test_deal_to_ranks_pads_with_empty_micro_batches():
    assert deal_to_ranks([[0], [1], [2]], 2) == [[[0], [2]], [[1], None]]
    assert deal_to_ranks([[0, 1]], 1) == [[[0, 1]]]


def test_split_minibatches():
    assert [list(r) for r in split_minibatches(5, 2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="ppo_n_minibatches"):
        split_minibatches(1, 2)


def test_packing_efficiency_vs_padding():
    eff = packing_efficiency([2, 6, 4], [[0, 1], [2]])
    assert eff["packed"] == 1.0
    assert eff["padded"] == pytest.approx(12 / 18)


def test_build_micro_batch_layout():
    mb = build_micro_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], [0, 1])
    assert mb.input_ids.tolist() == [[1, 2, 3, 5, 4, 7, 8]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert mb.logits_mask.tolist() == [[False, False, True, True, True, True, True]]
    assert mb.targets.tolist() == [5, 6, 7, 8, 9]
    assert mb.token_offsets == [(0, 0, 2), (1, 2, 5)]
    empty = build_micro_batch([[1]], [[2]], None)
    assert empty.targets.numel() == 0 and not empty.logits_mask.any()
    with pytest.raises(ValueError, match="empty prompt"):
        build_micro_batch([[]], [[1]], [0])


def test_packed_logprobs_equal_unpacked(tiny_model_dir):
    from asyncrl.models import load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dir, "float32")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 1, 9, 3)]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 7, 1, 6)]
    mb = build_micro_batch(prompts, responses, [0, 1, 2, 3])
    with torch.no_grad():
        out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, logits_to_keep=mb.logits_mask)
        packed, _ = token_logprobs_and_entropy(out.logits.reshape(-1, vocab), mb.targets, temperature=0.7)
        ref = []
        for p, r in zip(prompts, responses):
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:len(p) + len(r) - 1]
            ref.append(torch.log_softmax(logits.double() / 0.7, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    assert packed.dtype == torch.float32
    assert torch.allclose(packed.double(), torch.cat(ref), atol=1e-5, rtol=0)
    # and attention really is per sample: a different neighbour does not change sample 0's logprobs
    mb2 = build_micro_batch([prompts[0], [9, 9, 9]], [responses[0], [9, 9]], [0, 1])
    with torch.no_grad():
        out2 = model(input_ids=mb2.input_ids, position_ids=mb2.position_ids, use_cache=False, logits_to_keep=mb2.logits_mask)
        lp2, _ = token_logprobs_and_entropy(out2.logits.reshape(-1, vocab), mb2.targets, temperature=0.7)
    assert torch.allclose(lp2[:4], packed[:4], atol=1e-6)


def test_packed_logits_keeps_positions_as_a_1d_index(tiny_model_dir):
    """packed_logits asks the model for the kept positions as a 1-D index tensor (what every
    transformers release slices alike; transformers 5.17 refused the (1, L) boolean mask), and gets
    the same logits as the full forward pass at those positions, in order."""
    from asyncrl.models import load_causal_lm
    from trainer.packing import packed_logits

    model = load_causal_lm(tiny_model_dir, "float32")
    mb = build_micro_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], [0, 1])
    seen = {}

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = model

        def forward(self, **kw):
            seen["keep"] = kw["logits_to_keep"]
            return model(**kw)

    with torch.no_grad():
        got = packed_logits(Spy(), mb)
        full = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits[0]
    keep = seen["keep"]
    assert keep.dtype == torch.long and keep.ndim == 1
    assert keep.tolist() == mb.logits_mask[0].nonzero().flatten().tolist()
    assert torch.allclose(got, full[mb.logits_mask[0]], atol=1e-5)
