"""The ``trainer.*`` section of the config: the loss, the optimizer, the critic of PPO with GAE, KL control,
the reference model, LoRA, and the trainer's own knobs (docs/trainer.md).

Its own module beside :mod:`asyncrl.core.config_sections` (which had grown past 600 lines); import it
from :mod:`asyncrl.core.config`, like every section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.core.choices import ADVANTAGE_ESTIMATORS
from asyncrl.core.config_sections import _Section

__all__ = ["LossConfig", "OptimizerConfig", "GAEConfig", "CriticConfig", "KLControlConfig", "ReferenceConfig", "LoraConfig", "TrainerConfig"]


class LossConfig(_Section):
    """The policy loss: clipping, off-policy correction, aggregation, KL and entropy terms (``trainer.loss.*``)."""

    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0)
    """PPO clip: ratio lower bound 1 - eps_low."""
    clip_eps_high: float = Field(0.28, gt=0.0, le=10.0)
    """PPO clip upper bound 1 + eps_high (DAPO clip-higher; set equal to eps_low for plain PPO)."""
    dual_clip_c: float | None = Field(3.0, gt=1.0)
    """Dual clip constant c > 1 bounding the loss of negative-advantage tokens (None: off)."""
    aggregation: Literal["token", "sequence"] = "token"
    """Token-level mean over all tokens of the batch (DAPO) or mean of per-sequence means (GRPO)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Coefficient of the KL penalty to a frozen reference model (0: no reference model is loaded)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman, 'Approximating KL divergence')."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus coefficient."""
    mask_no_eos_with_zero: bool = False
    """Give samples that did not end with EOS (truncated) reward 0 before advantage estimation (AReaL)."""
    mask_too_long: bool = False
    """Drop samples that reached ``max_response_len`` from the loss."""
    overlong_buffer_len: int = Field(0, ge=0, le=1_000_000)
    """L_cache of DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, section 3.4): a response longer than ``max_response_len - L_cache`` tokens gets ``overlong_penalty_factor * ((L_max - L_cache) - |y|) / L_cache`` added to its reward (reaching -1 x factor at L_max = ``rollout.max_response_len``). 0: off; must be below ``max_response_len``."""
    overlong_penalty_factor: float = Field(1.0, gt=0.0, le=100.0)
    """Scale of the soft overlong penalty (verl's ``overlong_buffer.penalty_factor``; DAPO uses 1)."""
    correction: Literal["decoupled", "tis", "mask_stale", "none", "gspo"] = "decoupled"
    """Off-policy correction for stale tokens: decoupled PPO (AReaL), truncated IS, masking old-version tokens, none, or ``gspo`` (decoupled PPO with sequence-level ratios and behaviour weights: GSPO, arXiv:2507.18071; trainer/losses.py)."""
    importance_weight_cap: float = Field(5.0, gt=1.0)
    """Cap of the behaviour importance weight pi_prox/pi_behav (decoupled; the sequence's geometric mean for gspo) or pi/pi_behav (tis)."""
    importance_weight_mode: Literal["truncate", "mask"] = "truncate"
    """How the behaviour weight is bounded: ``truncate`` uses min(w, cap) (TIS); ``mask`` drops tokens whose weight is outside [1/cap, cap] from the loss and keeps w inside (masked IS, IcePop: arXiv:2510.18855)."""


