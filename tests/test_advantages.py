"""Advantage estimators against hand-computed values, and the precomputed-advantage rules."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from trainer.advantages import (
    AdvantageError,
    AdvantageWarning,
    dr_grpo,
    group_advantages,
    grpo,
    process_rewards,
    reinforce_pp,
    rloo,
)


def test_grpo_hand_values():
    # r = [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt(1/3) = 0.57735
    adv = grpo(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    s = math.sqrt(1 / 3)
    assert torch.allclose(adv, torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]), atol=1e-6)


def test_grpo_equal_rewards_gives_zero_not_nan():
    assert torch.equal(grpo(torch.tensor([1.0, 1.0, 1.0])), torch.zeros(3))


def test_dr_grpo_hand_values():
    assert torch.allclose(dr_grpo(torch.tensor([3.0, 1.0, 2.0])), torch.tensor([1.0, -1.0, 0.0]))


def test_rloo_hand_values():
    # A_0 = 3 - (1+2)/2 = 1.5, A_1 = 1 - (3+2)/2 = -1.5, A_2 = 2 - (3+1)/2 = 0
    assert torch.allclose(rloo(torch.tensor([3.0, 1.0, 2.0])), torch.tensor([1.5, -1.5, 0.0]))


def test_reinforce_pp_batch_normalised():
    adv = reinforce_pp(torch.tensor([0.0, 2.0, 4.0]), eps=0.0)  # mean 2, unbiased std 2
    assert torch.allclose(adv, torch.tensor([-1.0, 0.0, 1.0]))
    assert torch.equal(reinforce_pp(torch.tensor([5.0])), torch.zeros(1))


@pytest.mark.parametrize("fn", [grpo, dr_grpo, rloo])
def test_group_estimators_reject_bad_input(fn):
    with pytest.raises(ValueError, match="at least 2"):
        fn(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="finite"):
        fn(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="1-D"):
        fn(torch.zeros(2, 2))


def test_process_rewards_bias_scale_clip():
    out = process_rewards(torch.tensor([0.0, 1.0, 100.0]), bias=0.5, scale=2.0, clip=10.0)
    assert torch.allclose(out, torch.tensor([-1.0, 1.0, 10.0]))


def test_group_advantages_broadcasts_per_token_and_reinforce_pp_uses_batch():
    out = group_advantages("dr_grpo", [[1.0, 0.0]], [[2, 3]])
    assert torch.allclose(out[0][0], torch.tensor([0.5, 0.5]))
    assert torch.allclose(out[0][1], torch.tensor([-0.5, -0.5, -0.5]))
    out = group_advantages("reinforce_pp", [[0.0, 2.0], [4.0]], [[1, 1], [1]], eps=0.0)
    assert [float(x[0][0]) for x in [out[0][:1], out[0][1:], out[1]]] == pytest.approx([-1.0, 0.0, 1.0])


def test_precomputed_all_present_used_as_is():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = group_advantages("grpo", [[1.0, 0.0]], [[2, 3]], [[0.7, [1.0, 2.0, 3.0]]])
    assert torch.allclose(out[0][0], torch.tensor([0.7, 0.7]))
    assert torch.allclose(out[0][1], torch.tensor([1.0, 2.0, 3.0]))


def test_precomputed_some_missing_warns_and_recomputes_that_group_only():
    with pytest.warns(AdvantageWarning, match="s1"):
        out = group_advantages(
            "dr_grpo", [[1.0, 0.0], [2.0, 0.0]], [[1, 1], [1, 1]],
            [[0.9, None], [5.0, 6.0]], [["s0", "s1"], ["s2", "s3"]],
        )
    assert float(out[0][0][0]) == pytest.approx(0.5) and float(out[0][1][0]) == pytest.approx(-0.5)
    assert float(out[1][0][0]) == pytest.approx(5.0) and float(out[1][1][0]) == pytest.approx(6.0)


def test_precomputed_wrong_length_names_the_sample():
    with pytest.raises(AdvantageError, match="sample bad-7: 2 precomputed per-token advantages for 3"):
        group_advantages("grpo", [[1.0, 0.0]], [[3, 3]], [[[1.0, 2.0], 0.1]], [["bad-7", "ok"]])


@pytest.mark.parametrize("bad", [float("inf"), "x", [1.0, float("nan")], True])
def test_precomputed_malformed_values_are_errors(bad):
    with pytest.raises(AdvantageError, match="sample s0"):
        group_advantages("grpo", [[1.0, 0.0]], [[2, 2]], [[bad, 0.0]], [["s0", "s1"]])


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages("gae", [[1.0, 0.0]], [[1, 1]])


def test_precomputed_add_mode_adds_per_token_values_to_the_estimate():
    # dr_grpo of rewards [1, 0] is [+0.5, -0.5]; the precomputed values are added token by token
    out = group_advantages("dr_grpo", [[1.0, 0.0], [3.0, 1.0]], [[2, 3], [1, 1]],
                           [[[0.1, -0.2], 0.3], [None, None]], [["a", "b"], ["c", "d"]], mode="add")
    assert torch.allclose(out[0][0], torch.tensor([0.6, 0.3]))
    assert torch.allclose(out[0][1], torch.tensor([-0.2, -0.2, -0.2]))
    # a group without precomputed values is the estimate alone
    assert float(out[1][0][0]) == pytest.approx(1.0) and float(out[1][1][0]) == pytest.approx(-1.0)
    # replace (the default) ignores the rewards of that group
    rep = group_advantages("dr_grpo", [[1.0, 0.0]], [[2, 3]], [[[0.1, -0.2], 0.3]])
    assert torch.allclose(rep[0][0], torch.tensor([0.1, -0.2])) and torch.allclose(rep[0][1], torch.full((3,), 0.3))


def test_precomputed_add_mode_still_validates_and_falls_back():
    with pytest.raises(AdvantageError, match="sample a: 1 precomputed per-token advantages for 2"):
        group_advantages("grpo", [[1.0, 0.0]], [[2, 2]], [[[0.5], 0.0]], [["a", "b"]], mode="add")
    with pytest.warns(AdvantageWarning, match="b"):
        out = group_advantages("dr_grpo", [[1.0, 0.0]], [[1, 1]], [[0.25, None]], [["a", "b"]], mode="add")
    assert float(out[0][0][0]) == pytest.approx(0.5)  # some missing: the estimate alone, as in replace
    with pytest.raises(ValueError, match="choose replace or add"):
        group_advantages("grpo", [[1.0, 0.0]], [[1, 1]], mode="sum")


def test_precomputed_add_mode_is_refused_with_gae():
    from asyncrl.core.config import AsyncRLConfig

    with pytest.raises(ValueError, match="precomputed_advantages: add"):
        AsyncRLConfig.model_validate({"trainer": {"advantage": "gae", "precomputed_advantages": "add"}})
