"""trainer/value.py and trainer/kl_control.py: GAE, the clipped value loss, value normalisation,
explained variance, KL token rewards and the adaptive KL controller, against hand-computed values
and independent formulas written out here."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.kl_control import KLController, token_rewards
from trainer.value import ValueNormalizer, explained_variance, gae, value_loss

REWARDS = torch.tensor([0.0, 0.0, 1.0])
VALUES = torch.tensor([0.5, 0.6, 0.7])


def test_gae_monte_carlo_when_gamma_and_lambda_are_one():
    adv, ret = gae(REWARDS, VALUES, last_value=0.0, gamma=1.0, lam=1.0)
    # returns = the undiscounted reward-to-go (1 everywhere); advantages = 1 - V
    assert torch.allclose(ret, torch.tensor([1.0, 1.0, 1.0]))
    assert torch.allclose(adv, torch.tensor([0.5, 0.4, 0.3]))


def test_gae_discounted_by_hand():
    # delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.95*0.7 - 0.6 = 0.065; delta_0 = 0.95*0.6 - 0.5 = 0.07
    # A_2 = 0.3; A_1 = 0.065 + 0.9025*0.3 = 0.33575; A_0 = 0.07 + 0.9025*0.065 + 0.9025^2*0.3
    adv, ret = gae(REWARDS, VALUES, last_value=0.0, gamma=0.95, lam=0.95)
    expected = torch.tensor([0.373014375, 0.33575, 0.3])
    assert torch.allclose(adv, expected, atol=1e-7)
    assert torch.allclose(ret, expected + VALUES, atol=1e-7)


def test_gae_lambda_zero_is_one_step_td_and_truncation_bootstraps():
    adv, _ = gae(REWARDS, VALUES, last_value=0.4, gamma=0.95, lam=0.0)
    # delta_2 uses the bootstrap value of the state after the cut: 1 + 0.95*0.4 - 0.7
    assert torch.allclose(adv, torch.tensor([0.07, 0.065, 1.0 + 0.38 - 0.7]), atol=1e-7)


def test_gae_against_the_sum_definition_on_random_input():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(17, generator=g), torch.randn(17, generator=g)
    for gamma, lam in [(1.0, 1.0), (1.0, 0.95), (0.95, 1.0), (0.95, 0.95)]:
        adv, ret = gae(r, v, last_value=0.3, gamma=gamma, lam=lam)
        nv = torch.cat([v[1:], torch.tensor([0.3])])
        delta = (r + gamma * nv - v).double()
        ref = torch.tensor([sum((gamma * lam) ** (l - t) * float(delta[l]) for l in range(t, 17)) for t in range(17)],
                           dtype=torch.float64)
        assert torch.allclose(adv.double(), ref, atol=1e-5)
        assert torch.allclose(ret, adv + v, atol=1e-6)


@pytest.mark.parametrize("bad", [
    dict(rewards_T=torch.zeros(3), values_T=torch.zeros(2)),
    dict(rewards_T=torch.zeros(0), values_T=torch.zeros(0)),
    dict(gamma=1.5), dict(lam=-0.1),
    dict(rewards_T=torch.tensor([0.0, float("nan"), 1.0])),
    dict(last_value=float("inf")),
])
def test_gae_rejects_bad_input(bad):
    kw = dict(rewards_T=REWARDS, values_T=VALUES, last_value=0.0, gamma=1.0, lam=1.0) | bad
    with pytest.raises(ValueError, match="gae"):
        gae(**kw)


def test_gae_with_value_normalisation_by_hand():
    # the critic predicts normalised values; GAE runs on denormalised ones (AReaL's order)
    norm = ValueNormalizer("ma")
    norm.update(torch.tensor([1.0, 2.0, 3.0]))  # mean 2, E[x^2] = 14/3, var 2/3
    mean, std = norm.mean_std()
    assert mean == pytest.approx(2.0) and std == pytest.approx(math.sqrt(2.0 / 3.0))
    predicted = torch.tensor([-1.0, 0.0, 0.5])
    values = norm.denormalize(predicted)
    assert torch.allclose(values, torch.tensor([2 - std, 2.0, 2 + 0.5 * std]))
    adv, ret = gae(REWARDS, values, last_value=0.0, gamma=1.0, lam=1.0)
    assert torch.allclose(ret, torch.ones(3)) and torch.allclose(adv, 1.0 - values)
    norm.update(ret)  # then the targets: (1 - mean) / std, with the statistics updated by the returns
    mean2, std2 = norm.mean_std()
    assert mean2 == pytest.approx(1.5)  # (1 + 2 + 3 + 1 + 1 + 1) / 6
    assert torch.allclose(norm.normalize(ret), torch.full((3,), (1.0 - 1.5) / std2))


def test_value_normalizer_exp_is_the_debiased_ema():
    norm = ValueNormalizer("exp", beta=0.5)
    mean0, std0 = norm.mean_std()
    assert (mean0, std0) == (0.0, pytest.approx(0.1))  # before any update, as AReaL
    norm.update(torch.tensor([2.0, 4.0]))  # m = 0.5*3, sq = 0.5*10, d = 0.5
    norm.update(torch.tensor([6.0]))       # m = 0.25*3 + 0.5*6, sq = 0.25*10 + 0.5*36, d = 0.75
    mean, std = norm.mean_std()
    m, sq = (0.75 + 3.0) / 0.75, (2.5 + 18.0) / 0.75
    assert mean == pytest.approx(m) and std == pytest.approx(math.sqrt(sq - m * m))
    assert torch.allclose(norm.normalize(torch.tensor([1e6, -1e6])), torch.tensor([5.0, -5.0]))  # clipped
    restored = ValueNormalizer("exp", beta=0.5)
    restored.load_state_dict(norm.state_dict())
    assert restored.mean_std() == norm.mean_std()
    with pytest.raises(ValueError, match="kind"):
        ValueNormalizer("ma").load_state_dict(norm.state_dict())


@pytest.mark.parametrize("kw", [dict(kind="ema"), dict(beta=1.0), dict(beta=0.0), dict(eps=0.0)])
def test_value_normalizer_rejects_bad_settings(kw):
    with pytest.raises(ValueError, match="value_norm"):
        ValueNormalizer(**kw)


def test_value_normalizer_rejects_bad_updates():
    with pytest.raises(ValueError, match="finite"):
        ValueNormalizer().update(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="at least one"):
        ValueNormalizer().update(torch.zeros(0))


def test_value_loss_and_gradient_against_an_independent_formula():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(64, generator=g)
    v = (old + 0.5 * torch.randn(64, generator=g)).requires_grad_(True)
    ret = torch.randn(64, generator=g)
    w = torch.rand(64, generator=g)
    eps = 0.2
    loss, stats = value_loss(v, old, ret, w, eps)
    loss.backward()
    # independent: elementwise, by cases
    vd = v.detach()
    exp_loss, exp_grad, n_clip = 0.0, torch.zeros(64), 0
    for i in range(64):
        vc = float(old[i]) + max(-eps, min(eps, float(vd[i] - old[i])))
        a, b = (float(vd[i]) - float(ret[i])) ** 2, (vc - float(ret[i])) ** 2
        exp_loss += 0.5 * float(w[i]) * max(a, b)
        if b > a:
            n_clip += 1
            inside = abs(float(vd[i] - old[i])) < eps
            exp_grad[i] = float(w[i]) * (vc - float(ret[i])) if inside else 0.0
        else:
            exp_grad[i] = float(w[i]) * (float(vd[i]) - float(ret[i]))
    assert float(loss.detach()) == pytest.approx(exp_loss, rel=1e-5)
    assert torch.allclose(v.grad, exp_grad, atol=1e-6)
    assert stats["clip_fraction"] == pytest.approx(n_clip / 64)
    assert 0 < n_clip < 64  # both branches exercised


def test_value_loss_unclipped_and_bad_input():
    v = torch.tensor([1.0, 2.0], requires_grad=True)
    loss, stats = value_loss(v, torch.zeros(2), torch.zeros(2), torch.ones(2), None)
    assert float(loss.detach()) == pytest.approx(0.5 * (1 + 4)) and stats["clip_fraction"] == 0.0
    with pytest.raises(ValueError, match="one length"):
        value_loss(v, torch.zeros(3), torch.zeros(2), torch.ones(2), 0.2)
    with pytest.raises(ValueError, match="value_eps_clip"):
        value_loss(v, torch.zeros(2), torch.zeros(2), torch.ones(2), 0.0)


def test_explained_variance():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(r, r) == pytest.approx(1.0)
    assert explained_variance(torch.full((4,), 2.5), r) == pytest.approx(0.0)
    assert explained_variance(-r, r) < 0
    assert math.isnan(explained_variance(r, torch.ones(4)))
    assert math.isnan(explained_variance(r[:1], r[:1]))


def test_token_rewards_kl_on_every_token_score_on_the_last():
    lp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -2.0, -0.25])
    r = token_rewards(2.0, lp, ref, kl_coef=0.1)
    assert torch.allclose(r, torch.tensor([-0.05, 0.0, 0.025 + 2.0]))
    assert torch.allclose(token_rewards(30.0, lp, ref, 0.0, max_reward_clip=20.0), torch.tensor([0.0, 0.0, 20.0]))
    assert torch.allclose(token_rewards(1.0, lp, None, 0.1), torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="reference logprobs"):
        token_rewards(1.0, lp, ref[:2], 0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        token_rewards(1.0, lp, ref, -0.1)
    with pytest.raises(ValueError, match="non-empty"):
        token_rewards(1.0, torch.zeros(0), None, 0.1)


def test_adaptive_kl_controller_follows_its_recurrence():
    ctl = KLController(0.1, target=6.0, horizon=10_000)
    beta = 0.1
    for kl, n in [(12.0, 48), (6.0, 48), (0.0, 48), (7.2, 100), (float("nan"), 48)]:
        if math.isfinite(kl):
            beta *= 1 + min(max(kl / 6.0 - 1, -0.2), 0.2) * n / 10_000
        assert ctl.update(kl, n) == pytest.approx(beta, rel=1e-12)
    fixed = KLController(0.1)
    assert not fixed.adaptive and fixed.update(100.0, 48) == 0.1
    restored = KLController(0.5, target=6.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


@pytest.mark.parametrize("kw", [dict(init=-1.0), dict(init=0.1, target=0.0), dict(init=0.1, horizon=0)])
def test_kl_controller_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        KLController(**kw)