class OptimizerConfig(_Section):
    """AdamW and the learning-rate schedule (``trainer.optimizer.*``)."""

    lr: float = Field(1e-6, gt=0.0, lt=1.0)
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Gradient-norm clip (always set explicitly; DeepSpeed's default changed in v0.19.3). 0 disables."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """LR schedule owned by the training loop."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""


class GAEConfig(_Section):
    """Generalised advantage estimation (``trainer.gae.*``, ``advantage: gae``)."""

    discount: float = Field(1.0, ge=0.0, le=1.0)
    """gamma of GAE (Schulman et al. 2016); AReaL ``discount``."""
    gae_lambda: float = Field(1.0, ge=0.0, le=1.0)
    """lambda of GAE: 1 = Monte-Carlo returns minus the value, 0 = one-step TD; AReaL ``gae_lambda``."""


class CriticConfig(_Section):
    """The value model of ``advantage: gae`` (``trainer.critic.*``)."""

    model_path: str | None = None
    """The critic's initial weights: a model name or directory whose backbone loads as a value model (token classification, one label). None: the actor's ``model.path`` with a new value head."""
    optimizer: OptimizerConfig = OptimizerConfig(lr=5e-6)
    """The critic's own AdamW and LR schedule (same optimizer-step count as the actor's)."""
    value_eps_clip: float | None = Field(0.2, gt=0.0)
    """Clip of the value update around the values the returns were computed from (AReaL ``value_eps_clip``, OpenRLHF ``value_clip``); None: unclipped."""
    value_norm: bool = True
    """The critic predicts normalised values: denormalised for GAE, returns normalised as targets (AReaL ``value_norm``)."""
    value_norm_type: Literal["exp", "ma"] = "exp"
    """Running statistics of value normalisation: debiased exponential moving average or the plain running mean (AReaL)."""
    value_norm_beta: float = Field(0.99995, gt=0.0, lt=1.0)
    """Decay of the ``exp`` statistics."""
    value_norm_eps: float = Field(1e-5, gt=0.0)
    """Clamp of the ``exp`` debiasing term."""


class KLControlConfig(_Section):
    """The KL penalty in the reward and its adaptive coefficient (``trainer.kl_ctl.*``)."""

    coef: float = Field(0.0, ge=0.0)
    """beta of the per-token KL penalty in the reward, ``r_t -= beta (log pi_behav - log pi_ref)`` (AReaL ``kl_ctl``; needs ``trainer.advantage: gae``). Separate from ``trainer.loss.kl_coef``, the KL loss term."""
    adaptive: bool = False
    """Adapt beta toward ``adaptive_target`` (Ziegler et al. 2019; AReaL ``use_adaptive_kl_ctl``)."""
    adaptive_target: float = Field(6.0, gt=0.0)
    """Target KL per sample (nats, summed over its tokens)."""
    adaptive_horizon: int = Field(10_000, ge=1)
    """Samples over which beta may move by 20%."""


class ReferenceConfig(_Section):
    """The reference model of the KL terms (``trainer.reference.*``)."""

    model_path: str | None = None
    """The reference model's weights (the KL loss term and the KL penalty in the reward). None: the actor's initial weights (``model.path``)."""
    ema_eta: float | None = Field(None, gt=0.0, le=1.0)
    """After each train step the reference follows the actor: ``ref <- eta * actor + (1 - eta) * ref`` (AReaL's ``ref_ema_eta``); None: frozen."""


class LoraConfig(_Section):
    """A PEFT LoRA adapter trained on the actor instead of all its weights (``trainer.lora``; docs/trainer.md#lora)."""

    rank: int = Field(16, ge=1, le=1024)
    """Rank r of each adapter (``peft.LoraConfig.r``)."""
    alpha: float = Field(32.0, gt=0.0)
    """Scale numerator: the update is ``(alpha / rank) * B @ A`` (``peft.LoraConfig.lora_alpha``)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input in training forward passes (``peft.LoraConfig.lora_dropout``). Keep 0 for RL: the rollout engine has no dropout, so any makes the trained logprobs differ from the behaviour policy's."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"], min_length=1)
    """Names (suffixes) of the ``nn.Linear`` modules that get an adapter (``peft.LoraConfig.target_modules``); the default is every projection of a Llama-style block."""


class TrainerConfig(_Section):
    """The DeepSpeed trainer, advantages and loss (``trainer.*``)."""

    advantage: Literal[ADVANTAGE_ESTIMATORS] = "grpo"
    """Advantage estimator: the critic-free group/batch baselines, or ``gae`` (PPO with a critic, ``trainer.critic``)."""
    adv_norm: bool = False
    """Normalise the advantages over the train batch's loss tokens (mean 0, std 1) after the estimator, for every estimator (AReaL ``adv_norm``, on by default there)."""
    precomputed_advantages: Literal["replace", "add"] = "replace"
    """Advantages a workflow or hook sets on samples (e.g. OPSD's per-token log-ratios): ``replace`` = used instead of the estimator (rllm's precomputed path); ``add`` = added to the estimator's advantage from the rewards (dense shaping on top of GRPO; not with ``gae``)."""
    gae: GAEConfig = GAEConfig()
    """Discount and lambda of GAE (``advantage: gae``)."""
    critic: CriticConfig = CriticConfig()
    """The value model, its optimizer and value normalisation (``advantage: gae``)."""
    kl_ctl: KLControlConfig = KLControlConfig()
    """The per-token KL penalty in the reward and its adaptive coefficient (``advantage: gae``)."""
    reference: ReferenceConfig = ReferenceConfig()
    """The reference model: its weights and whether it follows the actor."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter (PEFT) instead of the full weights, and publish only the adapter (docs/trainer.md#lora). None: full fine-tuning. The reference is then the base model with the adapter disabled (no second copy)."""
    loss: LossConfig = LossConfig()
    """PPO-family loss and off-policy correction."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW and LR schedule."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch (samples are packed by token count, no padding)."""
    share_prompts: bool = True
    """Process a prompt group's shared prompt once per micro-batch in the trainer's forward and backward passes (Prefix Grouper, arXiv 2506.05433; exact: same logprobs and gradients). Needs the sdpa or eager attention implementation; false: every sample carries its own prompt."""
    attention: Literal["blocks", "row"] = "blocks"
    """How the trainer's forward and backward passes attend over a packed micro-batch: ``blocks`` attends each block (a sample, or a shared-prompt group) alone, Σ ℓ² work (varlen attention, trainer/attention.py); ``row`` attends over the whole packed row with a block-diagonal mask, L² work. Same logprobs and gradients; docs/trainer.md measures both. ``blocks`` needs a model loaded with sdpa or eager attention (else the trainer logs a warning and uses ``row``)."""
    ppo_n_minibatches: int = Field(1, ge=1)
    """Optimizer steps per train batch (the batch is split into this many mini-batches)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over the train batch."""
    early_stop_imp_ratio: float | None = Field(None, gt=1.0)
    """Skip remaining mini-batches of a batch when the mean importance ratio exceeds this bound."""
    zero_stage: int = Field(0, ge=0, le=3)
    """DeepSpeed ZeRO stage."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Training precision (logprobs are always computed in fp32)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass."""
    heap_mmap_threshold_bytes: int | None = Field(None, ge=4096, le=32 << 20)
    """On glibc, host allocations of at least this many bytes get their own mapping, unmapped when freed (``mallopt(M_MMAP_THRESHOLD)``, trainer/memory.py): a step's freed activations go back to the system instead of staying in malloc's heap for the rest of the run. None (the default): glibc's dynamic threshold (the heap keeps a step's high-water mark; docs/trainer.md#lora). 1048576 (1 MiB) gave back the 5.6 GB the heap held free between long-tail steps but made the steps 23-27% slower (page faults; docs/trainer.md, "Memory per step", one reading)."""
    checkpoint_interval: int = Field(10, ge=1)
    """Save a checkpoint (and commit the buffer) every this many steps."""
    batch_wait_seconds: float = Field(3600.0, ge=1.0, le=604800.0)
    """Longest wait for one train batch; past it the trainer exits 1 naming the step and the buffer's state, instead of hanging silently (rollout servers dead or stuck)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    world_size: int = Field(1, ge=1)
    """Trainer ranks ``asyncrl train`` launches (torchrun) on one machine."""
    external: bool = False
    """The trainer runs elsewhere (its own Kubernetes Job, configs/k8s): ``asyncrl train`` launches no trainer and only feeds, supervises its local roles and reports."""
