"""The critic's numerical core: GAE, the clipped value loss, value normalisation, explained variance.

Pure functions and one small stateful normaliser, over 1-D per-sample tensors (a sample's T
response tokens); the trainer calls them per sample and concatenates. No model code here.

Sources:

- GAE: Schulman et al. 2016, *High-Dimensional Continuous Control Using Generalized Advantage
  Estimation*, eq. 16: ``delta_t = r_t + gamma V(s_{t+1}) - V(s_t)``,
  ``A_t = sum_l (gamma lambda)^l delta_{t+l}``; returns (value targets) ``R_t = A_t + V(s_t)``.
  The value after the last token is 0 for a sample that ended (EOS, stop string) and the
  critic's own estimate for one cut by the length cap — the "truncated episode bootstrap", as
  AReaL's ``get_packed_advantages_and_returns`` (its ``seq_no_eos_mask``).
- Clipped value loss: AReaL ``critic_loss_fn`` and OpenRLHF ``ValueLoss`` (from OpenAI's
  ``baselines`` PPO2): ``0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)``.
- Value normalisation: AReaL ``ExponentialRunningMeanStd`` (``exp``: debiased exponential
  moving mean and mean square with decay ``beta``) and ``MovingAverageRunningMeanStd`` (``ma``:
  the plain running mean over every target seen). The critic predicts normalised values; they
  are denormalised before GAE, the statistics are updated with the new returns, and the
  returns are normalised to form the critic's targets. Both clamp the variance at 1e-2 and clip
  normalised values to [-5, 5], as AReaL does.
- Explained variance: ``1 - Var(R - V) / Var(R)`` (OpenAI ``baselines``), the standard critic
  health figure (1: perfect, 0: no better than the mean, < 0: worse).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

__all__ = ["gae", "value_loss", "explained_variance", "ValueNormalizer", "VALUE_NORM_TYPES"]

VALUE_NORM_TYPES: tuple[str, ...] = ("exp", "ma")


def gae(rewards_T: torch.Tensor, values_T: torch.Tensor, last_value: float, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimates and returns of one sample's response (Schulman et al. 2016).

    Args:
        rewards_T: (T,) per-token rewards (the sequence reward is on the last token, any KL
            penalty on every token: :func:`trainer.kl_control.token_rewards`).
        values_T: (T,) the critic's (denormalised) values ``V(s_t)`` of the state before each
            response token.
        last_value: ``V(s_T)`` after the last token: 0.0 for a sample that ended, the critic's
            value at the last position for one cut by the length cap.
        gamma: discount, in [0, 1].
        lam: GAE lambda, in [0, 1] (1: Monte-Carlo returns minus the value; 0: one-step TD).

    Returns:
        (advantages_T, returns_T), float32, ``returns = advantages + values``.

    Raises:
        ValueError: shapes differ or are not 1-D, T = 0, gamma/lam outside [0, 1], a non-finite input.
    """
    if rewards_T.dim() != 1 or rewards_T.shape != values_T.shape:
        raise ValueError(f"gae: rewards and values must be 1-D of one length, got {tuple(rewards_T.shape)} "
                         f"and {tuple(values_T.shape)}")
    if rewards_T.numel() == 0:
        raise ValueError("gae: a sample needs at least one response token")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: discount and gae_lambda must lie in [0, 1], got {gamma} and {lam}")
    r, v = rewards_T.detach().to(torch.float64), values_T.detach().to(torch.float64)
    if not (torch.isfinite(r).all() and torch.isfinite(v).all() and math.isfinite(last_value)):
        raise ValueError("gae: rewards, values and the bootstrap value must be finite")
    next_v = torch.cat([v[1:], v.new_tensor([float(last_value)])])
    delta = r + gamma * next_v - v
    adv = torch.empty_like(delta)
    running = 0.0
    for t in range(delta.numel() - 1, -1, -1):  # T is a response length: a Python loop is cheap here
        running = float(delta[t]) + gamma * lam * running
        adv[t] = running
    return adv.float(), (adv + v).float()


def value_loss(values_N: torch.Tensor, old_values_N: torch.Tensor, returns_N: torch.Tensor,
               weights_N: torch.Tensor, eps_clip: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped value loss over N response tokens (AReaL ``critic_loss_fn``, OpenRLHF ``ValueLoss``).

    ``0.5 * sum_t w_t max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -eps, eps) - R_t)^2)``.

    Args:
        values_N: (N,) the critic's current predictions (normalised when value_norm is on), with grad.
        old_values_N: (N,) the predictions the returns were computed from (no grad).
        returns_N: (N,) targets (normalised when value_norm is on).
        weights_N: (N,) token weights (the loss aggregation's weights, e.g. 1 / tokens in batch).
        eps_clip: ``value_eps_clip``; None disables clipping.

    Returns:
        (loss, stats): the scalar loss and ``{"clip_fraction": share of tokens where the clipped
        term was the larger}``.

    Raises:
        ValueError: the four tensors are not 1-D of one length, or eps_clip <= 0.
    """
    n = values_N.shape
    if values_N.dim() != 1 or old_values_N.shape != n or returns_N.shape != n or weights_N.shape != n:
        raise ValueError(f"value_loss: values, old values, returns and weights must be 1-D of one length, got "
                         f"{tuple(values_N.shape)}, {tuple(old_values_N.shape)}, {tuple(returns_N.shape)}, "
                         f"{tuple(weights_N.shape)}")
    if eps_clip is not None and eps_clip <= 0:
        raise ValueError(f"value_loss: value_eps_clip must be > 0 (or None to disable), got {eps_clip}")
    unclipped = (values_N - returns_N).pow(2)
    if eps_clip is None:
        per_token, clipped_frac = unclipped, 0.0
    else:
        v_clip = old_values_N + (values_N - old_values_N).clamp(-eps_clip, eps_clip)
        clipped = (v_clip - returns_N).pow(2)
        per_token = torch.maximum(unclipped, clipped)
        clipped_frac = float((clipped > unclipped).float().mean()) if n[0] else 0.0
    return 0.5 * (per_token * weights_N).sum(), {"clip_fraction": clipped_frac}


def explained_variance(values_N: torch.Tensor, returns_N: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over N tokens; NaN when Var(R) = 0 or N < 2 (nothing to explain)."""
    if values_N.numel() < 2:
        return float("nan")
    r, v = returns_N.detach().double(), values_N.detach().double()
    var_r = r.var(unbiased=False)
    if float(var_r) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)


