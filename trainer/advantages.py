"""Advantage estimators and the validation of precomputed advantages.

Pure functions over 1-D reward tensors; every estimator returns one scalar advantage per
sample, which the loss broadcasts over the sample's response tokens (outcome rewards,
no critic, no discounting: all four estimators below are the critic-free family used for
LLM RL with verifiable rewards).

Sources:

- ``grpo``: Shao et al. 2024, *DeepSeekMath* §4.1.2 (outcome supervision):
  ``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the G samples of a prompt group. ``std`` is the
  unbiased (Bessel, ``G - 1``) estimate, as TRL's ``GRPOTrainer`` and verl's
  ``compute_grpo_outcome_advantage`` use.
- ``dr_grpo``: Liu et al. 2025, *Understanding R1-Zero-Like Training* (Dr. GRPO): drop the std
  normalisation, ``A_i = r_i - mean(r)``.
- ``rloo``: Ahmadian et al. 2024, *Back to Basics* (REINFORCE Leave-One-Out):
  ``A_i = r_i - 1/(G-1) * sum_{j != i} r_j = G/(G-1) * (r_i - mean(r))``.
- ``reinforce_pp``: Hu 2025, *REINFORCE++*: no per-prompt baseline; rewards are normalised over
  the whole train batch, ``A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps)``.

Rewards are first shaped by :func:`process_rewards` (reward bias, scale and clip, PPO practice;
AReaL ``reward_bias``/``reward_scaling``/``reward_clip``) and, with ``mask_no_eos_with_zero``,
the reward of a sample that did not end with EOS is replaced by 0 (AReaL ``get_packed_rewards``).

Precomputed advantages (rllm ``use_precomputed_advantage``): custom rollout code may set a
scalar or one value per response token on each sample. :func:`group_advantages` validates them
per group: all present and well formed -> used as is; some missing -> a warning and the group
is estimated from its rewards; a per-token list of the wrong length or a non-finite value -> a
:class:`AdvantageError` naming the sample. With ``mode="add"`` (``trainer.precomputed_advantages:
add``) a group whose samples all carry them is estimated from its rewards as well and the
precomputed values are added, token by token: a dense per-token term (e.g. on-policy
self-distillation's log-ratios) shaping the estimator's sequence-level advantage.

GAE (PPO with a critic, ``trainer.advantage: gae``) is per token and needs the critic's values:
it lives in :mod:`trainer.value` and :mod:`trainer.critic`, with the per-token KL penalty in the
reward (:mod:`trainer.kl_control`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Literal

import torch

from asyncrl.core.choices import GROUP_ESTIMATORS
from asyncrl.tasks.rewards import process_reward

__all__ = [
    "ESTIMATORS",
    "AdvantageError",
    "AdvantageWarning",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "process_rewards",
    "overlong_penalty",
    "group_advantages",
]

#: The critic-free estimators, by name: the config's ``trainer.advantage`` choices are built from
#: the same tuple (:data:`asyncrl.core.choices.GROUP_ESTIMATORS`); each name is a function below.
ESTIMATORS: tuple[str, ...] = GROUP_ESTIMATORS
Estimator = Literal[GROUP_ESTIMATORS]


class AdvantageError(ValueError):
    """Precomputed advantages that cannot be used (wrong length, not a number); names the sample."""


class AdvantageWarning(UserWarning):
    """A group whose precomputed advantages are incomplete was re-estimated from its rewards."""


def _check_rewards(rewards_G: torch.Tensor, name: str, min_size: int) -> torch.Tensor:
    if rewards_G.dim() != 1:
        raise ValueError(f"{name}: rewards must be 1-D (G,), got shape {tuple(rewards_G.shape)}")
    if rewards_G.numel() < min_size:
        raise ValueError(f"{name} needs at least {min_size} samples per group, got {rewards_G.numel()}")
    if not torch.isfinite(rewards_G).all():
        raise ValueError(f"{name}: rewards must be finite, got {rewards_G.tolist()}")
    return rewards_G.to(torch.float64)


def grpo(rewards_G: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of one prompt group (DeepSeekMath §4.1.2).

    ``A_i = (r_i - mean(r)) / (std(r) + eps)``, ``std`` unbiased (``G - 1``).

    Args:
        rewards_G: (G,) rewards of the group's samples, G >= 2.
        eps: added to the std so a group with equal rewards gets advantages 0, not NaN.

    Returns:
        (G,) float32 advantages.

    Raises:
        ValueError: not 1-D, fewer than 2 samples, or a non-finite reward.
    """
    r = _check_rewards(rewards_G, "grpo", 2)
    return ((r - r.mean()) / (r.std(unbiased=True) + eps)).float()


