"""The typed configuration tree shared by every asyncrl role.

One pydantic(-settings) model, :class:`AsyncRLConfig`, covers every role (rollout server,
buffer, trainer, controller). Each knob is owned by the sub-model of the component that uses
it, carries a docstring (shown by ``--help``) and its bounds (``Field``); rules that involve
several fields are validators on the root model.

Sources, highest priority first (see :func:`load_config`):

1. CLI flags: the headline knobs exactly as users type them elsewhere
   (``--partial_percent 0.7 --max_budget 1024 --max_staleness 2``), and dotted paths for any
   nested field (``--rollout.temperature 0.8``);
2. ``ASYNCRL_*`` environment variables, ``__`` between nesting levels
   (``ASYNCRL_ROLLOUT__TEMPERATURE=0.8``);
3. a YAML file (``--config F``);
4. the defaults below.

Unknown keys and flags are errors. The meaning of ``partial_percent``, ``max_budget`` and
``max_staleness`` is defined in ``docs/architecture.md`` (the three knobs) and explained in
``docs/concepts.md``.
"""

from __future__ import annotations

import math
import os
import warnings
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "AsyncRLConfig",
    "ConfigError",
    "load_config",
    "HEADLINE_FLAGS",
    "train_batch_groups",
]


def train_batch_groups(partial_percent: float, rollout_batch_size: int) -> int:
    """B = ⌈p·R⌉: prompt groups per train batch for ``--partial_percent`` p and rollout batch size R.

    The one definition of the formula (docs/architecture.md#the-three-knobs); the config
    (``rollout.train_batch_groups``) and the buffer (``BufferSettings.from_partial_percent``) both
    call it. At least 1; the ``1e-9`` keeps p·R that is an integer up to float rounding (0.7 · 10)
    from rounding up.
    """
    return max(1, math.ceil(partial_percent * rollout_batch_size - 1e-9))


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and what to fix."""


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


# ----------------------------------------------------------------------------------------------
# run / model / data


class RunConfig(_Section):
    name: str = Field("asyncrl", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Run name; the Redis key prefix is ``asyncrl:{<name>}:`` and the run directory ``<output_dir>/<name>``."""
    output_dir: Path = Path("runs")
    """Parent directory of run directories (checkpoints, weights, metrics, resolved config)."""
    seed: int = Field(0, ge=0)
    """Seed for data order, sampling and model initialisation."""
    total_steps: int = Field(100, ge=1)
    """Number of trainer optimizer steps (train batches) in the run."""
    max_wall_seconds: float | None = Field(None, gt=0)
    """Stop the run cleanly (checkpoint, exit 0) after this many seconds of training wall time."""

    @property
    def run_dir(self) -> Path:
        """Directory of this run's outputs."""
        return self.output_dir / self.name


class ModelConfig(_Section):
    path: str = "smollm2-135m-instruct"
    """A model prepared by ``asyncrl models prepare`` (by name), ``tiny`` (the tiny random test model, built on first use), or any local Hugging Face directory (docs/models.md)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the rollout engine's weights (fp32 on CPU) and of published weights."""
    max_context_len: int | None = Field(None, ge=16)
    """Override of the model's context length (``max_position_embeddings``); None reads it from the model."""


class ArithmeticConfig(_Section):
    digits: int | list[int] = 2
    """Maximum number of digits of each operand (1-9): one number for every operand, or a list with one entry per operand (``[2, 1]``: a two-digit plus a one-digit number)."""
    operators: str = Field("+-", pattern=r"^[+\-*]{1,3}$")
    """Operators drawn uniformly: any of ``+``, ``-``, ``*``."""
    n_terms: int = Field(2, ge=2, le=6)
    """Number of operands in each problem."""

    @model_validator(mode="after")
    def _check_digits(self) -> "ArithmeticConfig":
        per_term = self.digits if isinstance(self.digits, list) else [self.digits] * self.n_terms
        if len(per_term) != self.n_terms:
            raise ValueError(
                f"data.arithmetic.digits has {len(per_term)} entries but n_terms is {self.n_terms}: "
                "give one digit count per operand, or a single number for all"
            )
        bad = [d for d in per_term if not 1 <= d <= 9]
        if bad:
            raise ValueError(f"data.arithmetic.digits must be between 1 and 9, got {bad}")
        return self

    @property
    def digits_per_term(self) -> list[int]:
        """Maximum digits of operand ``i``, one entry per operand."""
        return list(self.digits) if isinstance(self.digits, list) else [self.digits] * self.n_terms