class ValueNormalizer:
    """Running statistics of the value targets (AReaL ``ExponentialRunningMeanStd`` / ``MovingAverageRunningMeanStd``).

    ``kind="exp"``: ``m <- beta m + (1 - beta) mean(x)``, the same for ``mean(x^2)``, both
    debiased by ``d <- beta d + (1 - beta)`` (clamped at ``eps``); ``kind="ma"``: the exact
    mean and mean square of every value seen. ``std = sqrt(max(E[x^2] - E[x]^2, 1e-2))``;
    :meth:`normalize` clips to [-5, 5]. Statistics are float64 and survive a checkpoint
    through :meth:`state_dict` / :meth:`load_state_dict`. Before the first update the mean is
    0 and the std is sqrt(1e-2) = 0.1, as in AReaL.

    Raises:
        ValueError: unknown kind, beta outside (0, 1), eps <= 0 (constructor); a non-finite
            or empty update.
    """

    def __init__(self, kind: Literal["exp", "ma"] = "exp", beta: float = 0.99995, eps: float = 1e-5):
        if kind not in VALUE_NORM_TYPES:
            raise ValueError(f"value_norm_type must be one of {VALUE_NORM_TYPES}, got {kind!r}")
        if not 0.0 < beta < 1.0:
            raise ValueError(f"value_norm_beta must lie in (0, 1), got {beta}")
        if eps <= 0:
            raise ValueError(f"value_norm_eps must be > 0, got {eps}")
        self.kind, self.beta, self.eps = kind, float(beta), float(eps)
        self.mean_acc = 0.0
        self.mean_sq_acc = 0.0
        self.weight = 0.0  # exp: the debiasing term; ma: the number of values seen

    def update(self, x: torch.Tensor) -> None:
        """Fold a batch of targets (any shape, all tokens counted) into the statistics."""
        x = x.detach().double().flatten()
        if x.numel() == 0 or not torch.isfinite(x).all():
            raise ValueError("value normaliser: an update needs at least one finite value")
        self.update_moments(float(x.sum()), float(x.square().sum()), float(x.numel()))

    def update_moments(self, total: float, total_sq: float, count: float) -> None:
        """Fold a batch in by its moments (sum, sum of squares, count), e.g. all-reduced over ranks.

        Raises:
            ValueError: count <= 0 or a non-finite moment.
        """
        if not count > 0 or not (math.isfinite(total) and math.isfinite(total_sq)):
            raise ValueError("value normaliser: an update needs at least one finite value")
        if self.kind == "exp":
            b = self.beta
            self.mean_acc = b * self.mean_acc + (1 - b) * total / count
            self.mean_sq_acc = b * self.mean_sq_acc + (1 - b) * total_sq / count
            self.weight = b * self.weight + (1 - b)
        else:
            n = self.weight + count
            self.mean_acc = (self.weight * self.mean_acc + total) / n
            self.mean_sq_acc = (self.weight * self.mean_sq_acc + total_sq) / n
            self.weight = n

    def mean_std(self) -> tuple[float, float]:
        """The current (mean, std) of the targets."""
        if self.kind == "exp":
            d = max(self.weight, self.eps)
            mean, mean_sq = self.mean_acc / d, self.mean_sq_acc / d
        else:
            mean, mean_sq = self.mean_acc, self.mean_sq_acc
        return mean, math.sqrt(max(mean_sq - mean * mean, 1e-2))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``clip((x - mean) / std, -5, 5)`` in x's dtype."""
        mean, std = self.mean_std()
        return ((x.double() - mean) / std).clamp(-5.0, 5.0).to(x.dtype)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """``x * std + mean`` in x's dtype."""
        mean, std = self.mean_std()
        return (x.double() * std + mean).to(x.dtype)

    def state_dict(self) -> dict[str, float | str]:
        """JSON-able state, for the trainer's checkpoint."""
        return {"kind": self.kind, "beta": self.beta, "eps": self.eps, "mean_acc": self.mean_acc,
                "mean_sq_acc": self.mean_sq_acc, "weight": self.weight}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; raises ValueError when its kind differs from this one's."""
        if state.get("kind") != self.kind:
            raise ValueError(f"value normaliser: checkpoint kind {state.get('kind')!r} != configured {self.kind!r}")
        self.mean_acc, self.mean_sq_acc, self.weight = (float(state["mean_acc"]), float(state["mean_sq_acc"]),
                                                        float(state["weight"]))
