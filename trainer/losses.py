"""PPO-family policy loss with off-policy correction, KL to a reference and entropy bonus.

Everything here is a pure function over flat per-token tensors: the response tokens of all the
samples of one packed micro-batch, concatenated (T tokens). Aggregation is expressed as a
per-token weight ``weight_T`` that the caller precomputes for the *whole mini-batch* (over all
micro-batches and ranks), so the loss of a micro-batch is ``sum_t weight_t * loss_t`` and the sum
over micro-batches is exactly the mini-batch loss, whatever the packing and the number of ranks:

- token aggregation (DAPO, Yu et al. 2025 §3.3): ``weight_t = mask_t / sum(mask)`` (all tokens
  of the mini-batch);
- sequence aggregation (GRPO, Shao et al. 2024 eq. 3): ``weight_t = mask_t / (|o_i| * N)`` with
  ``|o_i|`` the sample's loss tokens and N the mini-batch's samples.

Per-token policy-gradient term ``pg_t`` for each ``correction`` (ratios are ``exp`` of logprob
differences; ``A`` the advantage; ``eps_l``/``eps_h`` the clip range, DAPO clip-higher):

- ``decoupled`` — decoupled PPO (Fu et al. 2025, *AReaL*, eq. 4-5): ``u = pi_theta / pi_prox``
  with pi_prox the weights at the start of the step (recomputed), ``w = min(pi_prox / pi_behav,
  cap)`` (a constant), ``pg = w * max(-A u, -A clip(u, 1-eps_l, 1+eps_h))``;
- ``tis`` — truncated importance sampling without a proximal policy (IMPALA's rho-bar
  truncation, Espeholt et al. 2018; the policy-gradient form of MiniMax-M1's CISPO):
  ``r = pi_theta / pi_behav``, ``pg = -sg(min(r, cap)) * A * log pi_theta`` (gradient
  ``-min(r, cap) A grad log pi``; no trust-region clip, only the cap);
- ``mask_stale`` — slime's ``--mask-offpolicy-in-partial-rollout``: tokens produced by an older
  policy version than the weights being trained are removed from the loss (the caller zeroes
  their weight); the rest get PPO clip with ``r = pi_theta / pi_behav``;
- ``none`` — PPO clip (Schulman et al. 2017) with ``r = pi_theta / pi_behav``: the synchronous
  on-policy case, where the behaviour policy is the old policy;
- ``gspo`` — decoupled PPO at the sequence level (GSPO, Zheng et al. 2025, arXiv:2507.18071,
  eq. 7 and its token form GSPO-token, eq. 10, with AReaL's proximal policy): per sample ``i``,
  ``u_i = exp(mean_t (log pi_theta - log pi_prox))`` enters every token of ``i`` as
  ``sg(u_i) * pi_theta_t / sg(pi_theta_t)`` and is clipped like a token ratio, and the behaviour
  weight is the sequence's geometric mean ``w_i = min(exp(mean_t (log pi_prox - log pi_behav)),
  cap)``: one weight per sample, so a single token whose probability moved a lot between the
  behaviour and the proximal policy no longer gets a weight of its own (the per-token weights
  of ``decoupled`` reach the cap on such tokens). Needs ``LossInputs.sample_index``.

``importance_weight_mode`` (``decoupled``, ``tis`` and ``gspo``): ``truncate`` multiplies by
``min(w, cap)`` (IMPALA's truncation; Yao et al. 2025's TIS for the rollout/trainer mismatch);
``mask`` drops from the loss every token whose weight lies outside ``[1/cap, cap]`` and uses the
weight unchanged inside (masked importance sampling: the Ring-1T report's IcePop, arXiv:2510.18855,
masks tokens outside ``[0.5, 5]``; Liu et al. 2025, "When Speed Kills Stability", the
sequence-level variant), so a token that the behaviour policy sampled where the current policy
no longer would is not trained at all instead of being trained at the cap.

Dual clip (Ye et al. 2020, *Mastering Complex Control in MOBA Games*, eq. 5): for ``A < 0`` the
clipped objective is further bounded, ``pg = min(pg, -c A)``.

KL to a frozen reference (Schulman 2020, *Approximating KL Divergence*), with
``log_r = log pi_ref - log pi_theta`` on tokens sampled from the policy: ``k1 = -log_r``,
``k2 = log_r^2 / 2``, ``k3 = exp(log_r) - 1 - log_r`` (GRPO uses k3). Entropy bonus:
``-entropy_coef * H_t``. Total: ``loss = sum_t weight_t (pg_t + kl_coef kl_t - entropy_coef H_t)``.

Diagnostics returned as sums (so they add up over micro-batches and ranks): clipped tokens,
dual-clipped tokens, the behaviour importance weight (``pi_prox/pi_behav`` for decoupled,
``pi_theta/pi_behav`` otherwise; before the cap) sum/max and capped count, the ratio used for
early stopping, and the behaviour-vs-trainer KL (k3 of ``log pi_behav - log pi_trainer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "LossInputs",
    "LossSettings",
    "ppo_clip_terms",
    "kl_penalty",
    "policy_loss",
    "token_logprobs_and_entropy",
    "aggregation_weights",
]

Correction = Literal["decoupled", "tis", "mask_stale", "none", "gspo"]


@dataclass
class LossSettings:
    """Loss knobs (a plain copy of ``trainer.loss`` so the maths does not import the config)."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    dual_clip_c: float | None = 3.0
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    correction: Correction = "decoupled"
    importance_weight_cap: float = 5.0
    importance_weight_mode: Literal["truncate", "mask"] = "truncate"

    @classmethod
    def from_config(cls, loss_cfg) -> "LossSettings":
        """Copy the fields of ``asyncrl.core.config.LossConfig``."""
        return cls(**{f: getattr(loss_cfg, f) for f in cls.__dataclass_fields__})


