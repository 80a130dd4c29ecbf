"""The critic of PPO with GAE: a value model trained beside the policy on the trainer ranks.

``trainer.advantage: gae`` turns it on. The critic is a transformers token-classification
model with one label — the actor's architecture (or ``trainer.critic.model_path``'s) with a
scalar value head (``score``) on the last hidden state — wrapped in its own DeepSpeed engine
(same ZeRO stage and precision as the actor, its own AdamW and learning rate), checkpointed and
restored with the actor.

A step (trainer/trainer.py calls these in order):

1. :meth:`Critic.estimate` in ``begin_step``: the *current* critic computes the value of every
   response token's state (no grad). With partial rollout and staleness a sample's tokens may
   come from older policies; their values are still the current critic's, recomputed at
   training time, as AReaL does — the critic is trained on the current batch, and a value
   stored at generation time would belong to a critic several updates old. Per-token rewards
   (:func:`trainer.kl_control.token_rewards`: the KL penalty ``kl_ctl`` against the reference,
   the score on the last token) and the values give GAE advantages and returns
   (:func:`trainer.value.gae`). The value after the last token is 0, also for a sample cut by
   the length cap (no bootstrap, as verl and OpenRLHF; AReaL bootstraps — the packed row does
   not hold the last token's state). With ``value_norm`` the critic predicts normalised values:
   they are denormalised for GAE, the statistics are updated with the returns, the returns are
   normalised to form the targets (AReaL's order).
2. :meth:`Critic.forward_backward` per micro-batch: the clipped value loss
   (:func:`trainer.value.value_loss`) around the values of step 1, token weights as the
   policy loss's aggregation, backward into the critic's engine.
3. :meth:`Critic.optim_step` after each policy optimizer step.

Across data-parallel ranks each rank computes values and GAE for the samples of its own
micro-batches; the statistics that need the whole batch (value normalisation, the adaptive KL
controller's mean KL, the explained variance) are all-reduced sums.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.kl_control import KLController, token_rewards
from trainer.packing import build_micro_batch, packed_values
from trainer.value import ValueNormalizer, gae, value_loss

log = logging.getLogger("asyncrl.trainer.critic")

__all__ = ["Critic", "CriticEstimate", "load_value_model"]


def load_value_model(name_or_path: str | Path) -> Any:
    """A transformers token-classification model with one label (the value head), fp32, on CPU.

    The backbone loads from a causal-LM checkpoint (its ``lm_head`` is ignored); the ``score``
    head is newly initialised (transformers' default init) unless the checkpoint has one (a
    critic saved by this trainer). Dropout is off (``classifier_dropout=0``).

    Raises:
        asyncrl.models.ModelNotFoundError / CorruptModelError: as :func:`asyncrl.models.resolve_model_path`,
            or the weights fail to load.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    from asyncrl.models import CorruptModelError, resolve_model_path

    path = resolve_model_path(name_or_path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights newly initialised: score.*" is expected here
    try:
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for bad files
        raise CorruptModelError(f"cannot load a value model from {path}: {type(exc).__name__}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    return model


@dataclass
class CriticEstimate:
    """What :meth:`Critic.estimate` leaves for the step: per sample index, the old values and targets."""

    old_values: dict[int, torch.Tensor] = field(default_factory=dict)
    """(T,) the critic's predictions at ``begin_step`` (normalised when value_norm is on)."""
    targets: dict[int, torch.Tensor] = field(default_factory=dict)
    """(T,) value targets: the GAE returns (normalised when value_norm is on)."""
    metrics: dict[str, float] = field(default_factory=dict)


class Critic:
    """The value model, its DeepSpeed engine, value normalisation and the KL coefficient.

    Args:
        cfg: the resolved :class:`asyncrl.core.config.AsyncRLConfig` (``trainer.critic``,
            ``trainer.gae``, ``trainer.kl_ctl`` sections).
        attn_implementation: the implementation to switch the critic to (the actor's, e.g.
            trainer/attention.py's block attention); None keeps the loaded one.
        all_reduce: ``all_reduce(values, op)`` over the data-parallel group (the trainer's).
        model: an already loaded value model instead of ``trainer.critic.model_path``.

    Raises:
        asyncrl.models.ModelNotFoundError / CorruptModelError: the critic's weights.
    """

    def __init__(self, cfg: Any, *, attn_implementation: str | None,
                 all_reduce: Callable[[list[float], str], list[float]], model: Any = None):
        from trainer.engine import GradNormProbe, build_engine

        c = cfg.trainer.critic
        self.cfg = cfg
        if model is None:
            model = load_value_model(c.model_path or cfg.model.path)
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
        engine_cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"optimizer": c.optimizer})})
        self.engine = build_engine(model, engine_cfg)
        self._grad_norm = GradNormProbe(self.engine)
        self.normalizer = ValueNormalizer(c.value_norm_type, c.value_norm_beta, c.value_norm_eps) if c.value_norm else None
        k = cfg.trainer.kl_ctl
        self.kl = KLController(k.coef, k.adaptive_target if k.adaptive else None, k.adaptive_horizon)
        self._all_reduce = all_reduce
        self.optimizer_steps = 0

    # ------------------------------------------------------------------ values and targets

    def _values(self, samples: list[Any], indices: list[int] | None, share_prompts: bool):
        mb = [samples[i] for i in indices] if indices is not None else []
        local = None if indices is None else list(range(len(indices)))
        packed = build_micro_batch([s.prompt_ids for s in mb], [s.response_ids for s in mb], local,
                                   share_prompts=share_prompts)
        return packed, packed_values(self.engine, packed).float()

    @torch.no_grad()
    def estimate(self, samples: list[Any], micro_batches: list[list[int] | None], ref_logprobs: dict[int, torch.Tensor],
                 share_prompts: bool, adv_norm: bool) -> CriticEstimate:
        """Values, token rewards, GAE advantages and value targets for this rank's samples.

        Sets ``samples[i].advantages`` ((T,) float32) for every sample of ``micro_batches``.

        Args:
            samples: the batch's :class:`trainer.batch.PreparedSample` list (``reward`` processed).
            micro_batches: this rank's micro-batches over all mini-batches (None: a padding slot).
            ref_logprobs: sample index -> (T,) reference log-probabilities (empty: no KL penalty).
            share_prompts: the layout of the policy's passes (same values either way).
            adv_norm: normalise the advantages over the batch's loss tokens (mean 0, std 1).

        Returns:
            the :class:`CriticEstimate` (old values, targets, metrics: ``value_mean``,
            ``return_mean``, ``explained_variance``, ``kl_ctl``, ``kl_penalty_per_sample``).
        """
        g = self.cfg.trainer.gae
        was_training = self.engine.training
        self.engine.eval()
        est = CriticEstimate()
        values: dict[int, torch.Tensor] = {}
        for indices in micro_batches:
            packed, v = self._values(samples, indices, share_prompts)
            for local, start, end in packed.token_offsets:
                values[indices[local]] = v[start:end].clone()
        self.engine.train(was_training)
        beta = self.kl.value
        returns: dict[int, torch.Tensor] = {}
        denormalized: dict[int, torch.Tensor] = {}
        kl_sum, n_local = 0.0, 0
        for i, predicted in values.items():
            smp = samples[i]
            ref = ref_logprobs.get(i)
            denorm = self.normalizer.denormalize(predicted) if self.normalizer is not None else predicted
            denormalized[i] = denorm
            rewards = token_rewards(smp.reward, smp.behaviour_logprobs, ref, beta)  # reward already clipped: data.reward_clip
            adv, ret = gae(rewards, denorm, 0.0, g.discount, g.gae_lambda)
            smp.advantages = adv
            returns[i] = ret
            est.old_values[i] = predicted
            if ref is not None:
                kl_sum += float((smp.behaviour_logprobs.double() - ref.double()).sum())
            n_local += 1
        # batch-wide moments (all ranks): returns, denormalised values, advantages, KL
        cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0))
        masks = {i: samples[i].loss_mask > 0 for i in values}
        r_all = cat([returns[i][masks[i]] for i in values]).double()
        v_all = cat([denormalized[i][masks[i]] for i in values]).double()
        a_all = cat([samples[i].advantages[masks[i]] for i in values]).double()
        sums = self._all_reduce([float(r_all.numel()), float(r_all.sum()), float(r_all.square().sum()),
                                 float((r_all - v_all).sum()), float((r_all - v_all).square().sum()),
                                 float(a_all.sum()), float(a_all.square().sum()), float(v_all.sum()),
                                 kl_sum, float(n_local)], "sum")
        n, s_r, s_r2, s_d, s_d2, s_a, s_a2, s_v, kl_total, n_samples = sums
        if self.normalizer is not None and n > 0:
            self.normalizer.update_moments(s_r, s_r2, n)
        for i in values:
            est.targets[i] = self.normalizer.normalize(returns[i]) if self.normalizer is not None else returns[i]
        if adv_norm and n > 0:
            mean = s_a / n
            std = max(s_a2 / n - mean * mean, 0.0) ** 0.5
            for i in values:
                samples[i].advantages = ((samples[i].advantages - mean) / (std + 1e-5)).float()
        var_r = s_r2 / n - (s_r / n) ** 2 if n > 0 else 0.0
        var_d = s_d2 / n - (s_d / n) ** 2 if n > 0 else 0.0
        mean_kl = kl_total / n_samples if n_samples else 0.0
        est.metrics = {
            "advantage_mean": s_a / n if n else 0.0,  # before adv_norm
            "advantage_std": max(s_a2 / n - (s_a / n) ** 2, 0.0) ** 0.5 if n else 0.0,
            "value_mean": s_v / n if n else 0.0,
            "return_mean": s_r / n if n else 0.0,
            "explained_variance": 1.0 - var_d / var_r if var_r > 0 else float("nan"),
            "kl_ctl": beta,
            "kl_penalty_per_sample": mean_kl,
        }
        if self.cfg.trainer.kl_ctl.coef > 0:  # a config fact, the same on every rank (a rank may hold no sample)
            self.kl.update(mean_kl, int(n_samples))
        return est

    # ------------------------------------------------------------------ training

    def forward_backward(self, packed: Any, indices: list[int] | None, est: CriticEstimate,
                         weights: torch.Tensor, world_size: int) -> dict[str, float]:
        """The clipped value loss on one micro-batch, backward into the critic's engine.

        Args:
            packed: the micro-batch as the policy's pass packed it
                (:class:`trainer.packing.PackedMicroBatch`; the critic reads the same layout).
            indices: the micro-batch's sample indices (None: a padding slot, runs an empty pass
                so every rank calls the engine alike).
            est: from :meth:`estimate`.
            weights: (T,) token weights of the micro-batch in the packed order (the policy
                loss's aggregation weights, loss mask included).
            world_size: data-parallel ranks (the loss is scaled by it, as the policy's).

        Returns:
            sums for the step's metrics: ``value_loss`` (weighted), ``value_clipped_tokens``,
            ``value_tokens``.
        """
        self.engine.train()
        values = packed_values(self.engine, packed).float()
        if indices is None or not packed.token_offsets:
            self.engine.backward(values.sum() * 0.0, scale_wrt_gas=False)
            return {"value_loss": 0.0, "value_clipped_tokens": 0.0, "value_tokens": 0.0}
        order = [indices[local] for local, _, _ in packed.token_offsets]
        old = torch.cat([est.old_values[i] for i in order])
        targets = torch.cat([est.targets[i] for i in order])
        loss, stats = value_loss(values, old, targets, weights, self.cfg.trainer.critic.value_eps_clip)
        self.engine.backward(loss * world_size, scale_wrt_gas=False)
        n = float(values.numel())
        return {"value_loss": float(loss.detach()), "value_clipped_tokens": stats["clip_fraction"] * n,
                "value_tokens": n}

    def optim_step(self, total_optimizer_steps: int) -> dict[str, float]:
        """One AdamW step of the critic (its own LR schedule over the same optimizer-step count)."""
        from trainer.engine import lr_at

        opt = self.cfg.trainer.critic.optimizer
        lr = lr_at(self.optimizer_steps, opt, total_optimizer_steps)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        self._grad_norm.reset()
        self.engine.step()
        self.optimizer_steps += 1
        return {"critic_grad_norm": self._grad_norm.read(), "critic_lr": lr}

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict[str, Any]:
        """JSON-able state beside the critic's weights: value normaliser, KL coefficient, step count."""
        return {"normalizer": self.normalizer.state_dict() if self.normalizer is not None else None,
                "kl": self.kl.state_dict(), "optimizer_steps": self.optimizer_steps}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state`'s output (a normaliser state is required when value_norm is on).

        Raises:
            ValueError: the checkpoint lacks the value normaliser the config asks for, or its kind differs.
        """
        if self.normalizer is not None:
            if state.get("normalizer") is None:
                raise ValueError("the checkpoint's critic has no value normaliser but trainer.critic.value_norm is on")
            self.normalizer.load_state_dict(state["normalizer"])
        self.kl.load_state_dict(state["kl"])
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
