"""SGLang-compatible sampling parameters and the batched sampler of the embedded engine.

:class:`SamplingParams` accepts exactly the keys of SGLang's ``SamplingParams``
(``python/sglang/srt/sampling/sampling_params.py``;
https://docs.sglang.io/basic_usage/sampling_params.html) so that slime's and
AReaL's payloads work unchanged; unknown keys and out-of-range values raise
:class:`RequestError` (HTTP 400, SGLang's ``{"error": {"message": ...}}`` shape).

:func:`sample_tokens` turns one fp32 logits row per sequence into the next token and its
**behaviour logprob** ``log_softmax((logits + adjustments) / T)[token]`` — the full
distribution before top-k/top-p/min-p truncation, which is exactly what the trainer recomputes
when RL runs with ``top_p = 1, top_k = -1`` (docs/architecture.md#vocabulary). Greedy (``temperature <
1e-6``, SGLang's rule) takes the argmax and reports ``log_softmax(logits)[token]`` (T
treated as 1, as SGLang does internally for greedy).

Simplifications: grammar-constrained decoding (``json_schema``, ``regex``, ``ebnf``,
``structural_tag``, ``stop_regex``) is not implemented and rejected with a 400 when set;
``custom_params`` is accepted and ignored. Penalties (frequency, presence, repetition),
``logit_bias`` and ``min_new_tokens`` are applied to the logits before temperature, so they
are part of the behaviour distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["RequestError", "NonFiniteLogits", "SamplingParams", "sample_tokens", "inverse_cdf_sample", "GREEDY_EPS"]

#: SGLang treats ``temperature < 1e-6`` as greedy.
GREEDY_EPS = 1e-6


class RequestError(ValueError):
    """A bad /generate (or other) request; the server answers HTTP 400 with this message."""


class NonFiniteLogits(ValueError):
    """Some rows' sampling distributions are not valid (NaN after penalties, bias and temperature).

    Attributes:
        rows: indices (into the ``logits`` given to :func:`sample_tokens`) of the bad rows.
    """

    def __init__(self, rows: list[int]):
        super().__init__(f"non-finite sampling distribution in row(s) {rows}")
        self.rows = rows


@dataclass
class SamplingParams:
    """One request's ``sampling_params`` (SGLang defaults; ``None`` values mean default)."""

    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    custom_params: dict | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    stop_regex: Any = None

    @property
    def greedy(self) -> bool:
        """True when ``temperature < 1e-6`` (argmax decoding)."""
        return self.temperature < GREEDY_EPS

    @property
    def needs_filter(self) -> bool:
        """True when top-k, top-p or min-p truncates the sampling distribution."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def needs_adjust(self) -> bool:
        """True when penalties or a logit bias change the logits."""
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    def bias_tensors(self):
        """``(token ids, values)`` of ``logit_bias`` as tensors (built once, then reused every step)."""
        import torch

        cached = self.__dict__.get("_bias_tensors")
        if cached is None:
            items = sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items())
            cached = (torch.tensor([k for k, _ in items], dtype=torch.long),
                      torch.tensor([v for _, v in items], dtype=torch.float32))
            self.__dict__["_bias_tensors"] = cached
        return cached


def _adjust_logits(logits_row, p: SamplingParams, output_ids: Sequence[int], prompt_ids: Sequence[int]):
    """Apply penalties and logit bias to one fp32 logits row in place (SGLang's penalizer semantics)."""
    import torch

    if p.logit_bias:
        ids, values = p.bias_tensors()
        logits_row.index_add_(0, ids.to(logits_row.device), values.to(logits_row.device, logits_row.dtype))
    if output_ids and (p.frequency_penalty or p.presence_penalty):
        ids = torch.tensor(output_ids, dtype=torch.long, device=logits_row.device)
        counts = torch.bincount(ids, minlength=logits_row.shape[0]).to(logits_row.dtype)
        logits_row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits_row.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits_row.device)
        vals = logits_row[seen]
        logits_row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)


