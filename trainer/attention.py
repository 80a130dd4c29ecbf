"""Attention at the samples' cost: one attention call per block of a packed row.

A packed micro-batch (trainer/packing.py) is one row of L tokens made of blocks — a sample's
``prompt + response[:-1]``, or a shared-prompt block ``prompt + r_1[:-1] + r_2[:-1] + ...``.
Tokens never attend across blocks, yet attention over the whole row with a block-diagonal mask
(what transformers' ``sdpa`` and ``eager`` paths do for packed rows) computes and, for the
backward pass, stores L × L scores per head and layer. The block attention computes each block
alone: Σ ℓ_b² scores instead of L², with the linear layers still running on the packed row (no
padding). This is the varlen attention of FlashAttention-2's ``flash_attn_varlen_func`` (Dao
2023, arXiv 2307.08691), written as a loop of ``torch.nn.functional.scaled_dot_product_attention``
calls so that it runs on CPU as on GPU.

It is registered with transformers' attention interface under :data:`BLOCK_ATTENTION`; the
trainer switches its policy and reference models to it (``trainer.attention: blocks``, the
default) and :func:`trainer.packing.packed_logits` passes the row's ``block_spans`` and
``block_masks`` as keyword arguments, which transformers forwards to every attention layer.
Called without ``block_spans`` (any other use of the model) it is transformers' own SDPA
attention, unchanged. Per block: a plain sample is causal (``is_causal``, no mask built); a
shared-prompt block uses its (ℓ, ℓ) Prefix Grouper mask (docs/trainer.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The attention implementation name the trainer sets on its models.
BLOCK_ATTENTION = "asyncrl_blocks"

#: Implementations a model may be loaded with for the trainer to switch it to block attention.
BLOCK_ATTENTION_BASES = ("sdpa", "eager", BLOCK_ATTENTION)


def check_block_spans(block_spans: Sequence[tuple[int, int]], length: int) -> None:
    """Check that ``block_spans`` tile ``[0, length)`` in order with non-empty blocks.

    Raises:
        ValueError: a gap, an overlap, an empty block or a span past ``length``.
    """
    at = 0
    for start, end in block_spans:
        if start != at or end <= start:
            raise ValueError(f"block_spans must tile the row in order with non-empty blocks: got ({start}, {end}) at {at}")
        at = end
    if at != length:
        raise ValueError(f"block_spans cover {at} tokens of a {length}-token row")


def block_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    block_spans: Sequence[tuple[int, int]] | None = None,
    block_masks: Sequence[torch.Tensor | None] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention computed block by block over a packed row (transformers attention-interface signature).

    Args:
        module: the attention layer (``num_key_value_groups`` for grouped-query attention).
        query: (1, H, L, D); key, value: (1, H_kv, L, D).
        attention_mask: ignored when ``block_spans`` is given (the blocks define the mask).
        dropout, scaling: as transformers' SDPA attention.
        block_spans: ``(start, end)`` rows of each block, tiling ``[0, L)``; None: transformers'
            SDPA attention over the whole input with ``attention_mask``.
        block_masks: per block, None (causal) or an (ℓ, ℓ) bool mask, True = may attend.

    Returns:
        ((1, L, H, D) attention output, None), as transformers' ``sdpa_attention_forward``.

    Raises:
        ValueError: batch size other than 1, spans that do not tile the row, or a mask of the
            wrong shape.
    """
    if block_spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"block attention takes one packed row, got a batch of {query.shape[0]}")
    check_block_spans(block_spans, query.shape[2])
    masks = list(block_masks) if block_masks is not None else [None] * len(block_spans)
    if len(masks) != len(block_spans):
        raise ValueError(f"{len(masks)} block masks for {len(block_spans)} blocks")
    kwargs.pop("is_causal", None)
    outs = []
    for (start, end), mask in zip(block_spans, masks):
        if mask is not None and tuple(mask.shape) != (end - start, end - start):
            raise ValueError(f"block ({start}, {end}) has a mask of shape {tuple(mask.shape)}")
        out, _ = sdpa_attention_forward(
            module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            None if mask is None else mask[None, None], dropout=dropout, scaling=scaling,
            is_causal=mask is None, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


AttentionInterface.register(BLOCK_ATTENTION, block_attention_forward)
# transformers builds the layer masks before attention; ours ignores them when blocks are given,
# and otherwise needs exactly SDPA's
AttentionMaskInterface.register(BLOCK_ATTENTION, sdpa_mask)
