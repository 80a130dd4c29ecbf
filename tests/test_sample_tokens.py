"""The embedded engine's batched sampler (:func:`rollout_server.sampling.sample_tokens`) against the
textbook computation: ``log_softmax((logits + adjustments) / T)`` for the behaviour logprobs and
top logprobs, ``softmax`` for the sampling distribution, argmax for greedy rows, the truncation
rules on the unnormalised distribution, and the rows whose distribution is not valid."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from rollout_server.sampling import NonFiniteLogits, SamplingParams, sample_tokens


@dataclass
class Row:
    """What sample_tokens reads of an engine sample."""

    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=lambda: [1, 2])
    generator: Any = None
    top_logprobs_num: int = 0


def no_stops(_row) -> set[int]:
    return set()


#: the sampler runs where the engine's logits are; the CUDA cases run in ``bench/gpu_check.sh``'s
#: ``gpu_tests`` stage (``-m gpu``) and are skipped on a machine without a CUDA GPU
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def gen(device: str, seed: int) -> torch.Generator:
    """A seeded generator on ``device`` (the sampler draws on the logits' device)."""
    return torch.Generator(device=device).manual_seed(seed)


def reference_logprobs(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """log_softmax(logits / T) per row, in float64 (T = 1 for greedy rows)."""
    temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows], dtype=torch.float64)
    return torch.log_softmax(logits.double() / temps[:, None], dim=-1)