def sample_tokens(logits, samples: Sequence[Any], stop_ids_for, generator=None):
    """Sample one next token per row and report its behaviour logprob.

    Args:
        logits: ``(R, V)`` fp32 tensor, one row per sequence (not modified).
        samples: R engine samples (``.params``, ``.output_ids``, ``.prompt_ids``,
            ``.generator`` for seeded rows, ``.top_logprobs_num``).
        stop_ids_for: ``sample -> set[int]`` of token ids that end the sample (masked while
            ``min_new_tokens`` is not reached).
        generator: ``torch.Generator`` for unseeded rows (on ``logits``' device, as seeded rows' are).

    Returns:
        ``(tokens, logprobs, tops)``: python lists of R ints, R floats, and R entries that are
        ``None`` or a list of ``(logprob, token_id)`` pairs (``top_logprobs_num`` best).

    Raises:
        NonFiniteLogits: rows whose distribution holds NaN (non-finite logits, or adjustments
            that overflowed fp32); nothing is sampled, ``logits`` is unchanged, so the caller
            can drop those rows and call again.
    """
    import torch

    R = logits.shape[0]
    dev = logits.device  # the engine's device: every tensor made here lives there too
    params = [s.params for s in samples]
    if any(p.needs_adjust or p.min_new_tokens for p in params):
        logits = logits.clone()  # adjustments stay local: a retry without bad rows starts clean
    for i, (s, p) in enumerate(zip(samples, params)):
        if p.needs_adjust:
            _adjust_logits(logits[i], p, s.output_ids, s.prompt_ids)
        if p.min_new_tokens and len(s.output_ids) < p.min_new_tokens:
            ids = list(stop_ids_for(s))
            if ids:
                logits[i, torch.tensor(ids, dtype=torch.long, device=dev)] = float("-inf")
    greedy = [p.greedy for p in params]
    temp_list = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
    # One pass each for the max, exp and sum (no (R, V) log-softmax and probability tensors):
    # e = exp(x - max) is the unnormalised distribution, lse = max + log(sum e) its normaliser, so
    # the behaviour logprob of a token is x[token] - lse, the same formula log_softmax evaluates.
    if all(t == 1.0 for t in temp_list):
        tdiv = None
        m = logits.amax(dim=-1, keepdim=True)
        e = (logits - m).exp_()
    else:
        tdiv = torch.tensor(temp_list, dtype=logits.dtype, device=dev)[:, None]
        e = logits / tdiv
        m = e.amax(dim=-1, keepdim=True)
        e.sub_(m).exp_()
    lse = m + e.sum(dim=-1, keepdim=True).log_()  # (R, 1)
    # +inf or NaN logits, or every token masked to -inf: the max or the sum is not finite
    bad = ~torch.isfinite(lse[:, 0])
    if bool(bad.any()):
        raise NonFiniteLogits([int(i) for i in torch.nonzero(bad).flatten()])
    if all(greedy):
        tokens = torch.argmax(logits, dim=-1)
    else:
        for i, p in enumerate(params):
            if p.needs_filter:
                e[i] = _filtered(e[i], p)
        seeded = [i for i, s in enumerate(samples) if getattr(s, "generator", None) is not None and not greedy[i]]
        seeded_set = set(seeded)
        plain = [i for i in range(R) if not greedy[i] and i not in seeded_set]
        # one uniform per row: the shared generator's for unseeded rows, each seeded row its own
        u = torch.zeros(R, 1, dtype=torch.float64, device=dev)  # greedy rows: overwritten below
        if plain:
            draws = torch.rand(len(plain), 1, generator=generator, dtype=torch.float64, device=dev)
            if len(plain) == R:
                u = draws
            else:
                u[torch.tensor(plain, device=dev)] = draws
        for i in seeded:
            u[i] = torch.rand(1, generator=samples[i].generator, dtype=torch.float64, device=dev)
        tokens = inverse_cdf_sample(e, u)
        if any(greedy):
            g_idx = torch.tensor([i for i in range(R) if greedy[i]], device=dev)
            tokens[g_idx] = torch.argmax(logits[g_idx], dim=-1)
    picked = logits.gather(1, tokens[:, None])
    if tdiv is not None:
        picked = picked / tdiv
    token_lp = (picked - lse).squeeze(1)
    tops: list[Any] = [None] * R
    want = [(i, s.top_logprobs_num) for i, s in enumerate(samples) if getattr(s, "top_logprobs_num", 0)]
    if want:
        kmax = max(k for _, k in want)
        rows = torch.tensor([i for i, _ in want], dtype=torch.long, device=dev)
        vals, ids = torch.topk(logits[rows], k=min(kmax, logits.shape[1]), dim=-1)
        if tdiv is not None:
            vals = vals / tdiv[rows]
        vals = vals - lse[rows]
        vals_l, ids_l = vals.tolist(), ids.tolist()
        for r, (i, k) in enumerate(want):
            tops[i] = list(zip(vals_l[r][:k], ids_l[r][:k]))
    return tokens.tolist(), token_lp.tolist(), tops


def inverse_cdf_sample(weights, u):
    """One token per row by inverse-CDF sampling: the first index whose cumulative weight exceeds
    ``u`` times the row's total.

    ``torch.multinomial`` does the same per row in a serial loop (about 36 ms for 28 rows of a
    49,152-token vocabulary on two CPU cores, against about 2 ms here: docs/rollout.md, "Rollout
    profile"). The cumulative sum is taken in float64, so the intervals of the tokens are exact to
    well below a float32 probability's precision; a zero-weight token (masked, or truncated by
    top-k/top-p/min-p) has an empty interval and is never drawn.

    Args:
        weights: ``(R, V)`` non-negative, each row with a positive sum (unnormalised probabilities).
        u: ``(R, 1)`` float64 uniforms in [0, 1).

    Returns:
        ``(R,)`` long token ids.
    """
    import torch

    cum = weights.to(torch.float64).cumsum_(dim=-1)
    tokens = torch.searchsorted(cum, u * cum[:, -1:], right=True).squeeze(1)
    over = tokens >= weights.shape[1]  # u x total rounded up to the total: the last token with weight
    if bool(over.any()):
        rows = torch.nonzero(over).flatten()
        last = weights.shape[1] - 1 - torch.argmax(torch.flip(weights[rows] > 0, dims=[1]).to(torch.uint8), dim=1)
        tokens[rows] = last
    return tokens


def _filtered(probs_row, p: SamplingParams):
    """Top-k, then top-p (nucleus), then min-p truncation of one row of (possibly unnormalised)
    probabilities; each rule is invariant to the row's scale, and the result is not renormalised."""
    import torch

    row = probs_row.clone()
    if p.top_k > 0 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row[row < kth] = 0.0
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(row, descending=True)
        cum = torch.cumsum(sorted_p, 0)
        drop = (cum - sorted_p) > p.top_p * cum[-1]
        sorted_p[drop] = 0.0
        row = torch.zeros_like(row).scatter_(0, order, sorted_p)
    if p.min_p > 0.0:
        row[row < p.min_p * row.max()] = 0.0
    return row
