"""Policy-loss maths against hand-computed values and an independent autograd formula.

Every branch is active in at least one case: upper clip, lower clip, dual clip, the
importance-weight cap, truncated IS, KL k1/k2/k3, entropy bonus, token and sequence
aggregation, and each mask of ``prepare_batch`` (mask_too_long, mask_no_eos_with_zero,
mask_stale).
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.core.config import load_config
from trainer.batch import BatchError, prepare_batch
from trainer.losses import (
    LossInputs,
    LossSettings,
    aggregation_weights,
    kl_penalty,
    policy_loss,
    token_logprobs_and_entropy,
)

ln = math.log


def _reference_objective(logp, old, adv, eps_l, eps_h, c):
    """Independent PPO objective (maximised): min(rA, clip(r)A), dual clip max(., cA) for A<0."""
    r = torch.exp(logp - old)
    j = torch.min(r * adv, torch.clamp(r, 1 - eps_l, 1 + eps_h) * adv)
    if c is not None:
        j = torch.where(adv < 0, torch.max(j, c * adv), j)
    return j


def _leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_ppo_clip_every_side_hand_values_and_gradient():
    # ratios 1.5 (A>0: upper clip), 0.5 (A<0: lower clip), 4.0 (A<0: dual clip at c=3),
    # 1.1 and 0.9 (inside), 0.5 with A>0 (pessimistic unclipped side)
    ratios = [1.5, 0.5, 4.0, 1.1, 0.9, 0.5]
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0, -0.5, 1.0], dtype=torch.float64)
    behav = torch.tensor([-1.0, -2.0, -3.0, -0.5, -1.5, -2.5], dtype=torch.float64)
    logp = _leaf([b + ln(r) for b, r in zip(behav.tolist(), ratios)])
    w = torch.full((6,), 1 / 6, dtype=torch.float64)
    s = LossSettings(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0, correction="none")
    loss, sums = policy_loss(LossInputs(logp, behav, adv, w), s)
    per_token = [-1.28, 0.8, 3.0, -2.2, 0.45, -0.5]
    assert float(loss.detach()) == pytest.approx(sum(per_token) / 6, abs=1e-9)
    loss.backward()
    hand_grad = torch.tensor([0.0, 0.0, 0.0, -2.2, 0.45, -0.5], dtype=torch.float64) / 6
    assert torch.allclose(logp.grad, hand_grad, atol=1e-9)
    # independent autograd formula
    x = logp.detach().clone().requires_grad_(True)
    ref = -(w * _reference_objective(x, behav, adv, 0.2, 0.28, 3.0)).sum()
    ref.backward()
    assert float(ref.detach()) == pytest.approx(float(loss.detach()), abs=1e-9)
    assert torch.allclose(x.grad, logp.grad, atol=1e-12)
    assert sums["clipped_tokens"] == 2 and sums["dual_clipped_tokens"] == 1 and sums["tokens"] == 6
    assert sums["ratio_sum"] == pytest.approx(sum(ratios))


def test_no_dual_clip_keeps_large_negative_loss():
    logp = _leaf([ln(4.0)])
    s = LossSettings(dual_clip_c=None, correction="none")
    loss, sums = policy_loss(LossInputs(logp, torch.zeros(1, dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64),
                                        torch.ones(1, dtype=torch.float64)), s)
    assert float(loss.detach()) == pytest.approx(4.0) and sums["dual_clipped_tokens"] == 0


def test_decoupled_ppo_hand_values_cap_and_gradient():
    # AReaL eq. 5: pg = min(pi_prox/pi_behav, cap) * max(-A u, -A clip(u)), u = pi/pi_prox
    behav = torch.zeros(4, dtype=torch.float64) - 1.0
    prox = behav + torch.tensor([ln(3.0), ln(0.5), 0.0, ln(1.5)], dtype=torch.float64)
    u = [1.1, 1.5, 0.7, 1.0]
    logp = _leaf([p + ln(x) for p, x in zip(prox.tolist(), u)])
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0], dtype=torch.float64)
    w = torch.full((4,), 0.25, dtype=torch.float64)
    s = LossSettings(correction="decoupled", importance_weight_cap=2.0, dual_clip_c=None)
    loss, sums = policy_loss(LossInputs(logp, behav, adv, w, prox_logprobs=prox), s)
    assert float(loss.detach()) == pytest.approx((-2.2 - 0.64 + 0.8 + 3.0) / 4, abs=1e-9)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-2.2, 0.0, 0.0, 3.0], dtype=torch.float64) / 4, atol=1e-9)
    x = logp.detach().clone().requires_grad_(True)
    weight = torch.clamp(torch.exp(prox - behav), max=2.0)
    ref = -(w * weight * _reference_objective(x, prox, adv, 0.2, 0.28, None)).sum()
    ref.backward()
    assert torch.allclose(x.grad, logp.grad, atol=1e-12)
    assert sums["imp_weight_max"] == pytest.approx(3.0)
    assert sums["imp_weight_capped"] == 1
    assert sums["imp_weight_sum"] == pytest.approx(3.0 + 0.5 + 1.0 + 1.5)
    assert sums["clipped_tokens"] == 2


def test_decoupled_requires_prox():
    with pytest.raises(ValueError, match="prox_logprobs"):
        policy_loss(LossInputs(_leaf([-1.0]), torch.zeros(1), torch.ones(1), torch.ones(1)), LossSettings(correction="decoupled"))


def test_truncated_importance_sampling_hand_values_and_gradient():
    behav = torch.tensor([-1.0, -1.0, -2.0], dtype=torch.float64)
    r = [3.0, 0.5, 1.0]  # first is capped at 2
    logp = _leaf([b + ln(x) for b, x in zip(behav.tolist(), r)])
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    w = torch.full((3,), 1 / 3, dtype=torch.float64)
    s = LossSettings(correction="tis", importance_weight_cap=2.0)
    loss, sums = policy_loss(LossInputs(logp, behav, adv, w), s)
    lp = logp.detach()
    expected = (-2.0 * 1.0 * lp[0] - 0.5 * (-1.0) * lp[1] - 1.0 * 2.0 * lp[2]) / 3
    assert float(loss.detach()) == pytest.approx(float(expected), abs=1e-9)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-2.0, 0.5, -2.0], dtype=torch.float64) / 3, atol=1e-9)
    assert sums["imp_weight_capped"] == 1 and sums["imp_weight_max"] == pytest.approx(3.0)


@pytest.mark.parametrize("estimator,expected", [("k1", ln(2)), ("k2", 0.5 * ln(2) ** 2), ("k3", 0.5 - 1 + ln(2))])
def test_kl_estimators_hand_values_and_gradient(estimator, expected):
    logp = _leaf([ln(0.5)])
    ref = torch.tensor([ln(0.25)], dtype=torch.float64)
    kl = kl_penalty(logp, ref, estimator)
    assert float(kl.detach()) == pytest.approx(expected, abs=1e-12)
    kl.sum().backward()
    x = logp.detach().clone().requires_grad_(True)
    lr_ = ref - x
    indep = {"k1": -lr_, "k2": lr_ ** 2 / 2, "k3": lr_.exp() - 1 - lr_}[estimator]
    indep.sum().backward()
    assert torch.allclose(x.grad, logp.grad)
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_penalty(logp, ref, "k4")


def test_kl_and_entropy_terms_enter_the_loss():
    logp = _leaf([ln(0.5), ln(0.25)])
    behav = logp.detach().clone()
    ref = torch.tensor([ln(0.25), ln(0.25)], dtype=torch.float64)
    ent = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    adv = torch.zeros(2, dtype=torch.float64)
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    s = LossSettings(correction="none", kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, sums = policy_loss(LossInputs(logp, behav, adv, w, ref_logprobs=ref, entropy=ent), s)
    expected = 0.5 * (0.1 * ln(2) - 0.01 * 1.0) + 0.5 * (0.0 - 0.01 * 2.0)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-12)
    loss.backward()
    assert torch.allclose(ent.grad, torch.tensor([-0.005, -0.005], dtype=torch.float64))
    assert sums["ref_kl_sum"] == pytest.approx(ln(2))
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(LossInputs(logp, behav, adv, w), s)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(LossInputs(logp, behav, adv, w, ref_logprobs=ref), s)


def test_masked_tokens_contribute_nothing():
    logp = _leaf([ln(1.5), ln(0.9)])
    w = torch.tensor([0.0, 1.0], dtype=torch.float64)
    loss, sums = policy_loss(LossInputs(logp, torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64), w),
                             LossSettings(correction="none"))
    loss.backward()
    assert float(logp.grad[0]) == 0.0 and sums["tokens"] == 1 and sums["clipped_tokens"] == 0


def test_aggregation_weights_token_and_sequence():
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    owner = torch.tensor([7, 7, 9, 9])
    assert torch.allclose(aggregation_weights(mask, owner, "token", 6.0, 3.0), torch.tensor([1 / 6, 1 / 6, 1 / 6, 0.0]))
    # sample 7 has 2 loss tokens, sample 9 one; 2 samples in the mini-batch
    assert torch.allclose(aggregation_weights(mask, owner, "sequence", 3.0, 2.0), torch.tensor([0.25, 0.25, 0.5, 0.0]))
    assert torch.equal(aggregation_weights(mask, owner, "token", 0.0, 0.0), torch.zeros(4))
    with pytest.raises(ValueError, match="aggregation"):
        aggregation_weights(mask, owner, "group", 1.0, 1.0)


def test_token_logprobs_and_entropy_fp32_with_temperature():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    lp, ent = token_logprobs_and_entropy(logits, torch.tensor([2]), temperature=2.0)
    x = torch.tensor([0.5, 1.0, 1.5])
    p = torch.softmax(x, -1)
    assert lp.dtype == torch.float32
    assert float(lp) == pytest.approx(float(torch.log(p[2])), abs=1e-6)
    assert float(ent) == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)


# --------------------------------------------------------------------------- masks (prepare_batch)


def _cfg(**loss):
    return load_config([], overrides={"trainer": {"advantage": "dr_grpo", "loss": loss}, "rollout": {"n_samples_per_prompt": 2},
                                      "buffer": {"max_staleness": 2}})


def _group(reasons=("stop", "length"), rewards=(1.0, 1.0), versions=((3, 3), (2, 3))):
    return {"group_id": "g", "prompt_ids": [5, 6], "samples": [
        {"sample_id": f"s{i}", "index": i, "response_ids": [10, 11], "behaviour_logprobs": [-1.0, -2.0],
         "versions": list(versions[i]), "finish_reason": reasons[i], "reward": rewards[i]} for i in range(2)]}


def test_mask_too_long_drops_length_samples_from_the_loss():
    batch = prepare_batch([_group()], _cfg(mask_too_long=True), policy_version=3)
    assert batch.samples[0].loss_mask.tolist() == [1.0, 1.0]
    assert batch.samples[1].loss_mask.tolist() == [0.0, 0.0]
    assert prepare_batch([_group()], _cfg(), 3).samples[1].loss_mask.tolist() == [1.0, 1.0]


def test_mask_no_eos_with_zero_zeroes_the_reward():
    batch = prepare_batch([_group()], _cfg(mask_no_eos_with_zero=True), policy_version=3)
    assert [s.reward for s in batch.samples] == [1.0, 0.0]
    assert batch.samples[0].advantages.tolist() == [0.5, 0.5]  # dr_grpo: 1 - 0.5
    plain = prepare_batch([_group()], _cfg(), 3)
    assert plain.samples[0].advantages.tolist() == [0.0, 0.0]


def test_mask_stale_masks_old_version_tokens_and_staleness_stats():
    batch = prepare_batch([_group()], _cfg(correction="mask_stale"), policy_version=3)
    assert batch.samples[1].loss_mask.tolist() == [0.0, 1.0]
    assert batch.stats["staleness_max"] == 1.0
    assert batch.stats["staleness_tokens_1"] == 1.0 and batch.stats["staleness_tokens_0"] == 3.0


def test_prepare_batch_errors_name_the_sample():
    g = _group()
    g["samples"][1]["versions"] = [3]
    with pytest.raises(BatchError, match="sample s1: 2 response tokens but 2 behaviour logprobs and 1 versions"):
        prepare_batch([g], _cfg(), 3)
    g = _group()
    g["samples"][1]["sample_id"] = "s0"
    with pytest.raises(BatchError, match="s0 appears twice"):
        prepare_batch([g], _cfg(), 3)
    g = _group()
    for smp in g["samples"]:
        smp["reward"] = None
        smp["error"] = "verifier crashed"
    with pytest.warns(UserWarning, match="reward_error"), pytest.raises(BatchError, match="no trainable group"):
        prepare_batch([g], _cfg(), 3)


def test_overlong_penalty_follows_dapo():
    from trainer.advantages import overlong_penalty

    # L_max = 10, L_cache = 4: 0 up to 6 tokens, then ((10 - 4) - |y|) / 4, -1 at 10 and beyond
    pen = overlong_penalty(torch.tensor([0, 6, 7, 8, 10, 11]), max_len=10, cache_len=4)
    assert pen.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(torch.tensor([8]), 10, 4, factor=0.5).tolist() == [-0.25]
    for bad in (0, 10):
        with pytest.raises(ValueError, match="overlong_buffer_len"):
            overlong_penalty(torch.tensor([1]), 10, bad)


def test_overlong_penalty_is_added_to_the_reward_before_advantages():
    cfg = load_config([], overrides={"trainer": {"advantage": "dr_grpo", "loss": {"overlong_buffer_len": 2}},
                                     "rollout": {"n_samples_per_prompt": 2, "max_response_len": 4},
                                     "buffer": {"max_staleness": 2}})
    group = _group(rewards=(1.0, 1.0))
    group["samples"][1]["response_ids"] = [10, 11, 12, 13]  # at L_max: -1
    group["samples"][1]["behaviour_logprobs"] = [-1.0] * 4
    group["samples"][1]["versions"] = [3] * 4
    batch = prepare_batch([group], cfg, policy_version=3)
    assert [s.reward for s in batch.samples] == [1.0, 0.0]  # 2 tokens: no penalty (<= L_max - L_cache)
    assert batch.samples[0].advantages.tolist() == [0.5, 0.5]
    assert [s.reward for s in prepare_batch([group], _cfg(), 3).samples] == [1.0, 1.0]  # off by default


def test_masked_importance_weights_drop_tokens_outside_the_band():
    # decoupled, mask mode, cap 2: weights 3.0 and 0.25 lie outside [0.5, 2] and leave the loss;
    # 0.6 and 1.5 stay and are used as they are (not truncated)
    behav = torch.zeros(4, dtype=torch.float64) - 1.0
    prox = behav + torch.tensor([ln(3.0), ln(0.6), ln(0.25), ln(1.5)], dtype=torch.float64)
    logp = _leaf(prox.tolist())  # u = 1: inside the clip
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0], dtype=torch.float64)
    w = torch.full((4,), 0.25, dtype=torch.float64)
    s = LossSettings(correction="decoupled", importance_weight_cap=2.0, importance_weight_mode="mask", dual_clip_c=None)
    loss, sums = policy_loss(LossInputs(logp, behav, adv, w, prox_logprobs=prox), s)
    assert float(loss.detach()) == pytest.approx((-0.6 * 1.0 + 1.5 * 2.0) / 4, abs=1e-12)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([0.0, -0.6, 0.0, 3.0], dtype=torch.float64) / 4, atol=1e-12)
    assert sums["imp_weight_masked"] == 2 and sums["tokens"] == 4 and sums["imp_weight_capped"] == 1
    # truncate mode on the same tokens trains all four, the first at the cap
    logp2 = _leaf(prox.tolist())
    loss2, sums2 = policy_loss(LossInputs(logp2, behav, adv, w, prox_logprobs=prox),
                               LossSettings(correction="decoupled", importance_weight_cap=2.0, dual_clip_c=None))
    assert float(loss2.detach()) == pytest.approx((-2.0 - 0.6 + 0.25 + 3.0) / 4, abs=1e-12)
    assert sums2["imp_weight_masked"] == 0


def test_masked_tis_and_unknown_mode():
    behav = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    logp = _leaf([-1.0 + ln(3.0), -1.0])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    w = torch.full((2,), 0.5, dtype=torch.float64)
    loss, sums = policy_loss(LossInputs(logp, behav, adv, w),
                             LossSettings(correction="tis", importance_weight_cap=2.0, importance_weight_mode="mask"))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([0.0, -0.5], dtype=torch.float64), atol=1e-12)
    assert sums["imp_weight_masked"] == 1
    with pytest.raises(ValueError, match="truncate' or 'mask"):
        policy_loss(LossInputs(_leaf([-1.0]), behav[:1], adv[:1], w[:1]),
                    LossSettings(correction="tis", importance_weight_mode="clip"))


def test_gspo_sequence_ratio_and_weight_hand_values_and_gradient():
    # sample 0: log(pi/prox) = [ln 1.2, ln 1.2] -> u = 1.2; log(prox/behav) = [ln 4, 0] -> w = 2
    # sample 1: log(pi/prox) = [ln 0.5, ln 2] -> u = 1;   log(prox/behav) = [ln 0.25, 0] -> w = 0.5
    behav = torch.full((4,), -2.0, dtype=torch.float64)
    prox = behav + torch.tensor([ln(4.0), 0.0, ln(0.25), 0.0], dtype=torch.float64)
    logp = _leaf((prox + torch.tensor([ln(1.2), ln(1.2), ln(0.5), ln(2.0)], dtype=torch.float64)).tolist())
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    w = torch.full((4,), 0.25, dtype=torch.float64)
    idx = torch.tensor([7, 7, 3, 3])
    s = LossSettings(correction="gspo", importance_weight_cap=5.0, dual_clip_c=None)
    loss, sums = policy_loss(LossInputs(logp, behav, adv, w, prox_logprobs=prox, sample_index=idx), s)
    assert float(loss.detach()) == pytest.approx((-2.4 * 2 + 0.5 * 2) / 4, abs=1e-12)
    loss.backward()
    # GSPO-token (eq. 10): every token of a sample carries the sequence ratio's gradient u_i
    assert torch.allclose(logp.grad, torch.tensor([-0.6, -0.6, 0.125, 0.125], dtype=torch.float64), atol=1e-12)
    # the same gradient from the sequence-level objective J = sum_i W_i w_i u_i A_i, u_i = exp(mean log ratio)
    x = logp.detach().clone().requires_grad_(True)
    lr_ = x - prox
    u = torch.stack([lr_[:2].mean().exp(), lr_[2:].mean().exp()])
    ref = -(0.5 * torch.tensor([2.0, 0.5], dtype=torch.float64) * u * torch.tensor([1.0, -1.0], dtype=torch.float64)).sum()
    ref.backward()
    assert torch.allclose(x.grad, logp.grad, atol=1e-12)
    assert sums["imp_weight_max"] == pytest.approx(2.0) and sums["imp_weight_sum"] == pytest.approx(5.0)
    with pytest.raises(ValueError, match="sample_index"):
        policy_loss(LossInputs(logp.detach(), behav, adv, w, prox_logprobs=prox), s)