@pytest.mark.parametrize("device", DEVICES)
def test_behaviour_and_top_logprobs_are_the_log_softmax_of_the_scaled_logits(device):
    g = torch.Generator().manual_seed(0)
    V = 3000
    logits = torch.randn(6, V, generator=g) * 4
    logits[2, :100] = float("-inf")  # masked tokens are allowed: they are never drawn
    rows = [
        Row(SamplingParams(temperature=1.0), top_logprobs_num=5),
        Row(SamplingParams(temperature=0.7)),
        Row(SamplingParams(temperature=1.3), top_logprobs_num=3),
        Row(SamplingParams(temperature=0.0), top_logprobs_num=2),  # greedy
        Row(SamplingParams(temperature=1.0, top_k=20)),
        Row(SamplingParams(temperature=0.9, top_p=0.5, min_p=0.01)),
    ]
    on_device = logits.to(device)
    tokens, lps, tops = sample_tokens(on_device, rows, no_stops, gen(device, 1))
    assert torch.equal(on_device.cpu(), logits)  # the caller's logits are not modified
    ref = reference_logprobs(logits, rows)  # on the CPU, in float64
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        assert lp == pytest.approx(float(ref[i, t]), abs=1e-4), i
        assert t >= 100 or i != 2, "a token masked to -inf was drawn"
    assert tokens[3] == int(torch.argmax(logits[3]))
    assert tokens[4] in set(torch.topk(logits[4], 20).indices.tolist())
    for i, k in ((0, 5), (2, 3), (3, 2)):
        vals, ids = torch.topk(ref[i], k)
        assert [tid for _, tid in tops[i]] == ids.tolist()
        assert [v for v, _ in tops[i]] == pytest.approx(vals.tolist(), abs=1e-4)
    assert tops[1] is None and tops[4] is None and tops[5] is None


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_the_softmax_of_the_scaled_logits(device):
    """A chi-square test of 20,000 draws over a 6-token vocabulary at T = 0.8 and at T = 1 (all rows
    one batched multinomial), and under top-k (the kept tokens renormalised)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    N = 20000
    for params, keep in ((SamplingParams(temperature=0.8), 6), (SamplingParams(temperature=1.0), 6),
                         (SamplingParams(temperature=1.0, top_k=3), 3)):
        rows = [Row(params) for _ in range(N)]
        tokens, _, _ = sample_tokens(logits.to(device).expand(N, -1), rows, no_stops, gen(device, 7))
        counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
        p = torch.softmax(logits[0].double() / params.temperature, -1)
        p[keep:] = 0.0
        p = p / p.sum()
        assert counts[keep:].sum() == 0
        expected = p[:keep] * N
        chi2 = float((((counts[:keep] - expected) ** 2) / expected).sum())
        assert chi2 < 25.0, (params, counts.tolist(), expected.tolist())  # 5 dof: p < 1e-4 by chance


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_repeat_and_do_not_touch_the_shared_generator(device):
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(3)).to(device)

    def run():
        rows = [Row(SamplingParams(temperature=1.0), generator=gen(device, 11 + i)) for i in range(3)]
        shared = gen(device, 5)
        out = [sample_tokens(logits, rows, no_stops, shared)[0] for _ in range(20)]
        return out, shared.get_state()

    a, state_a = run()
    b, state_b = run()
    assert a == b
    assert torch.equal(state_a, state_b) and torch.equal(state_a, gen(device, 5).get_state())


def test_rows_without_a_valid_distribution_are_named():
    logits = torch.zeros(5, 10)
    logits[1, 3] = float("inf")
    logits[2, 4] = float("nan")
    logits[3, :] = float("-inf")
    rows = [Row(SamplingParams(temperature=t)) for t in (1.0, 0.5, 1.0, 0.0, 1.0)]
    with pytest.raises(NonFiniteLogits) as info:
        sample_tokens(logits, rows, no_stops)
    assert info.value.rows == [1, 2, 3]
    # a bias that overflows fp32 after the temperature is caught the same way
    huge = torch.zeros(2, 10)
    rows = [Row(SamplingParams(temperature=1.0)), Row(SamplingParams(temperature=1e-3, logit_bias={"2": 3e38}))]
    with pytest.raises(NonFiniteLogits) as info:
        sample_tokens(huge, rows, no_stops)
    assert info.value.rows == [1]


def test_min_new_tokens_masks_the_stop_tokens_until_reached():
    logits = torch.zeros(2, 8)
    logits[:, 7] = 50.0  # token 7, a stop token, is all but certain
    rows = [Row(SamplingParams(temperature=1.0, min_new_tokens=2), output_ids=[3]),
            Row(SamplingParams(temperature=1.0, min_new_tokens=2), output_ids=[3, 4])]
    tokens, lps, _ = sample_tokens(logits, rows, lambda _r: {7}, torch.Generator().manual_seed(0))
    assert tokens[0] != 7 and lps[0] == pytest.approx(-float(torch.log(torch.tensor(7.0))), abs=1e-5)
    assert tokens[1] == 7


def test_the_engines_nonfinite_row_check_tells_an_overflowing_sum_from_an_infinity():
    """The decode step's check sums each row first (one pass); finite entries whose sum overflows
    are not reported, an infinity or NaN is."""
    from types import SimpleNamespace

    from rollout_server.engine_outputs import EngineOutputs

    logits = torch.zeros(4, 16)
    logits[0, :3] = 3e38  # finite, but the row's sum overflows
    logits[1, 5] = float("-inf")
    logits[2, 0] = float("nan")
    eng = SimpleNamespace(torch=torch)
    assert EngineOutputs._nonfinite_rows(eng, logits) == [1, 2]
    assert EngineOutputs._nonfinite_rows(eng, logits[[0, 3]]) == []


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_never_draws_a_zero_weight_token_even_at_the_ends(device):
    """u = 0 draws the first token with weight, u just below 1 the last; zero-weight tokens
    between, before and after are never drawn (the float64 cumulative sum leaves them empty)."""
    from rollout_server.sampling import inverse_cdf_sample

    w = torch.tensor([[0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0]] * 4, device=device)
    u = torch.tensor([[0.0], [0.3], [0.5], [1.0 - 2 ** -53]], dtype=torch.float64, device=device)
    assert inverse_cdf_sample(w, u).tolist() == [2, 2, 4, 4]
    u_all = torch.rand(5000, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(device)
    drawn = set(inverse_cdf_sample(w[:1].expand(5000, -1), u_all).tolist())
    assert drawn == {2, 4}
    # a uniform that rounds up to the total (u x total == total) falls back to the last token with weight
    assert inverse_cdf_sample(w[:1], torch.tensor([[1.0]], dtype=torch.float64, device=device)).tolist() == [4]
