"""The KL penalty in the reward (classic RLHF) and its fixed or adaptive coefficient.

This is separate from the KL *loss term* of ``trainer.loss.kl_coef`` (GRPO's formulation,
trainer/losses.py): here the KL to the reference model is subtracted from the per-token reward
before advantages are estimated, as in Ziegler et al. 2019 and Ouyang et al. 2022 (InstructGPT),
AReaL's PPO (``kl_ctl``) and OpenRLHF (``init_kl_coef``).

Sources:

- Token rewards: ``r_t = -beta (log pi(a_t|s_t) - log pi_ref(a_t|s_t))`` on every response
  token, plus the sequence score ``clip(score, -max_reward_clip, max_reward_clip)`` on the last
  (AReaL ``ppo_interface``: ``kl_rewards`` and ``max_reward_clip``).
- Adaptive coefficient: Ziegler et al. 2019, *Fine-Tuning Language Models from Human
  Preferences*, §2.2: ``e = clip(KL / KL_target - 1, -0.2, 0.2)``,
  ``beta <- beta (1 + e n / horizon)`` after a batch of n samples whose mean KL (summed over
  each sample's tokens) is ``KL`` (``AdaptiveKLController`` in OpenAI's lm-human-preferences,
  AReaL and OpenRLHF).
"""

from __future__ import annotations

import math

import torch

__all__ = ["token_rewards", "KLController"]


def token_rewards(score: float, logprobs_T: torch.Tensor, ref_logprobs_T: torch.Tensor | None, kl_coef: float,
                  max_reward_clip: float | None = None) -> torch.Tensor:
    """Per-token rewards of one sample: the KL penalty on every token, the clipped score on the last.

    Args:
        score: the sample's sequence reward (after the reward shaping of ``process_rewards``).
        logprobs_T: (T,) log-probabilities of the response tokens under the policy that produced
            the sample (its behaviour log-probabilities), no grad.
        ref_logprobs_T: (T,) the reference model's log-probabilities of the same tokens; None
            when there is no reference (then no KL term).
        kl_coef: beta >= 0 (the controller's current value).
        max_reward_clip: clip the score to [-c, c]; None: no clip.

    Returns:
        (T,) float32 rewards.

    Raises:
        ValueError: T = 0, shapes differ, beta < 0, or a non-finite input.
    """
    if logprobs_T.dim() != 1 or logprobs_T.numel() == 0:
        raise ValueError(f"token_rewards: logprobs must be 1-D and non-empty, got {tuple(logprobs_T.shape)}")
    if kl_coef < 0 or not math.isfinite(kl_coef) or not math.isfinite(score):
        raise ValueError(f"token_rewards: kl_coef must be finite and >= 0 and the score finite, got {kl_coef}, {score}")
    rewards = torch.zeros(logprobs_T.numel(), dtype=torch.float64)
    if ref_logprobs_T is not None and kl_coef > 0:
        if ref_logprobs_T.shape != logprobs_T.shape:
            raise ValueError(f"token_rewards: reference logprobs {tuple(ref_logprobs_T.shape)} != "
                             f"logprobs {tuple(logprobs_T.shape)}")
        rewards -= kl_coef * (logprobs_T.detach().double() - ref_logprobs_T.detach().double())
    if max_reward_clip is not None:
        score = min(max(score, -max_reward_clip), max_reward_clip)
    rewards[-1] += score
    if not torch.isfinite(rewards).all():
        raise ValueError("token_rewards: non-finite log-probabilities")
    return rewards.float()


class KLController:
    """The KL coefficient beta: fixed, or adapted toward a target KL (Ziegler et al. 2019, §2.2).

    Args:
        init: beta at step 0 (``kl_ctl``), >= 0.
        target: the target KL per sample (nats, summed over its tokens); None: fixed beta.
        horizon: adaptation horizon in samples (> 0): beta moves by at most 20% per ``horizon``
            samples.

    Raises:
        ValueError: init < 0, target <= 0, horizon <= 0.
    """

    def __init__(self, init: float, target: float | None = None, horizon: int = 10_000):
        if init < 0 or not math.isfinite(init):
            raise ValueError(f"kl_ctl must be finite and >= 0, got {init}")
        if target is not None and not target > 0:
            raise ValueError(f"adaptive_kl_target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"adaptive_kl_horizon must be > 0, got {horizon}")
        self.value, self.target, self.horizon = float(init), target, int(horizon)

    @property
    def adaptive(self) -> bool:
        """True when beta follows the target KL."""
        return self.target is not None

    def update(self, mean_kl: float, n_samples: int) -> float:
        """Fold one train batch in: ``beta *= 1 + clip(KL / target - 1, -0.2, 0.2) n / horizon``.

        Args:
            mean_kl: the batch's mean per-sample KL (nats, summed over tokens).
            n_samples: the number of samples in the batch.

        Returns:
            The new beta (unchanged when fixed, or when mean_kl is not finite).
        """
        if self.target is None or not math.isfinite(mean_kl):
            return self.value
        error = min(max(mean_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        """The current beta, for the trainer's checkpoint."""
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore beta from :meth:`state_dict`'s output."""
        self.value = float(state["value"])