class DataConfig(_Section):
    task: Literal["arithmetic", "gsm8k", "jsonl", "parquet"] = "arithmetic"
    """Prompt source: the built-in procedurally generated arithmetic task, a GSM8K-format file, or a local JSONL/parquet file."""
    path: Path | None = None
    """File for ``gsm8k``/``jsonl``/``parquet`` tasks (``question``/``answer`` fields; ``answer`` may use GSM8K's ``####``)."""
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    """Difficulty knobs of the arithmetic task."""
    num_train_prompts: int = Field(100_000, ge=1)
    """Size of the (procedural) training split; the feeder cycles through it in a seeded order."""
    num_heldout_prompts: int = Field(500, ge=1)
    """Size of the held-out split (disjoint from training by a hash of the problem)."""
    heldout_percent: int = Field(10, ge=1, le=90)
    """Share of the problem space held out for evaluation, by a hash of the problem (a small problem space needs a larger share to hold ``num_heldout_prompts`` distinct problems)."""
    system_prompt: str | None = "Solve the problem. Put the final answer after 'Answer:'."
    """System message rendered with the tokenizer's chat template (None: no system message)."""
    response_prefix: str | None = None
    """Text that opens the assistant's turn after the chat template's generation prompt (an assistant prefill), formatted with the problem's metadata (``"{expression} ="`` for arithmetic; ``gold`` is not available). It is part of the prompt tokens, so it is never trained on; reward functions and evaluation see ``prefix + generated text``. None: no prefill."""
    reward: str = "math_verify"
    """Reward function: ``math_verify`` (answer check), ``format`` or a user function ``module:function``."""
    format_reward_weight: float = Field(0.0, ge=0.0, le=1.0)
    """Weight of the format reward added to the correctness reward."""
    reward_timeout_seconds: float = Field(60.0, gt=0, le=86_400)
    """Limit of one call of a user reward function (``module:function``), in seconds. A call that has not returned by then fails its sample with a ``RewardTimeout`` error (counted by the buffer as ``failed_samples:reward_timeout``); the call's thread cannot be killed and is abandoned, and while 16 abandoned calls are still running new calls fail at once. The built-in ``math_verify``/``format`` have their own limits (docs/tasks.md)."""
    reward_scale: float = Field(1.0, gt=0)
    """Rewards become ``clip((r - reward_bias) * reward_scale, -reward_clip, reward_clip)`` (PPO practice)."""
    reward_bias: float = 0.0
    """Subtracted from the raw reward before scaling."""
    reward_clip: float = Field(10.0, gt=0)
    """Absolute clip of the processed reward."""
    check_verifier_status: bool = True
    """Fail loudly when every reward of a train batch is zero (a broken verifier; AReaL's ``check_verifier_status``)."""


# ----------------------------------------------------------------------------------------------
# rollout


