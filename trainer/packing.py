"""Packing variable-length samples into micro-batches by token count, without padding.

A micro-batch is one row of concatenated *blocks*. Without prompt sharing a block is one
sample's ``prompt + response[:-1]`` with ``position_ids`` restarting at 0; transformers
(>= 4.56 masking utils) detects the restarts when no attention mask is passed and
``use_cache=False`` and builds a block-diagonal causal mask (``find_packed_sequence_indices``),
so attention stays inside each sample.

Shared-prompt passes (``share_prompts=True``, the trainer's default). The samples of a prompt
group carry the same prompt; processing it once per group instead of once per sample removes
most of the trainer's work when responses are short (the main job: 42 prompt tokens, 4-9
response tokens, 8 samples per group). Consecutive samples of a micro-batch with identical
prompt ids form one block::

    prompt (P tokens, positions 0..P-1) | r_1[:-1] (positions P..) | r_2[:-1] (positions P..) | ...

with an explicit 4-D attention mask: a prompt token attends causally to the prompt; a token of
response j attends to the whole prompt and causally to response j's earlier tokens, never to
another response. Each response therefore sees exactly the keys and values it would see alone,
at the same positions (RoPE depends on position ids only), so logprobs and every parameter
gradient equal the unshared computation up to floating-point summation order (the prompt's
activations receive the sum of its samples' gradients). The logit at the prompt's last
position predicts every sample's first response token: it is computed once and gathered per
sample (``logits_index``). This is the "Prefix Grouper" layout of Liu et al., *Prefix Grouper:
Efficient GRPO Training through Shared-Prefix Forward* (arXiv 2506.05433); the same idea is
the shared-prefix KV cache of inference engines (SGLang's RadixAttention).

Logits are computed only at the positions that predict response tokens (``logits_to_keep`` as
a 1-D tensor of positions; a shared position once), and logprobs are taken in fp32.

Packing is order-preserving greedy (next-fit): samples are taken in batch order and a new
micro-batch starts when the next sample would exceed ``micro_batch_tokens``; with sharing, a
sample that follows a sample of the same prompt in its micro-batch costs only its response
tokens. It never pads, so processed tokens equal the row's tokens; a sample longer than the
budget gets a micro-batch of its own. Order preservation makes the micro-batch sequence a pure
function of the batch (the synchronous-equivalence test replays it). Micro-batches are dealt
round-robin to ranks; a rank with fewer gets empty micro-batches (a 1-token dummy with weight 0)
so every rank runs the same number of forward/backward passes, which ZeRO's collectives need.

Simplified: with SDPA on CPU a block-diagonal mask (implicit or explicit) still costs full
L x L attention FLOPs per micro-batch of L tokens (a varlen flash kernel would not); sharing
shrinks L, and with it that cost, quadratically. The explicit mask needs the ``sdpa`` or
``eager`` attention implementation (:func:`attention_mask_for`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.attention import BLOCK_ATTENTION

__all__ = [
    "pack_by_tokens", "deal_to_ranks", "PackedMicroBatch", "build_micro_batch", "packing_efficiency",
    "split_minibatches", "shared_prefix_tokens", "attention_mask_for", "packed_logits", "packed_values",
    "SHARED_MASK_IMPLEMENTATIONS",
]


def pack_by_tokens(lengths: Sequence[int], micro_batch_tokens: int,
                   shared: Sequence[int] | None = None) -> list[list[int]]:
    """Order-preserving next-fit packing of sample lengths into micro-batches.

    Args:
        lengths: (N,) tokens of each sample (as fed to the model).
        micro_batch_tokens: token budget of one micro-batch (``trainer.micro_batch_tokens``).
        shared: (N,) tokens sample i does not add when it joins a micro-batch right after sample
            i-1 (its prompt length when both carry the same prompt and prompts are shared:
            :func:`shared_prefix_tokens`); None: nothing is shared.

    Returns:
        lists of sample indices; concatenated they are ``0..N-1`` in order.

    Raises:
        ValueError: a non-positive budget or length.
    """
    if micro_batch_tokens <= 0:
        raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
    if shared is not None and len(shared) != len(lengths):
        raise ValueError(f"shared has {len(shared)} entries for {len(lengths)} samples")
    bins: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"sample {i} has {n} tokens; every sample needs at least one")
        joined = n - (shared[i] if shared is not None and i > 0 else 0)
        if bins and used + joined <= micro_batch_tokens:
            bins[-1].append(i)
            used += joined
        else:
            bins.append([i])
            used = n
    return bins


def split_minibatches(n_samples: int, n_minibatches: int) -> list[range]:
    """Split samples ``0..n-1`` into ``n_minibatches`` contiguous, near-equal ranges (PPO mini-batches).

    Raises:
        ValueError: fewer samples than mini-batches.
    """
    if n_samples < n_minibatches:
        raise ValueError(f"{n_samples} samples cannot form trainer.ppo_n_minibatches={n_minibatches} mini-batches")
    base, extra = divmod(n_samples, n_minibatches)
    out, start = [], 0
    for k in range(n_minibatches):
        size = base + (1 if k < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def deal_to_ranks(micro_batches: list[list[int]], world_size: int) -> list[list[list[int] | None]]:
    """Deal micro-batches round-robin to ranks, padding with None (empty) to equal counts.

    Returns:
        per rank, its micro-batches (None marks an empty one that does a weight-0 pass).
    """
    per_rank: list[list[list[int] | None]] = [micro_batches[r::world_size] for r in range(world_size)]
    longest = max(len(x) for x in per_rank) if per_rank else 0
    return [x + [None] * (longest - len(x)) for x in per_rank]


#: Attention implementations that accept the explicit 4-D mask of shared-prompt blocks.
SHARED_MASK_IMPLEMENTATIONS = ("sdpa", "eager", BLOCK_ATTENTION)


@dataclass
class PackedMicroBatch:
    """Model inputs of one packed micro-batch.

    Attributes:
        input_ids: (1, L) the row: per block ``prompt + response[:-1]`` (or, shared,
            ``prompt + r_1[:-1] + r_2[:-1] + ...``).
        position_ids: (1, L) positions: 0.. within each block's prompt; a shared block's
            responses each continue from the prompt's length.
        logits_mask: (1, L) bool, True at the K positions whose logits are needed (K <= T).
        targets: (T,) the response tokens those positions predict, sample by sample.
        sample_index: (T,) index (into the batch's samples) of each target token's sample.
        token_offsets: per sample in this micro-batch, ``(batch index, start, end)`` into the T axis.
        logits_index: (T,) row of the K kept logits that predicts each target (a shared prompt's
            last position serves every sample of its block); None when K == T in order.
        block_mask: (L, L) bool, True where query row i may attend to key column j; None when no
            block is shared (transformers then derives the block-diagonal causal mask from the
            position restarts). Built on first access from ``block_spans``/``block_masks``:
            block attention never needs it, and at L tokens it costs L² bytes.
        shared_samples: samples in this micro-batch whose prompt was not processed again.
        block_spans: ``(start, end)`` rows of each block, tiling ``[0, L)`` (block attention,
            trainer/attention.py).
        block_masks: per block, None (plain causal: a sample, or a prompt with one response) or
            its (ℓ, ℓ) bool shared-prompt mask, True = may attend (the diagonal blocks of
            ``block_mask``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits_mask: torch.Tensor
    targets: torch.Tensor
    sample_index: torch.Tensor
    token_offsets: list[tuple[int, int, int]]
    logits_index: torch.Tensor | None = None
    shared_samples: int = 0
    block_spans: list[tuple[int, int]] = field(default_factory=list)
    block_masks: list[torch.Tensor | None] = field(default_factory=list)
    _block_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        """L, the row's length in tokens."""
        return int(self.input_ids.shape[1])

    @property
    def block_mask(self) -> torch.Tensor | None:
        """The (L, L) mask of the whole row (see the class docstring); None when nothing is shared."""
        if self._block_mask is None and self.shared_samples:
            length = self.num_tokens
            mask = torch.zeros((length, length), dtype=torch.bool)
            for (start, end), block in zip(self.block_spans, self.block_masks):
                n = end - start
                mask[start:end, start:end] = torch.ones((n, n), dtype=torch.bool).tril_() if block is None else block
            self._block_mask = mask
        return self._block_mask

    @block_mask.setter
    def block_mask(self, value: torch.Tensor | None) -> None:
        self._block_mask = value


def shared_prefix_tokens(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Per sample, the prompt tokens a shared-prompt block saves when it follows the previous sample.

    Args:
        prompts: the samples' prompt ids, in batch order.

    Returns:
        (N,) ``len(prompts[i])`` when ``prompts[i] == prompts[i-1]`` (i > 0), else 0.
    """
    out = [0] * len(prompts)
    for i in range(1, len(prompts)):
        if len(prompts[i]) == len(prompts[i - 1]) and list(prompts[i]) == list(prompts[i - 1]):
            out[i] = len(prompts[i])
    return out


def build_micro_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], indices: Sequence[int] | None,
    share_prompts: bool = False,
) -> PackedMicroBatch:
    """Pack the given samples (``indices`` into ``prompts``/``responses``) into one row.

    ``indices=None`` builds the empty micro-batch: one token (id 0), no target. With
    ``share_prompts``, consecutive samples (in ``indices`` order) with identical prompt ids form
    one block whose prompt is processed once (see the module docstring for the layout and mask).

    Raises:
        ValueError: an empty prompt.
    """
    if indices is None:
        z = torch.zeros((1, 1), dtype=torch.long)
        return PackedMicroBatch(z, z.clone(), torch.zeros((1, 1), dtype=torch.bool),
                                torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [],
                                block_spans=[(0, 1)], block_masks=[None])
    ids: list[int] = []
    pos: list[int] = []
    keep_rows: list[int] = []  # row of each target's predicting logit
    targets: list[int] = []
    owner: list[int] = []
    offsets = []
    blocks: list[tuple[int, list[int]]] = []  # (row where the block starts, branch of each of its tokens)
    shared_samples = 0
    prev_prompt: list[int] | None = None
    for i in indices:
        p, r = list(prompts[i]), list(responses[i])
        if not p:
            raise ValueError(f"sample {i}: empty prompt")
        if share_prompts and prev_prompt is not None and p == prev_prompt:
            start_row, branch = blocks[-1]
            prompt_last = start_row + len(p) - 1
            member = max(branch) + 1
            shared_samples += 1
        else:
            start_row = len(ids)
            ids += p
            pos += range(len(p))
            branch = [0] * len(p)
            blocks.append((start_row, branch))
            prompt_last = start_row + len(p) - 1
            member = 1
        prev_prompt = p
        first = len(ids)
        tail = r[:-1]
        ids += tail
        pos += range(len(p), len(p) + len(tail))
        branch += [member] * len(tail)
        keep_rows += ([prompt_last] + list(range(first, first + len(tail)))) if r else []
        start = len(targets)
        targets += r
        owner += [i] * len(r)
        offsets.append((i, start, len(targets)))
    length = len(ids)
    keep = torch.zeros((1, length), dtype=torch.bool)
    rows = torch.tensor(keep_rows, dtype=torch.long)
    if rows.numel():
        keep[0, rows] = True
    logits_index = None
    spans = [(start_row, start_row + len(branch)) for start_row, branch in blocks]
    masks: list[torch.Tensor | None] = []
    for start_row, branch in blocks:
        if max(branch) <= 1:  # a prompt with at most one response: plain causal
            masks.append(None)
            continue
        b = torch.tensor(branch)
        n = b.numel()
        causal = torch.ones((n, n), dtype=torch.bool).tril_()
        masks.append(causal & ((b[None, :] == 0) | (b[None, :] == b[:, None])))
    if shared_samples:
        # rank of each kept row among the kept rows = index into the (K, V) logits
        rank = torch.cumsum(keep[0].long(), 0) - 1
        logits_index = rank[rows]
    return PackedMicroBatch(
        torch.tensor([ids], dtype=torch.long),
        torch.tensor([pos], dtype=torch.long),
        keep,
        torch.tensor(targets, dtype=torch.long),
        torch.tensor(owner, dtype=torch.long),
        offsets,
        logits_index,
        shared_samples,
        spans,
        masks,
    )


def attention_mask_for(block_mask: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The (1, 1, L, L) attention mask transformers passes through as-is for ``attn_implementation``.

    Args:
        block_mask: (L, L) bool, True = may attend.
        attn_implementation: the model's ``config._attn_implementation``.
        dtype: the model's compute dtype (the additive mask of ``eager`` is in it).

    Returns:
        ``sdpa``: the bool mask; ``eager``: an additive mask (0 where allowed, the dtype's minimum
        elsewhere, as transformers' own eager masks).

    Raises:
        ValueError: another implementation (flash attention takes no arbitrary mask); set
            ``trainer.share_prompts: false`` or load the model with ``sdpa``.
    """
    if attn_implementation == "sdpa":
        return block_mask[None, None]
    if attn_implementation == "eager":
        out = torch.zeros(block_mask.shape, dtype=dtype)
        out.masked_fill_(~block_mask, torch.finfo(dtype).min)
        return out[None, None]
    raise ValueError(
        f"shared-prompt passes need attention implementation 'sdpa' or 'eager', not {attn_implementation!r}: "
        "set trainer.share_prompts: false, or load the model with attn_implementation='sdpa'"
    )


def packed_logits(module: Any, packed: PackedMicroBatch) -> torch.Tensor:
    """Run ``module`` on a packed micro-batch and return the logits of its targets.

    Args:
        module: a transformers causal LM (or a DeepSpeed engine wrapping one).
        packed: from :func:`build_micro_batch`.

    Returns:
        (T, V) logits (model dtype), row t predicting ``packed.targets[t]``.

    With the block attention implementation (trainer/attention.py) the row's blocks are
    attended one by one (Σ ℓ² scores); otherwise attention runs over the whole row (L²) with the
    implicit block-diagonal mask, or the explicit shared-prompt mask.

    Raises:
        ValueError: a shared block with an attention implementation that takes no 4-D mask.
    """
    # the kept positions as a 1-D index tensor, which every transformers release with tensor
    # logits_to_keep slices alike: the (1, L) boolean mask is only understood by recent ones
    # (transformers 5.17 on the H100 of docs/bench/gpu raised "too many indices" on it)
    keep = packed.logits_mask.reshape(-1).nonzero().squeeze(1)
    out = module(**_model_inputs(module, packed), logits_to_keep=keep)
    logits = out.logits.reshape(-1, out.logits.shape[-1])
    if packed.logits_index is not None:
        logits = logits.index_select(0, packed.logits_index)
    return logits


def _model_inputs(module: Any, packed: PackedMicroBatch) -> dict[str, Any]:
    """The forward kwargs of a packed row for ``module``'s attention implementation."""
    kwargs: dict[str, Any] = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "use_cache": False}
    inner = getattr(module, "module", module)
    impl = getattr(inner.config, "_attn_implementation", None) or "eager"
    if impl == BLOCK_ATTENTION:
        kwargs["block_spans"] = packed.block_spans
        kwargs["block_masks"] = packed.block_masks
    elif packed.block_mask is not None:
        kwargs["attention_mask"] = attention_mask_for(packed.block_mask, impl, next(inner.parameters()).dtype)
    return kwargs


def packed_values(module: Any, packed: PackedMicroBatch) -> torch.Tensor:
    """Run a value model (one score per position) on a packed micro-batch: the value of each target's state.

    Args:
        module: a transformers token-classification model with one label (the critic,
            trainer/critic.py), or a DeepSpeed engine wrapping one.
        packed: from :func:`build_micro_batch` — the same layout, masks and shared prompts as
            the policy's pass.

    Returns:
        (T,) values, row t = V(s_t), the state before ``packed.targets[t]`` (the position whose
        logits predict that token), model dtype.
    """
    out = module(**_model_inputs(module, packed))
    scores = out.logits.reshape(-1)
    kept = scores[packed.logits_mask.reshape(-1)]
    if packed.logits_index is not None:
        kept = kept.index_select(0, packed.logits_index)
    return kept


def packing_efficiency(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]]) -> dict[str, float]:
    """Real tokens / processed tokens for packed micro-batches and for padding to the longest.

    Returns:
        ``packed`` (1.0: packing never pads) and ``padded`` (``sum(len) / (N * max(len))`` with
        the same number of samples per micro-batch padded to the batch's longest sample).
    """
    real = float(sum(lengths))
    processed = float(sum(sum(lengths[i] for i in mb) for mb in micro_batches))
    longest = max(lengths) if lengths else 0
    return {"packed": real / processed if processed else 1.0,
            "padded": real / (len(lengths) * longest) if longest else 1.0}