def dr_grpo(rewards_G: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO advantages of one prompt group (Liu et al. 2025): ``A_i = r_i - mean(r)``.

    Args:
        rewards_G: (G,) rewards, G >= 2.

    Returns:
        (G,) float32 advantages.
    """
    r = _check_rewards(rewards_G, "dr_grpo", 2)
    return (r - r.mean()).float()


def rloo(rewards_G: torch.Tensor) -> torch.Tensor:
    """RLOO advantages of one prompt group (Ahmadian et al. 2024).

    ``A_i = r_i - (sum_j r_j - r_i) / (G - 1)``: each sample's baseline is the mean reward of the
    other G - 1 samples.

    Args:
        rewards_G: (G,) rewards, G >= 2.

    Returns:
        (G,) float32 advantages.
    """
    r = _check_rewards(rewards_G, "rloo", 2)
    g = r.numel()
    return (r - (r.sum() - r) / (g - 1)).float()


def reinforce_pp(rewards_N: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ advantages over a whole train batch (Hu 2025): batch-normalised rewards.

    ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with mean and (unbiased) std over all N samples of
    the batch, not per group. A batch of one sample gets advantage 0.

    Args:
        rewards_N: (N,) rewards of every sample in the batch, N >= 1.

    Returns:
        (N,) float32 advantages.
    """
    r = _check_rewards(rewards_N, "reinforce_pp", 1)
    if r.numel() == 1:
        return torch.zeros(1)
    return ((r - r.mean()) / (r.std(unbiased=True) + eps)).float()


def overlong_penalty(lengths_N: torch.Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, section 3.4), added to the reward.

    ``R_length(y) = 0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` if
    ``L_max - L_cache < |y| <= L_max``; ``-1`` if ``|y| > L_max``; times ``factor`` (verl's
    ``overlong_buffer.penalty_factor``; DAPO uses 1). Responses never exceed ``max_response_len``
    here, so the penalty reaches ``-factor`` exactly at ``L_max``.

    Args:
        lengths_N: (N,) response lengths in tokens.
        max_len: L_max = ``rollout.max_response_len``.
        cache_len: L_cache = ``trainer.loss.overlong_buffer_len``, 0 < L_cache < L_max.
        factor: ``trainer.loss.overlong_penalty_factor``.

    Returns:
        (N,) float32 penalties in [-factor, 0].

    Raises:
        ValueError: ``cache_len`` outside (0, max_len).
    """
    if not 0 < cache_len < max_len:
        raise ValueError(f"overlong penalty needs 0 < overlong_buffer_len < max_response_len, got {cache_len}, {max_len}")
    lengths = lengths_N.to(torch.float64)
    soft = ((max_len - cache_len) - lengths) / cache_len
    pen = torch.where(lengths > max_len, torch.full_like(lengths, -1.0), soft.clamp(max=0.0))
    return (pen * factor).float()


def process_rewards(
    rewards_N: torch.Tensor, *, bias: float = 0.0, scale: float = 1.0, clip: float = math.inf
) -> torch.Tensor:
    """Shape raw rewards: ``clip((r - bias) * scale, -clip, clip)`` (PPO practice; AReaL).

    The formula is :func:`asyncrl.tasks.rewards.process_reward`'s (its one place), applied to each
    reward in float64.

    Args:
        rewards_N: (N,) raw rewards.
        bias, scale, clip: ``data.reward_bias``, ``data.reward_scale``, ``data.reward_clip``.

    Returns:
        (N,) float32 processed rewards.
    """
    shaped = [process_reward(r, scale=scale, bias=bias, clip=clip) for r in rewards_N.to(torch.float64).tolist()]
    return torch.tensor(shaped, dtype=torch.float64).float()


def _precomputed_state(advantages: Sequence[object], lengths: Sequence[int], names: Sequence[str]) -> str:
    """'all', 'none' or 'some' of the samples carry precomputed advantages; validates those present.

    Raises:
        AdvantageError: a per-token list whose length differs from the sample's response length,
            a non-numeric or non-finite value; the message names the sample.
    """
    present = 0
    for adv, length, name in zip(advantages, lengths, names):
        if adv is None:
            continue
        present += 1
        if isinstance(adv, bool):
            raise AdvantageError(f"sample {name}: precomputed advantage must be a number or a list, got a bool")
        if isinstance(adv, (int, float)):
            if not math.isfinite(adv):
                raise AdvantageError(f"sample {name}: precomputed advantage is not finite ({adv})")
            continue
        if isinstance(adv, (list, tuple)):
            if len(adv) != length:
                raise AdvantageError(
                    f"sample {name}: {len(adv)} precomputed per-token advantages for {length} response "
                    "tokens (a per-token list needs exactly one value per response token)"
                )
            for value in adv:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise AdvantageError(f"sample {name}: precomputed per-token advantage {value!r} is not a finite number")
            continue
        raise AdvantageError(
            f"sample {name}: precomputed advantage must be a number or a list of numbers, got {type(adv).__name__}"
        )
    if present == 0:
        return "none"
    return "all" if present == len(advantages) else "some"


def group_advantages(
    estimator: Estimator,
    rewards: Sequence[Sequence[float]],
    response_lengths: Sequence[Sequence[int]],
    precomputed: Sequence[Sequence[object]] | None = None,
    sample_names: Sequence[Sequence[str]] | None = None,
    eps: float = 1e-6,
    mode: str = "replace",
) -> list[list[torch.Tensor]]:
    """Per-token advantages of every sample of a batch of prompt groups.

    Args:
        estimator: ``grpo``, ``dr_grpo``, ``rloo`` or ``reinforce_pp``.
        rewards: per group, the (processed) reward of each sample.
        response_lengths: per group, each sample's number of response tokens T_i.
        precomputed: per group, each sample's precomputed advantages (None, a number, or a list
            of T_i numbers); None means no sample carries any.
        sample_names: per group, sample ids used in messages.
        eps: std epsilon of ``grpo`` / ``reinforce_pp``.
        mode: ``replace`` (a group whose samples all carry precomputed advantages uses them as
            they are) or ``add`` (it is estimated from its rewards too, and they are added).

    Returns:
        per group, per sample, a (T_i,) float32 tensor of advantages.

    Raises:
        AdvantageError: malformed precomputed advantages (names the sample).
        ValueError: unknown estimator or mode, a group too small for a per-group estimator.

    Warns:
        AdvantageWarning: a group with some but not all precomputed advantages is re-estimated.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    if mode not in ("replace", "add"):
        raise ValueError(f"unknown precomputed-advantage mode {mode!r}; choose replace or add")
    n_groups = len(rewards)
    if len(response_lengths) != n_groups:
        raise ValueError("rewards and response_lengths must have one entry per group")
    precomputed = precomputed or [[None] * len(g) for g in rewards]
    sample_names = sample_names or [[f"{gi}/{si}" for si in range(len(g))] for gi, g in enumerate(rewards)]

    use_precomputed: list[bool] = []
    for gi in range(n_groups):
        state = _precomputed_state(precomputed[gi], response_lengths[gi], sample_names[gi])
        if state == "some":
            missing = [n for n, a in zip(sample_names[gi], precomputed[gi]) if a is None]
            warnings.warn(
                f"group {gi}: samples {', '.join(missing)} carry no precomputed advantages while others do; "
                f"re-estimating the whole group with {estimator} from its rewards",
                AdvantageWarning,
                stacklevel=2,
            )
        use_precomputed.append(state == "all")

    scalars: list[torch.Tensor | None] = [None] * n_groups
    estimated = [gi for gi in range(n_groups) if mode == "add" or not use_precomputed[gi]]
    if estimator == "reinforce_pp" and estimated:
        flat = torch.tensor([r for gi in estimated for r in rewards[gi]], dtype=torch.float64)
        adv_all = reinforce_pp(flat, eps)
        offset = 0
        for gi in estimated:
            scalars[gi] = adv_all[offset:offset + len(rewards[gi])]
            offset += len(rewards[gi])
    else:
        fn = {"grpo": lambda r: grpo(r, eps), "dr_grpo": dr_grpo, "rloo": rloo}.get(estimator)
        for gi in estimated:
            scalars[gi] = fn(torch.tensor(list(rewards[gi]), dtype=torch.float64))

    out: list[list[torch.Tensor]] = []
    for gi in range(n_groups):
        per_sample = []
        for si, length in enumerate(response_lengths[gi]):
            base = torch.zeros(length, dtype=torch.float64)
            if scalars[gi] is not None:
                base += float(scalars[gi][si])
            if use_precomputed[gi]:
                adv = precomputed[gi][si]
                base += torch.tensor(adv, dtype=torch.float64) if isinstance(adv, (list, tuple)) else float(adv)
            per_sample.append(base.float())
        out.append(per_sample)
    return out