class RolloutConfig(_Section):
    engine: Literal["torch", "sglang"] = "torch"
    """Inference engine: the embedded torch engine (CPU) or SGLang (GPU)."""
    server_urls: list[str] = []
    """Attach to running servers at these URLs instead of launching any."""
    num_servers: int = Field(1, ge=1, le=64)
    """How many rollout servers ``asyncrl train`` launches when ``server_urls`` is empty."""
    host: str = "127.0.0.1"
    """Interface the launched servers listen on (loopback unless configured otherwise)."""
    base_port: int = Field(30000, ge=0, le=65000)
    """Port of the first launched server; 0-based server i listens on ``base_port + i`` (0 picks free ports in tests)."""
    n_samples_per_prompt: int = Field(8, ge=1, le=1024)
    """Samples per prompt group (GRPO needs at least 2)."""
    rollout_batch_size: int = Field(16, ge=1)
    """R: prompt groups per rollout batch; the cap on groups being generated (READY groups do not count)."""
    partial_percent: float = Field(1.0, gt=0.0, le=1.0)
    """p: the train batch is B = ceil(p*R) READY groups; the trainer does not wait for the rest."""
    max_budget: int = Field(1024, ge=1)
    """M: at most M new tokens per sample per policy version before it is parked as PARTIAL."""
    max_response_len: int = Field(1024, ge=1)
    """Hard cap on response tokens; reaching it finishes the sample with finish_reason ``length``."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Sampling temperature; behaviour logprobs are log-softmax(logits / temperature)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Must stay 1 for RL (behaviour logprobs must be the trainer's quantity)."""
    top_k: int = Field(-1, ge=-1)
    """Must stay -1 (all tokens) for RL."""
    stop: list[str] = []
    """Stop strings (the tokenizer's EOS always stops)."""
    max_inflight_requests: int = Field(32, ge=1, le=4096)
    """Requests a rollout worker keeps in flight per server."""
    pause_mode: Literal["abort", "in_place"] = "abort"
    """How the engine is paused for a weight update: abort in-flight requests (recompute KV on resume) or keep KV in place."""
    incremental_streaming: bool = True
    """Launch embedded servers with incremental (delta) streaming; clients detect the mode either way."""
    engine_max_batch_size: int = Field(64, ge=1)
    """Embedded engine: most sequences decoded together in one step."""
    engine_threads: int | None = Field(None, ge=1)
    """torch threads of each embedded engine (None: the controller's core assignment or torch's default)."""
    api_key_required: bool = False
    """Require ``security.api_key`` as a bearer token on state-changing endpoints of launched servers."""
    sglang_args: list[str] = []
    """Extra arguments passed verbatim to ``python -m sglang.launch_server``."""
    sglang_mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0)
    """SGLang ``--mem-fraction-static``."""
    sglang_tp_size: int = Field(1, ge=1)
    """SGLang ``--tp-size``."""

    @property
    def train_batch_groups(self) -> int:
        """B = ceil(p * R), the number of prompt groups in a train batch (:func:`train_batch_groups`)."""
        return train_batch_groups(self.partial_percent, self.rollout_batch_size)


# ----------------------------------------------------------------------------------------------
# buffer


class StalePolicy(str, Enum):
    """What happens to a sample or group whose staleness exceeds ``max_staleness``."""

    restart = "restart"
    """A stale partial is discarded and regenerated from its pristine prompt; a stale READY group is regenerated whole."""
    drop = "drop"
    """Discarded, counted with its reason."""
    keep = "keep"
    """Trained with the (capped) importance correction."""


class BufferConfig(_Section):
    redis_url: str | None = None
    """``redis://`` URL of the replay buffer; None starts an embedded redis-server in the run directory."""
    max_staleness: int = Field(0, ge=0, le=1000)
    """eta: most policy versions between a sample's oldest token and the version it is trained at."""
    stale_policy: StalePolicy = StalePolicy.restart
    """What to do with samples/groups over ``max_staleness``: restart, drop or keep."""
    flush_tokens: int = Field(16, ge=1, le=65536)
    """Tokens a rollout worker accumulates before appending them to Redis (a crash loses at most this many)."""
    lease_seconds: float = Field(30.0, gt=0.0)
    """Claimed work of a worker silent for this long is reclaimed by another (XAUTOCLAIM)."""
    batch_lease_seconds: float = Field(600.0, gt=0.0)
    """A train batch handed out and not acknowledged for this long is handed out again."""


# ----------------------------------------------------------------------------------------------
# trainer


class LossConfig(_Section):
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
    correction: Literal["decoupled", "tis", "mask_stale", "none"] = "decoupled"
    """Off-policy correction for stale tokens: decoupled PPO (AReaL), truncated IS, masking old-version tokens, or none."""
    importance_weight_cap: float = Field(5.0, gt=1.0)
    """Cap of the behaviour importance weight pi_prox/pi_behav (decoupled) or pi/pi_behav (tis)."""


class OptimizerConfig(_Section):
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
    discount: float = Field(1.0, ge=0.0, le=1.0)
    """gamma of GAE (Schulman et al. 2016); AReaL ``discount``."""
    gae_lambda: float = Field(1.0, ge=0.0, le=1.0)
    """lambda of GAE: 1 = Monte-Carlo returns minus the value, 0 = one-step TD; AReaL ``gae_lambda``."""