@dataclass
class LossInputs:
    """Per-token inputs of one micro-batch; every tensor has shape (T,), fp32 unless stated.

    Attributes:
        logprobs: log pi_theta of each response token (requires grad).
        behaviour_logprobs: log pi_behav reported by the rollout engine.
        advantages: advantage of each token.
        weight: aggregation weight (already 0 for masked tokens; see :func:`aggregation_weights`).
        prox_logprobs: log pi_prox (weights at the start of the step); required for ``decoupled``.
        ref_logprobs: log pi_ref of the frozen reference model; required when ``kl_coef > 0``.
        entropy: per-token entropy of pi_theta (with grad when ``entropy_coef > 0``).
        sample_index: (T,) int64, the sample each token belongs to (any ids, shared by the tokens
            of one sample); required for ``gspo``.
    """

    logprobs: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    weight: torch.Tensor
    prox_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    sample_index: torch.Tensor | None = None


def token_logprobs_and_entropy(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log-probabilities of ``targets`` under ``softmax(logits / temperature)``, and entropy.

    Args:
        logits_NV: (N, V) logits in any dtype (cast to fp32 here).
        targets_N: (N,) token ids.
        temperature: sampling temperature of the rollout (behaviour logprobs use the same).
        with_entropy: also return the (N,) entropy ``H = logsumexp(x) - sum softmax(x) x``.

    Returns:
        ``(logprobs_N, entropy_N or None)``, fp32.
    """
    x = logits_NV.float()
    if temperature != 1.0:
        x = x / temperature
    lse = torch.logsumexp(x, dim=-1)
    logprobs = x.gather(-1, targets_N.long().unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        entropy = lse - (torch.softmax(x, dim=-1) * x).sum(-1)
    return logprobs, entropy


def aggregation_weights(
    mask_T: torch.Tensor, sample_index_T: torch.Tensor, mode: Literal["token", "sequence"],
    total_tokens: float, total_samples: float,
) -> torch.Tensor:
    """Per-token aggregation weights for a micro-batch, normalised over the whole mini-batch.

    Args:
        mask_T: (T,) 0/1 loss mask.
        sample_index_T: (T,) index of each token's sample (any ids; tokens of one sample share one).
        mode: ``token`` (``mask / total_tokens``) or ``sequence`` (``mask / (|o_i| total_samples)``).
        total_tokens: loss tokens in the whole mini-batch (all micro-batches and ranks).
        total_samples: samples with at least one loss token in the whole mini-batch.

    Returns:
        (T,) fp32 weights; all zero when the mini-batch has no loss token.
    """
    mask = mask_T.float()
    if mode == "token":
        return mask / total_tokens if total_tokens > 0 else torch.zeros_like(mask)
    if mode != "sequence":
        raise ValueError(f"aggregation must be 'token' or 'sequence', got {mode!r}")
    if total_samples <= 0:
        return torch.zeros_like(mask)
    _, inverse = torch.unique(sample_index_T, return_inverse=True)
    per_sample = torch.zeros(int(inverse.max()) + 1 if inverse.numel() else 0).index_add_(0, inverse, mask)
    return mask / (per_sample[inverse].clamp(min=1.0) * total_samples)


def ppo_clip_terms(
    ratio_T: torch.Tensor, advantages_T: torch.Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token, with clip-higher and dual clip.

    ``pg = max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``; with dual clip ``c`` and ``A < 0``,
    ``pg = min(pg, -c A)`` (Schulman et al. 2017; DAPO clip-higher; Ye et al. 2020 dual clip).

    Args:
        ratio_T: (T,) importance ratio (with grad).
        advantages_T: (T,) advantages.

    Returns:
        ``(pg_T, clipped_T, dual_clipped_T)``: the per-token loss and two bool masks telling where
        the clip and the dual clip were active (the gradient through the ratio is 0 there).
    """
    pg1 = -advantages_T * ratio_T
    pg2 = -advantages_T * ratio_T.clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = pg2 > pg1
    pg = torch.maximum(pg1, pg2)
    dual = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        pg3 = -advantages_T * dual_clip_c
        dual = (advantages_T < 0) & (pg > pg3)
        pg = torch.where(advantages_T < 0, torch.minimum(pg, pg3), pg)
    return pg, clipped, dual


def kl_penalty(logprobs_T: torch.Tensor, ref_logprobs_T: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by pi_theta (Schulman 2020).

    With ``log_r = ref - logprobs``: ``k1 = -log_r``, ``k2 = log_r^2 / 2``, ``k3 = exp(log_r) - 1 - log_r``.

    Returns:
        (T,) KL estimates (differentiable in ``logprobs_T``).

    Raises:
        ValueError: unknown estimator.
    """
    log_r = ref_logprobs_T - logprobs_T
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"kl_estimator must be k1, k2 or k3, got {estimator!r}")


def sequence_mean(values_T: torch.Tensor, sample_index_T: torch.Tensor, active_T: torch.Tensor) -> torch.Tensor:
    """Each token's sample mean of ``values`` over the sample's active tokens, broadcast back to tokens.

    Args:
        values_T: (T,) per-token values (e.g. log-ratios; gradients flow through).
        sample_index_T: (T,) the sample of each token (any ids).
        active_T: (T,) bool, the tokens that count (loss tokens); a sample without one gets 0.

    Returns:
        (T,) ``mean_{t' in sample(t), active} values_t'`` for every token t.
    """
    if values_T.numel() == 0:
        return values_T
    _, inverse = torch.unique(sample_index_T, return_inverse=True)
    n = int(inverse.max()) + 1
    act = active_T.to(values_T.dtype)
    sums = torch.zeros(n, dtype=values_T.dtype).index_add(0, inverse, values_T * act)
    counts = torch.zeros(n, dtype=values_T.dtype).index_add(0, inverse, act).clamp(min=1.0)
    return (sums / counts)[inverse]


def _weigh(imp_weight: torch.Tensor, cap: float, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The behaviour weight as applied, and the tokens it leaves in the loss (see the module docstring)."""
    if mode == "truncate":
        return imp_weight.clamp(max=cap), torch.ones_like(imp_weight, dtype=torch.bool)
    if mode == "mask":
        keep = (imp_weight >= 1.0 / cap) & (imp_weight <= cap)
        return torch.where(keep, imp_weight, torch.zeros_like(imp_weight)), keep
    raise ValueError(f"importance_weight_mode must be 'truncate' or 'mask', got {mode!r}")


def policy_loss(inputs: LossInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's contribution to the mini-batch loss, and summed diagnostics.

    Args:
        inputs: per-token tensors of the micro-batch (see :class:`LossInputs`).
        s: loss settings.

    Returns:
        ``(loss, sums)``: the scalar loss ``sum_t weight_t * (pg_t + kl_coef kl_t - entropy_coef H_t)``
        and a dict of sums over the micro-batch's loss tokens (``tokens``, ``clipped_tokens``,
        ``dual_clipped_tokens``, ``imp_weight_sum``, ``imp_weight_max``, ``imp_weight_capped``,
        ``imp_weight_masked`` (tokens ``mask`` mode removed), ``ratio_sum``, ``behaviour_kl_sum``, ``entropy_sum``, ``ref_kl_sum``, ``pg_loss``,
        ``kl_loss``, ``entropy_loss``), combined across micro-batches by the trainer.

    Raises:
        ValueError: ``decoupled`` without ``prox_logprobs``, ``gspo`` without ``prox_logprobs`` or
            ``sample_index``, an unknown ``importance_weight_mode``, or ``kl_coef > 0`` without ``ref_logprobs``.
    """
    logp, behav, adv, w = inputs.logprobs, inputs.behaviour_logprobs, inputs.advantages, inputs.weight
    active = w > 0
    cap = s.importance_weight_cap
    if s.correction == "decoupled":
        if inputs.prox_logprobs is None:
            raise ValueError("correction 'decoupled' needs prox_logprobs (the weights at the start of the step)")
        prox = inputs.prox_logprobs.detach()
        ratio = torch.exp(logp - prox)
        imp_weight = torch.exp(prox - behav)
        pg, clipped, dual = ppo_clip_terms(ratio, adv, s.clip_eps_low, s.clip_eps_high, s.dual_clip_c)
        applied, kept = _weigh(imp_weight, cap, s.importance_weight_mode)
        pg = pg * applied
        trainer_logp = prox
    elif s.correction == "gspo":
        if inputs.prox_logprobs is None or inputs.sample_index is None:
            raise ValueError("correction 'gspo' needs prox_logprobs and sample_index")
        prox = inputs.prox_logprobs.detach()
        seq_log_u = sequence_mean(logp - prox, inputs.sample_index, active)
        ratio = torch.exp(seq_log_u.detach()) * torch.exp(logp - logp.detach())  # GSPO-token, eq. 10
        imp_weight = torch.exp(sequence_mean(prox - behav, inputs.sample_index, active))
        pg, clipped, dual = ppo_clip_terms(ratio, adv, s.clip_eps_low, s.clip_eps_high, s.dual_clip_c)
        applied, kept = _weigh(imp_weight, cap, s.importance_weight_mode)
        pg = pg * applied
        trainer_logp = prox
    elif s.correction == "tis":
        ratio = torch.exp(logp - behav)
        imp_weight = ratio.detach()
        applied, kept = _weigh(imp_weight, cap, s.importance_weight_mode)
        pg = -applied * adv * logp
        clipped = torch.zeros_like(active)
        dual = torch.zeros_like(active)
        trainer_logp = logp.detach()
    elif s.correction in ("mask_stale", "none"):
        ratio = torch.exp(logp - behav)
        imp_weight = ratio.detach()
        pg, clipped, dual = ppo_clip_terms(ratio, adv, s.clip_eps_low, s.clip_eps_high, s.dual_clip_c)
        kept = torch.ones_like(active)
        trainer_logp = logp.detach()
    else:
        raise ValueError(f"unknown correction {s.correction!r}; choose decoupled, tis, mask_stale, none or gspo")
    if s.importance_weight_mode == "mask":
        w = w * kept  # masked tokens leave the loss (and its KL and entropy terms)

    per_token = pg
    kl_sum = 0.0
    kl_loss = torch.zeros((), dtype=torch.float32)
    if s.kl_coef > 0:
        if inputs.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs from the frozen reference model")
        kl = kl_penalty(logp, inputs.ref_logprobs.detach(), s.kl_estimator)
        per_token = per_token + s.kl_coef * kl
        kl_loss = (w * kl).sum() * s.kl_coef
        kl_sum = float(kl.detach()[active].sum())
    entropy_loss = torch.zeros((), dtype=torch.float32)
    if s.entropy_coef > 0:
        if inputs.entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        per_token = per_token - s.entropy_coef * inputs.entropy
        entropy_loss = -(w * inputs.entropy).sum() * s.entropy_coef
    loss = (w * per_token).sum()

    with torch.no_grad():
        iw = imp_weight.detach()[active]
        log_mismatch = (behav - trainer_logp)[active]  # log pi_behav - log pi_trainer
        sums = {
            "tokens": float(active.sum()),
            "clipped_tokens": float(clipped[active].sum()),
            "dual_clipped_tokens": float(dual[active].sum()),
            "imp_weight_sum": float(iw.sum()),
            "imp_weight_max": float(iw.max()) if iw.numel() else 0.0,
            "imp_weight_capped": float((iw > cap).sum()),
            "imp_weight_masked": float((~kept.detach()[active]).sum()),
            "ratio_sum": float(ratio.detach()[active].sum()),
            "behaviour_kl_sum": float((torch.exp(-log_mismatch) - 1.0 + log_mismatch).sum()),
            "entropy_sum": float(inputs.entropy.detach()[active].sum()) if inputs.entropy is not None else 0.0,
            "ref_kl_sum": kl_sum,
            "pg_loss": float((w * pg).detach().sum()),
            "kl_loss": float(kl_loss.detach()),
            "entropy_loss": float(entropy_loss.detach()),
        }
    return loss, sums
