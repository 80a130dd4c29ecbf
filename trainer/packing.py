"""Packing variable-length samples into micro-batches by token count, without padding.

A micro-batch is one row: the samples' ``prompt + response[:-1]`` token sequences concatenated,
with ``position_ids`` restarting at 0 for each sample. transformers (>= 4.56 masking utils)
detects the restarts when no 2-D attention mask is passed and ``use_cache=False``, and builds a
block-diagonal causal mask (``find_packed_sequence_indices``), so attention stays inside each
sample; ``tests/test_packing.py`` checks packed logprobs equal per-sample unpacked ones.
Logits are computed only at the positions that predict response tokens (``logits_to_keep``
as a boolean row mask), and logprobs are taken in fp32.

Packing is order-preserving greedy (next-fit): samples are taken in batch order and a new
micro-batch starts when the next sample would exceed ``micro_batch_tokens``. It never pads, so
processed tokens equal real tokens; a sample longer than the budget gets a micro-batch of its
own. Order preservation makes the micro-batch sequence a pure function of the batch (the
synchronous-equivalence test replays it). Micro-batches are dealt round-robin to ranks; a rank
with fewer gets empty micro-batches (a 1-token dummy with weight 0) so every rank runs the same
number of forward/backward passes, which ZeRO's collectives need.

Simplified: with SDPA on CPU the block-diagonal mask still costs full T x T attention FLOPs per
micro-batch (a varlen flash kernel would not); token counts are unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["pack_by_tokens", "deal_to_ranks", "PackedMicroBatch", "build_micro_batch", "packing_efficiency", "split_minibatches"]


def pack_by_tokens(lengths: Sequence[int], micro_batch_tokens: int) -> list[list[int]]:
    """Order-preserving next-fit packing of sample lengths into micro-batches.

    Args:
        lengths: (N,) tokens of each sample (as fed to the model).
        micro_batch_tokens: token budget of one micro-batch (``trainer.micro_batch_tokens``).

    Returns:
        lists of sample indices; concatenated they are ``0..N-1`` in order.

    Raises:
        ValueError: a non-positive budget or length.
    """
    if micro_batch_tokens <= 0:
        raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
    bins: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"sample {i} has {n} tokens; every sample needs at least one")
        if bins and used + n <= micro_batch_tokens:
            bins[-1].append(i)
            used += n
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


@dataclass
class PackedMicroBatch:
    """Model inputs of one packed micro-batch.

    Attributes:
        input_ids: (1, L) concatenated ``prompt + response[:-1]`` of its samples.
        position_ids: (1, L) positions restarting at 0 for each sample.
        logits_mask: (1, L) bool, True at positions that predict a response token.
        targets: (T,) the response tokens those positions predict, in order.
        sample_index: (T,) index (into the batch's samples) of each target token's sample.
        token_offsets: per sample in this micro-batch, ``(batch index, start, end)`` into the T axis.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits_mask: torch.Tensor
    targets: torch.Tensor
    sample_index: torch.Tensor
    token_offsets: list[tuple[int, int, int]]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def build_micro_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], indices: Sequence[int] | None
) -> PackedMicroBatch:
    """Pack the given samples (``indices`` into ``prompts``/``responses``) into one row.

    ``indices=None`` builds the empty micro-batch: one token (id 0), no target.

    Raises:
        ValueError: an empty prompt.
    """
    if indices is None:
        z = torch.zeros((1, 1), dtype=torch.long)
        return PackedMicroBatch(z, z.clone(), torch.zeros((1, 1), dtype=torch.bool),
                                torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [])
    ids: list[int] = []
    pos: list[int] = []
    keep: list[bool] = []
    targets: list[int] = []
    owner: list[int] = []
    offsets = []
    for i in indices:
        p, r = list(prompts[i]), list(responses[i])
        if not p:
            raise ValueError(f"sample {i}: empty prompt")
        seq = (p + r)[:-1] if r else p
        ids += seq
        pos += range(len(seq))
        keep += [False] * (len(p) - 1) + [True] * len(r) + ([False] if not r else [])
        start = len(targets)
        targets += r
        owner += [i] * len(r)
        offsets.append((i, start, len(targets)))
    return PackedMicroBatch(
        torch.tensor([ids], dtype=torch.long),
        torch.tensor([pos], dtype=torch.long),
        torch.tensor([keep], dtype=torch.bool),
        torch.tensor(targets, dtype=torch.long),
        torch.tensor(owner, dtype=torch.long),
        offsets,
    )


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