class CriticConfig(_Section):
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
    coef: float = Field(0.0, ge=0.0)
    """beta of the per-token KL penalty in the reward, ``r_t -= beta (log pi_behav - log pi_ref)`` (AReaL ``kl_ctl``; needs ``trainer.advantage: gae``). Separate from ``trainer.loss.kl_coef``, the KL loss term."""
    adaptive: bool = False
    """Adapt beta toward ``adaptive_target`` (Ziegler et al. 2019; AReaL ``use_adaptive_kl_ctl``)."""
    adaptive_target: float = Field(6.0, gt=0.0)
    """Target KL per sample (nats, summed over its tokens)."""
    adaptive_horizon: int = Field(10_000, ge=1)
    """Samples over which beta may move by 20%."""


class ReferenceConfig(_Section):
    model_path: str | None = None
    """The reference model's weights (the KL loss term and the KL penalty in the reward). None: the actor's initial weights (``model.path``)."""
    ema_eta: float | None = Field(None, gt=0.0, le=1.0)
    """After each train step the reference follows the actor: ``ref <- eta * actor + (1 - eta) * ref`` (AReaL's ``ref_ema_eta``); None: frozen."""


class TrainerConfig(_Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    """Advantage estimator: the critic-free group/batch baselines, or ``gae`` (PPO with a critic, ``trainer.critic``)."""
    adv_norm: bool = False
    """Normalise the advantages over the train batch's loss tokens (mean 0, std 1) after the estimator, for every estimator (AReaL ``adv_norm``, on by default there)."""
    gae: GAEConfig = GAEConfig()
    """Discount and lambda of GAE (``advantage: gae``)."""
    critic: CriticConfig = CriticConfig()
    """The value model, its optimizer and value normalisation (``advantage: gae``)."""
    kl_ctl: KLControlConfig = KLControlConfig()
    """The per-token KL penalty in the reward and its adaptive coefficient (``advantage: gae``)."""
    reference: ReferenceConfig = ReferenceConfig()
    """The reference model: its weights and whether it follows the actor."""
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
    checkpoint_interval: int = Field(10, ge=1)
    """Save a checkpoint (and commit the buffer) every this many steps."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    world_size: int = Field(1, ge=1)
    """Trainer ranks ``asyncrl train`` launches (torchrun) on one machine."""
    external: bool = False
    """The trainer runs elsewhere (its own Kubernetes Job, configs/k8s): ``asyncrl train`` launches no trainer and only feeds, supervises its local roles and reports."""


class WeightSyncConfig(_Section):
    transport: Literal["disk", "http", "nccl"] = "disk"
    """How rollout servers receive weights (docs/architecture.md#weight-sync)."""
    interval: int = Field(1, ge=1)
    """Publish weights (move the version clock) every this many optimizer steps."""
    dir: Path | None = None
    """Versioned weight directory (None: ``<run_dir>/weights``)."""
    keep_last: int = Field(3, ge=1)
    """Published versions kept on disk."""
    http_port: int = Field(0, ge=0, le=65535)
    """Port of the trainer's weight file server for ``http`` (0: a free port)."""


class MonitoringConfig(_Section):
    controller_metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port of the controller (None: off; 0: a free port)."""
    trainer_metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port of trainer rank 0 (None: off; 0: a free port)."""
    metrics_host: str = "127.0.0.1"
    """Interface the controller's and trainer's metrics servers listen on (``0.0.0.0`` in a pod so Prometheus can scrape)."""
    jsonl: bool = True
    """Write metrics as JSONL into the run directory."""
    tensorboard: bool = False
    """Also write TensorBoard event files."""
    wandb: bool = False
    """Also log to Weights & Biases (``WANDB_MODE=offline`` works without network)."""
    progress: bool = True
    """Live progress display (rich) on a terminal."""
    eval_interval: int | None = Field(None, ge=1)
    """Held-out evaluation every this many steps (its time is reported separately; None: off)."""
    eval_num_problems: int = Field(400, ge=1)
    """Held-out problems per periodic evaluation."""
    eval_modes: list[Literal["greedy", "sampled"]] = Field(["greedy", "sampled"], min_length=1)
    """Decoding modes of the periodic evaluation: ``greedy`` and/or ``sampled`` (temperature 1.0)."""


class SecurityConfig(_Section):
    api_key: str | None = None
    """Bearer token required by rollout-server endpoints that change state (None: open; loopback only by default)."""
    redis_password: str | None = None
    """Password of the Redis server (the embedded server generates one when None)."""


class ResourcesConfig(_Section):
    rollout_cores: list[int] | None = None
    """CPU cores for the rollout servers (None: the controller splits the machine's cores)."""
    trainer_cores: list[int] | None = None
    """CPU cores for the trainer."""
    rollout_gpus: list[int] | None = None
    """GPU ids for rollout servers (SGLang)."""
    trainer_gpus: list[int] | None = None
    """GPU ids for trainer ranks."""
    core_sharing: Literal["split", "shared", "trainer_first", "rollout_first"] = "split"
    """How asynchronous roles share the CPU cores when ``rollout_cores``/``trainer_cores`` are not set: ``split`` pins the trainer to the upper half and the rollout servers to the rest; the other modes give every role all cores (torch threads = all cores) so an idle role holds none, with the same priority (``shared``) or the other role at ``nice 19`` (``trainer_first``, ``rollout_first``). Synchronous configs always give every role all cores. docs/concepts.md compares them."""


# ----------------------------------------------------------------------------------------------
# root


class AsyncRLConfig(_Section):
    """The whole run: one section per component."""

    run: RunConfig = RunConfig()
    """Run identity, outputs, seed and length."""
    model: ModelConfig = ModelConfig()
    """Policy model."""
    data: DataConfig = DataConfig()
    """Prompts and rewards."""
    rollout: RolloutConfig = RolloutConfig()
    """Rollout servers and the partial-rollout knobs ``partial_percent`` and ``max_budget``."""
    buffer: BufferConfig = BufferConfig()
    """Redis replay buffer and the staleness knob ``max_staleness``."""
    trainer: TrainerConfig = TrainerConfig()
    """DeepSpeed trainer, advantages and loss."""
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """Weight publishing and transport."""
    monitoring: MonitoringConfig = MonitoringConfig()
    """Metrics, logs and evaluation."""
    security: SecurityConfig = SecurityConfig()
    """API key and Redis password."""
    resources: ResourcesConfig = ResourcesConfig()
    """Assignment of cores/GPUs to roles."""

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "AsyncRLConfig":
        r, b, loss = self.rollout, self.buffer, self.trainer.loss
        if r.top_p != 1.0 or r.top_k != -1:
            raise ValueError(
                "rollout.top_p must be 1 and rollout.top_k must be -1 for RL: behaviour logprobs "
                "must be log-softmax(logits / temperature), the quantity the trainer recomputes"
            )
        if r.partial_percent < 1.0 and b.max_staleness < 1:
            raise ValueError(
                f"rollout.partial_percent={r.partial_percent} < 1 trains stragglers after the next "
                "weight update, so staleness >= 1 is inherent: set buffer.max_staleness >= 1 "
                "(--max_staleness 1) or --partial_percent 1"
            )
        can_be_stale = b.max_staleness > 0 or r.partial_percent < 1.0
        if can_be_stale and loss.correction == "none":
            raise ValueError(
                f"samples can be stale (max_staleness={b.max_staleness}, partial_percent="
                f"{r.partial_percent}) but trainer.loss.correction is 'none': choose an off-policy "
                "correction (decoupled, tis or mask_stale) or run synchronously "
                "(--partial_percent 1 --max_staleness 0)"
            )
        if self.trainer.advantage in ("grpo", "dr_grpo", "rloo") and r.n_samples_per_prompt < 2:
            raise ValueError(
                f"trainer.advantage={self.trainer.advantage} needs rollout.n_samples_per_prompt >= 2 "
                f"(got {r.n_samples_per_prompt})"
            )
        if self.trainer.kl_ctl.coef > 0 and self.trainer.advantage != "gae":
            raise ValueError(
                f"trainer.kl_ctl.coef={self.trainer.kl_ctl.coef} puts a per-token KL penalty in the reward, which "
                f"only a per-token estimator uses: set trainer.advantage: gae, or use trainer.loss.kl_coef (the KL "
                f"loss term) with {self.trainer.advantage}"
            )
        if self.trainer.reference.ema_eta is not None and loss.kl_coef == 0 and self.trainer.kl_ctl.coef == 0:
            raise ValueError(
                "trainer.reference.ema_eta is set but no reference model is used: set trainer.loss.kl_coef > 0 "
                "or trainer.kl_ctl.coef > 0 (with advantage: gae), or drop ema_eta"
            )
        if loss.clip_eps_high < loss.clip_eps_low:
            raise ValueError(
                f"trainer.loss.clip_eps_high ({loss.clip_eps_high}) must be >= clip_eps_low "
                f"({loss.clip_eps_low}) (DAPO clip-higher)"
            )
        if r.api_key_required and not self.security.api_key:
            raise ValueError("rollout.api_key_required is set but security.api_key is empty")
        if self.data.task in ("gsm8k", "jsonl", "parquet") and self.data.path is None:
            raise ValueError(f"data.task={self.data.task} needs data.path (a local file)")
        return self

    @property
    def is_synchronous(self) -> bool:
        """True for p = 1, M >= max_response_len, eta = 0: plain synchronous on-policy RL."""
        r = self.rollout
        return r.partial_percent == 1.0 and r.max_budget >= r.max_response_len and self.buffer.max_staleness == 0


# ----------------------------------------------------------------------------------------------
# loading

#: Flat flags users type as in LightRFT/AReaL, and the dotted field each one sets.
HEADLINE_FLAGS: dict[str, str] = {
    "partial_percent": "rollout.partial_percent",
    "max_budget": "rollout.max_budget",
    "max_response_len": "rollout.max_response_len",
    "n_samples_per_prompt": "rollout.n_samples_per_prompt",
    "rollout_batch_size": "rollout.rollout_batch_size",
    "max_staleness": "buffer.max_staleness",
    "stale_policy": "buffer.stale_policy",
    "redis_url": "buffer.redis_url",
    "seed": "run.seed",
    "total_steps": "run.total_steps",
    "output_dir": "run.output_dir",
    "run_name": "run.name",
    "model_path": "model.path",
}

#: Deprecated flags: name -> (dotted field set when the user did not set it, value, message).
_DEPRECATED_FLAGS: dict[str, tuple[str, Any, str]] = {
    "use_partial": (
        "rollout.partial_percent",
        0.7,
        "--use_partial is deprecated (LightRFT): partial rollout is on whenever --partial_percent < 1 "
        "or --max_budget < max_response_len; without --partial_percent it sets LightRFT's default 0.7",
    ),
}


def _coerce_scalar(text: str) -> Any:
    """Parse one flag value as YAML (numbers, booleans, lists, null), else keep the string."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _known_dotted_fields(model: type[BaseModel] = None, prefix: str = "") -> set[str]:  # type: ignore[assignment]
    model = model or AsyncRLConfig
    out: set[str] = set()
    for name, field in model.model_fields.items():
        ann = field.annotation
        dotted = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out |= _known_dotted_fields(ann, dotted + ".")
        else:
            out.add(dotted)
    return out


def parse_flags(argv: list[str]) -> tuple[Path | None, dict[str, Any]]:
    """Parse ``--config F`` and ``--key value`` / ``--key=value`` flags into a nested dict.

    Args:
        argv: the flags after the subcommand, e.g. ``["--config", "c.yaml", "--max_budget", "64"]``.

    Returns:
        ``(config_path, overrides)`` where ``overrides`` is a nested dict of the flags' values.

    Raises:
        ConfigError: an unknown flag (with the closest known ones), a flag without a value, or a
            positional argument.
    """
    known = _known_dotted_fields()
    config_path: Path | None = None
    overrides: dict[str, Any] = {}
    deprecated_used: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --rollout.temperature 0.8")
        key, eq, value = arg[2:].partition("=")
        if key in _DEPRECATED_FLAGS and not eq:
            deprecated_used.append(key)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv) or (argv[i + 1].startswith("--") and not _is_number(argv[i + 1])):
                raise ConfigError(f"--{key} needs a value")
            value = argv[i + 1]
            i += 2
        else:
            i += 1
        if key == "config":
            config_path = Path(value)
            continue
        dotted = HEADLINE_FLAGS.get(key, key)
        if "-" in key and key.replace("-", "_") in HEADLINE_FLAGS | {k: k for k in known}:
            raise ConfigError(f"unknown flag --{key}: flags use underscores, e.g. --{key.replace('-', '_')}")
        if dotted not in known:
            import difflib

            close = difflib.get_close_matches(dotted, sorted(known | set(HEADLINE_FLAGS)), n=3)
            hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
            raise ConfigError(f"unknown flag --{key}{hint} (`asyncrl config show --help` lists every field)")
        _set_dotted(overrides, dotted, _coerce_scalar(value))
    for key in deprecated_used:
        dotted, value, message = _DEPRECATED_FLAGS[key]
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        section, _, leaf = dotted.partition(".")
        if leaf not in overrides.get(section, {}):
            _set_dotted(overrides, dotted, value)
    return config_path, overrides


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """``ASYNCRL_ROLLOUT__TEMPERATURE=0.8`` -> ``{"rollout": {"temperature": 0.8}}``."""
    known = _known_dotted_fields()
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith("ASYNCRL_") or name in ("ASYNCRL_CONFIG",):
            continue
        dotted = name[len("ASYNCRL_"):].lower().replace("__", ".")
        dotted = HEADLINE_FLAGS.get(dotted, dotted)
        if dotted not in known:
            # Variables that are not config fields (e.g. ASYNCRL_TEST_*) are ignored, not errors.
            continue
        _set_dotted(out, dotted, _coerce_scalar(value))
    return out


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML config file into a dict.

    Raises:
        ConfigError: the file is missing, is not valid YAML, or its top level is not a mapping.
    """
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def format_validation_error(exc: Any) -> str:
    """Render a pydantic ValidationError as one line per field, naming the field and the rule."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (remove it or check its spelling)"
        ctx = err.get("ctx") or {}
        bound = ", ".join(f"{k} {v}" for k, v in ctx.items() if k in ("gt", "ge", "lt", "le"))
        inp = err.get("input")
        shown = "" if isinstance(inp, dict) else f" (got {inp!r})"
        lines.append(f"{loc}: {msg}{shown}" + (f" [allowed: {bound}]" if bound else ""))
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_config(
    argv: list[str] | None = None,
    *,
    config_path: Path | str | None = None,
    environ: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> AsyncRLConfig:
    """Resolve the configuration from flags, environment, YAML and defaults.

    Args:
        argv: CLI flags (``--config F``, headline flags, dotted flags); None means none.
        config_path: YAML file used when ``argv`` has no ``--config`` (``ASYNCRL_CONFIG`` otherwise).
        environ: environment to read ``ASYNCRL_*`` variables from (default: ``os.environ``).
        overrides: extra nested values applied with the highest priority (library callers).

    Returns:
        The validated :class:`AsyncRLConfig`.

    Raises:
        ConfigError: unknown keys or flags, values out of range (the message names the field and
            the allowed range), bad YAML, or a violated cross-field rule.
    """
    from pydantic import ValidationError

    environ = dict(os.environ if environ is None else environ)
    flag_path, flag_values = parse_flags(list(argv or []))
    path = flag_path or (Path(config_path) if config_path else None)
    if path is None and environ.get("ASYNCRL_CONFIG"):
        path = Path(environ["ASYNCRL_CONFIG"])
    tree: dict[str, Any] = read_yaml(path) if path else {}
    tree = _deep_merge(tree, _env_overrides(environ))
    tree = _deep_merge(tree, flag_values)
    tree = _deep_merge(tree, overrides or {})
    try:
        return AsyncRLConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def dump_config(cfg: AsyncRLConfig, path: Path) -> None:
    """Write the resolved config as YAML (loadable with ``--config``), atomically."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    os.replace(tmp, path)


def field_help(model: type[BaseModel] | None = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """Every leaf field as ``(dotted name, type and default, docstring)`` for ``--help``."""
    model = model or AsyncRLConfig
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        dotted = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += field_help(ann, dotted + ".")
            continue
        default = field.default.value if isinstance(field.default, Enum) else field.default
        bounds = " ".join(
            f"{k}{getattr(m, k)}" for m in field.metadata for k in ("gt", "ge", "lt", "le") if hasattr(m, k)
        )
        rows.append((dotted, f"default={default!r}" + (f" {bounds}" if bounds else ""), field.description or ""))
    return rows
