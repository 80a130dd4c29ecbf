"""The sections of the configuration tree: one pydantic model per component (``trainer.*`` in
``asyncrl/core/config_trainer.py`` and ``agent.*`` in ``asyncrl/core/config_agent.py``).

:class:`asyncrl.core.config.AsyncRLConfig` (the root, its cross-field rules and the loading from
flags, environment and YAML) is in ``asyncrl/core/config.py``, which re-exports every class here:
import them from :mod:`asyncrl.core.config`. Each knob is owned by the section of the component that
uses it, carries a docstring (its ``--help`` text, and the defaults users read) and its bounds
(``Field``); unknown keys are errors (:class:`_Section`).
"""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path
from typing import Literal


from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from asyncrl.core.choices import BUILTIN_TASKS, TASK_CLASS

__all__ = [
    "train_batch_groups", "RunConfig", "ModelConfig", "ArithmeticConfig", "SelectiveRolloutConfig", "DataConfig",
    "RolloutConfig",
    "StalePolicy", "BufferConfig", "WeightSyncConfig", "MonitoringConfig",
    "SecurityConfig", "ResourcesConfig", "RewardModelConfig", "RewardConfig",
]

def train_batch_groups(partial_percent: float, rollout_batch_size: int) -> int:
    """B = ⌈p·R⌉: prompt groups per train batch for ``--partial_percent`` p and rollout batch size R.

    The one definition of the formula (docs/architecture.md#the-three-knobs); the config
    (``rollout.train_batch_groups``) and the buffer (``BufferSettings.from_partial_percent``) both
    call it. At least 1; the ``1e-9`` keeps p·R that is an integer up to float rounding (0.7 · 10)
    from rounding up.
    """
    return max(1, math.ceil(partial_percent * rollout_batch_size - 1e-9))


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


# ----------------------------------------------------------------------------------------------
# run / model / data


class RunConfig(_Section):
    """Run identity, outputs, seed and length (``run.*``)."""

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
    """The policy model (``model.*``)."""

    path: str = "smollm2-135m-instruct"
    """A model prepared by ``asyncrl models prepare`` (by name), ``tiny`` (the tiny random test model, built on first use), or any local Hugging Face directory (docs/models.md)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the rollout engine's weights (fp32 on CPU) and of published weights."""
    max_context_len: int | None = Field(None, ge=16)
    """Override of the model's context length (``max_position_embeddings``); None reads it from the model."""


class ArithmeticConfig(_Section):
    """Difficulty knobs of the built-in arithmetic task (``data.arithmetic.*``)."""

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


class ChainConfig(_Section):
    """Difficulty and length knobs of the built-in long-tailed ``chain`` task (``data.chain.*``).

    A problem is a list of ``steps + 1`` numbers to add one at a time (a running sum, one line per
    step). The number of steps is drawn from a truncated discrete Pareto law,
    ``steps = min(max_steps, floor(min_steps * U ** (-1 / tail_index)))`` with ``U`` uniform on
    ``(0, 1]``, so ``P(steps >= s) = (min_steps / s) ** tail_index`` for
    ``min_steps <= s < max_steps`` (Pareto 1896; the discretised Pareto of Clauset, Shalizi &
    Newman 2009, "Power-law distributions in empirical data", SIAM Review 51(4), eq. 2.7) and the
    rest of the mass sits at ``max_steps``. The defaults give a median of 3 steps and a 99th
    percentile of 48 (16x the median): docs/tasks.md.
    """

    digits: int = Field(1, ge=1, le=4)
    """Digits of each number to add: numbers are uniform in ``[1, 10**digits - 1]``."""
    min_steps: int = Field(2, ge=1, le=100)
    """Smallest number of steps (additions) of a problem, the Pareto law's scale."""
    max_steps: int = Field(48, ge=1, le=200)
    """Largest number of steps: the Pareto law is truncated here (the tail's mass sits at ``max_steps``)."""
    tail_index: float = Field(1.2, gt=0.3, le=10.0)
    """Pareto tail index alpha: ``P(steps >= s) = (min_steps / s) ** alpha``; smaller is heavier (1.2 by default)."""

    @model_validator(mode="after")
    def _check_steps(self) -> "ChainConfig":
        if self.max_steps < self.min_steps:
            raise ValueError(
                f"data.chain.max_steps ({self.max_steps}) must be >= data.chain.min_steps ({self.min_steps})"
            )
        return self


class SelectiveRolloutConfig(_Section):
    """Skip prompts predicted to give zero-variance groups before generating them (``data.selective_rollout.*``).

    GRESO's probabilistic pre-rollout filter (Zheng et al. 2025, "Act Only When It Pays", arXiv:2506.02177;
    its reference code ``easy_probabilistic_skip`` / ``hard_probabilistic_skip``): a prompt whose last ``z``
    finished groups in a row were all-correct ("easy") or all-wrong ("hard") is skipped at its next visit
    with probability ``1 - max(p**z, explore_floor)``, ``p`` = ``p_easy`` or ``p_hard``. The buffer records
    the streaks when groups finish; the feeder decides with a draw that is a pure function of
    (``data.seed``, problem, epoch) and counts a skip as ``skipped_prompts:zero_variance_predicted``
    (docs/buffer.md#selective-rollout-skipping-predicted-zero-variance-prompts). Off by default.
    """

    enabled: bool = False
    """Turn the rule on (needs ``rollout.n_samples_per_prompt >= 2``: a group of one sample always has zero variance)."""
    p_easy: float = Field(0.5, gt=0.0, le=1.0)
    """GRESO's exploration probability for all-correct prompts: after ``z`` all-correct groups in a row the prompt is fed with probability ``max(p_easy**z, explore_floor)`` (GRESO's scripts start at 0.5; 1: never skip easy prompts)."""
    p_hard: float = Field(0.5, gt=0.0, le=1.0)
    """The same for all-wrong prompts (1: never skip hard prompts)."""
    explore_floor: float = Field(0.05, gt=0.0, le=1.0)
    """Lowest probability with which a predicted prompt is still fed at a visit (p_min > 0: no prompt's skip probability reaches 1; GRESO's code uses 0.01; 1: the rule never skips)."""
    max_consecutive_skips: int = Field(10, ge=1, le=100_000)
    """Hard exploration floor: a prompt skipped at this many visits in a row (since its last finished group) is fed at the next one, whatever the draw."""
    easy_reward_threshold: float = Field(0.5, ge=-1e9, le=1e9)
    """A zero-variance group whose common (raw) reward is >= this is all-correct ("easy"), below it all-wrong ("hard"); 0.5 fits the 0/1 correctness reward (raise it above the format bonus with ``format_reward_weight``)."""


class FewShotExample(_Section):
    """One worked example, shown to the model as an earlier user turn and its assistant answer
    (``data.few_shot[i]``), rendered by the tokenizer's chat template before the problem."""

    user: str = Field(min_length=1, max_length=4000)
    """The example's problem, as the task words its problems."""
    assistant: str = Field(min_length=1, max_length=4000)
    """The answer the model should imitate, in the format the reward checks."""


class DataConfig(_Section):
    """Prompts and rewards (``data.*``)."""

    task: str = "arithmetic"
    """Prompt source: a built-in procedurally generated task (``arithmetic``; ``chain``, running sums with heavy-tailed lengths), a GSM8K-format file, or a local JSONL/parquet file."""
    path: Path | None = None
    """File for ``gsm8k``/``jsonl``/``parquet`` tasks (``question``/``answer`` fields; ``answer`` may use GSM8K's ``####``)."""
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    """Difficulty knobs of the arithmetic task."""
    chain: ChainConfig = ChainConfig()
    """Difficulty and length knobs of the long-tailed ``chain`` task (running sums, heavy-tailed step counts)."""
    seed: int = Field(0, ge=0)
    """Seed of the train-prompt stream: the order the feeder cycles through the train split in, and the arithmetic task's train problems. Independent of ``run.seed`` (which seeds sampling and the trainer), so runs that differ only in ``run.seed`` see the same prompts in the same order: a paired comparison across seeds (bench/multiseed.py)."""
    num_train_prompts: int = Field(100_000, ge=1)
    """Size of the (procedural) training split; the feeder cycles through it in a seeded order (``data.seed``)."""
    num_heldout_prompts: int = Field(500, ge=1)
    """Size of the held-out split (disjoint from training by a hash of the problem)."""
    heldout_percent: int = Field(10, ge=1, le=90)
    """Share of the problem space held out for evaluation, by a hash of the problem (a small problem space needs a larger share to hold ``num_heldout_prompts`` distinct problems)."""
    system_prompt: str | None = "Solve the problem. Put the final answer after 'Answer:'."
    """System message rendered with the tokenizer's chat template (None: no system message)."""
    few_shot: list[FewShotExample] = Field(default_factory=list, max_length=16)
    """Worked examples shown as earlier chat turns (after the system message, before the problem), the same for every prompt of training and evaluation: few-shot prompting. They are prompt tokens, never trained on. Empty: none. The long-tailed ``chain`` job uses two (configs/smollm2_longtail.yaml; chosen by bench/longtail_prompts.py, docs/tasks.md)."""
    response_prefix: str | None = None
    """Text that opens the assistant's turn after the chat template's generation prompt (an assistant prefill), formatted with the problem's metadata (``"{expression} ="`` for arithmetic; ``gold`` is not available). It is part of the prompt tokens, so it is never trained on; reward functions and evaluation see ``prefix + generated text``. None: no prefill."""
    reward: str = "math_verify"
    """Reward function: ``math_verify`` (answer check), ``format``, ``chain_partial`` (the chain task's answer check with partial credit per correct step, docs/tasks.md), ``chain_partial_matched`` (the same, with the partial credit scaled by how well the answer's number of steps matches the problem's) or a user function ``module:function``."""
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
    dataset_filter_threshold: float = Field(0.9, ge=-1e9, le=1e9)
    """Pass-rate dataset filter (AReaL ``dataset_filter_threshold``): at the start of each epoch after the first, a train prompt whose last finished group had a mean reward above this is removed from the feeder's stream (at most ``dataset_max_filter_percentage`` of the remaining prompts per epoch, highest mean first). The removed prompts are stored in the buffer, so a resumed run keeps them out (docs/buffer.md#pass-rate-dataset-filter)."""
    dataset_max_filter_percentage: float = Field(0.0, ge=0.0, le=1.0)
    """Most prompts the pass-rate filter removes per epoch, as a share of the prompts still in the stream (AReaL ``dataset_max_filter_percentage``; 0: the filter is off; at least one prompt always stays)."""
    selective_rollout: SelectiveRolloutConfig = SelectiveRolloutConfig()
    """Skip prompts predicted to give zero-variance groups before generation (GRESO, arXiv:2506.02177); composes with the pass-rate filter and with ``rollout.dynamic_sampling``."""

    @field_validator("task")
    @classmethod
    def _task_name(cls, value: str) -> str:
        if value in BUILTIN_TASKS or TASK_CLASS.match(value):
            return value
        names = ", ".join(repr(n) for n in BUILTIN_TASKS[:-1]) + f" or {BUILTIN_TASKS[-1]!r}"
        raise ValueError(f"Input should be {names}, or a task class 'module:Class'")


# ----------------------------------------------------------------------------------------------
# reward model


class RewardModelConfig(_Section):
    """The reward-model role: an HF sequence-classification model served over HTTP (``reward.model.*``; docs/reward_model.md)."""

    path: str | None = None
    """The reward model: a local Hugging Face directory (or a name prepared by ``asyncrl models prepare``) that loads with ``AutoModelForSequenceClassification``. None: no reward model, rule-based rewards only (``data.reward``)."""
    url: str | None = Field(None, pattern=r"^https?://[^\s/]+(:\d+)?/?$")
    """Attach to a reward-model server running elsewhere (``http://host:port``, e.g. its Kubernetes Service); None: ``asyncrl train`` launches one on ``host:port`` when ``path`` is set."""
    host: str = "127.0.0.1"
    """Interface the launched reward-model server listens on (loopback unless configured otherwise)."""
    port: int = Field(30500, ge=0, le=65535)
    """Port of the launched reward-model server (0 or busy: ``asyncrl train`` picks a free one and tells every role)."""
    combine: Literal["replace", "add"] = "replace"
    """How the reward-model term joins the rule-based reward of ``data.reward``: ``replace`` (the reward is the reward-model term alone; ``data.reward`` is not run) or ``add`` (rule reward + reward-model term)."""
    output_scaling: float = Field(1.0, gt=0.0, le=1e6)
    """Scale of the reward model's score: term = clip((score - output_bias) * output_scaling, -max_reward_clip, max_reward_clip) (AReaL ``rm_output_scaling``; docs/reward_model.md)."""
    output_bias: float = Field(0.0, ge=-1e6, le=1e6)
    """Subtracted from the reward model's score before scaling (AReaL's reward-model ``output_bias``)."""
    max_reward_clip: float = Field(20.0, gt=0.0, le=1e6)
    """Absolute clip of the reward-model term (AReaL ``ppo.max_reward_clip``, default 20)."""
    label_index: int = Field(0, ge=0, le=1023)
    """Which output logit is the score (0 for the usual one-label reward model)."""
    max_length: int = Field(2048, ge=16, le=1_048_576)
    """Most tokens of one scored text; a longer text keeps its last ``max_length`` tokens (the score is read at the last token)."""
    max_batch_size: int = Field(16, ge=1, le=1024)
    """Most texts in one forward pass of the server's dynamic batcher."""
    batch_wait_ms: float = Field(5.0, ge=0.0, le=1000.0)
    """How long the batcher waits for more texts after the first one before running a forward pass, in milliseconds."""
    max_texts_per_request: int = Field(64, ge=1, le=4096)
    """Most texts in one ``POST /score`` request (larger requests are rejected with 400)."""
    max_chars: int = Field(200_000, ge=1, le=10_000_000)
    """Most characters of one text in a ``POST /score`` request (longer texts are rejected with 400)."""
    timeout_seconds: float = Field(60.0, gt=0.0, le=3600.0)
    """Limit of one scoring request from a rollout worker; a request that has not been answered by then fails its sample (``RewardModelError``, counted as ``failed_samples:reward_model``)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the reward model runs: ``cuda`` (the first visible GPU), ``cpu``, or ``auto`` (``cuda`` when a GPU is visible). Weights are fp32."""
    threads: int | None = Field(None, ge=1, le=1024)
    """torch threads of the reward-model server (None: the controller's core assignment or torch's default)."""
    drain_timeout_seconds: float = Field(30.0, gt=0.0, le=3600.0)
    """On SIGTERM the server refuses new requests (503) and finishes the texts already queued, for at most this long."""
    api_key_required: bool = False
    """Require ``security.api_key`` as a bearer token on ``POST /score`` (``/health`` and ``/metrics`` stay open)."""

    @property
    def enabled(self) -> bool:
        """True when rollout workers score with a reward model (``path`` or ``url`` set)."""
        return self.path is not None or self.url is not None

    @property
    def server_url(self) -> str:
        """Where rollout workers reach the reward model: ``url``, else ``http://host:port``."""
        if self.url:
            return self.url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


class RewardConfig(_Section):
    """Learned rewards (``reward.*``); rule-based rewards and their processing are ``data.reward*``."""

    model: RewardModelConfig = RewardModelConfig()
    """The reward-model role (off unless ``reward.model.path`` or ``reward.model.url`` is set)."""


# ----------------------------------------------------------------------------------------------
# rollout


class RolloutConfig(_Section):
    """Rollout servers and the partial-rollout knobs ``partial_percent`` and ``max_budget`` (``rollout.*``)."""

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
    generation_size: int | None = Field(None, ge=1, le=1024)
    """Best-of-n (AReaL ``generation_size``): generate this many samples per prompt and train only the ``n_samples_per_prompt`` with the highest reward (ties: the longer response, then the lower sample index); the others are counted ``discarded_best_of_n``. None or equal to n: off; must be >= n."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476): a finished group whose trained samples all have the same reward carries no GRPO signal and is dropped (reason ``zero_variance``) instead of trained; admission control refills its slot, so batches are formed from informative groups only. Needs n >= 2."""
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
    flush_cache_on_update: bool = True
    """Load each weight version with SGLang's ``flush_cache`` (its default). With ``pause_mode: in_place``, false keeps the embedded engine's context cache across the update, so a sample parked by ``max_budget`` and resumed under the next version (or an episode's next call) extends its old keys/values instead of prefilling its whole context again, as a request running across the update does (docs/rollout.md, "No radix tree"). The ``disk`` and ``http`` transports, whose loads the rollout worker sends; ``nccl`` pushes always flush."""
    lora_mode: Literal["auto", "merge", "by_name"] = "auto"
    """With ``trainer.lora``, how a rollout engine takes each adapter version (docs/trainer.md#lora): ``merge`` into a copy of its base weights (``/update_weights_from_disk``; the embedded engine only), or ``by_name``: registered under a versioned name (SGLang's ``/load_lora_adapter``), at most ``buffer.max_staleness + 1`` kept, each request naming its adapter in ``lora_path``. ``auto``: ``by_name`` on SGLang, ``merge`` on the embedded engine."""
    incremental_streaming: bool = True
    """Launch embedded servers with incremental (delta) streaming; clients detect the mode either way."""
    engine_max_batch_size: int = Field(64, ge=1)
    """Embedded engine: most sequences decoded together in one step."""
    engine_threads: int | None = Field(None, ge=1)
    """torch threads of each embedded engine (None: the controller's core assignment or torch's default)."""
    engine_scheduler_delay_factor: float = Field(0.0, ge=0.0, le=1000.0)
    """Embedded engine: while rows decode, waiting requests are admitted once the oldest has waited this many times the last prefill's duration, so arrivals share one prefill forward pass (vLLM's ``--scheduler-delay-factor``; 0: at every step, SGLang's behaviour; docs/rollout.md)."""
    engine_max_request_bytes: int | None = Field(None, ge=1024, le=2**40)
    """Embedded engine: most bytes of a ``/generate`` or control body (413 beyond); None: 1 MiB + 12 bytes x context length x ``engine_max_prompts_per_request``."""
    engine_max_weights_request_bytes: int | None = Field(None, ge=1024, le=2**40)
    """Embedded engine: most bytes of a weight-update body (413 beyond); None: 1 MiB + 11 bytes per model parameter (a base64 float64 payload)."""
    engine_max_prompts_per_request: int = Field(128, ge=1, le=65536)
    """Embedded engine: most prompts in one ``/generate`` batch (400 beyond)."""
    engine_max_queued_requests: int = Field(2048, ge=0, le=1_000_000)
    """Embedded engine: most samples waiting beyond the ones being decoded; more get a 503 with ``Retry-After`` (SGLang's ``--max-queued-requests``)."""
    engine_max_top_logprobs_num: int = Field(20, ge=0, le=1_000_000)
    """Embedded engine: largest ``top_logprobs_num`` a request may ask (400 beyond; OpenAI caps ``top_logprobs`` at 20)."""
    engine_cumulative_stream_entries: int = Field(4096, ge=64, le=1_000_000)
    """Embedded engine: a cumulative stream's next chunk waits for ``ceil(sent x (1 + top_logprobs_num) / this)`` new tokens, so a stream's total output is linear in its length."""
    engine_max_request_cost: int = Field(1 << 20, ge=1, le=2**40)
    """Embedded engine: most output entries one ``/generate`` request may produce, samples x ``max_new_tokens`` x logprob width (2 + ``top_logprobs_num`` with ``return_logprob``, else 1); more is a 400 naming the bound (docs/security.md)."""
    engine_fair_reserve_rows: int | None = Field(None, ge=0, le=1_000_000)
    """Embedded engine: decode rows that requests with more samples than this never take together, so small requests keep running beside a big one (None: ``engine_max_batch_size // 8``; docs/security.md)."""
    engine_fair_slowdown: float = Field(2.0, ge=1.0, le=1e9)
    """Embedded engine: while requests of at most ``engine_fair_reserve_rows`` samples run, a decode step costs at most this many times their step alone (the engine's cost model); bigger requests' rows share the rest by deficit round robin (docs/security.md)."""
    engine_header_timeout_seconds: float = Field(20.0, ge=0.1, le=3600.0)
    """Embedded engine: a connection must deliver a complete request head within this (also the idle keep-alive timeout)."""
    engine_body_timeout_seconds: float = Field(60.0, ge=0.1, le=3600.0)
    """Embedded engine: a request body must arrive completely within this (408 otherwise)."""
    engine_weight_group_timeout_seconds: float = Field(60.0, ge=0.1, le=3600.0)
    """Embedded engine: bound of joining a weight-update group (``/init_weights_update_group``) and of each broadcast received through it."""
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

    @model_validator(mode="after")
    def _check_flush(self) -> "RolloutConfig":
        if not self.flush_cache_on_update and self.pause_mode != "in_place":
            raise ValueError("rollout.flush_cache_on_update: false keeps keys/values of the old weights across an "
                             "update, which only rollout.pause_mode: in_place does for running requests; set "
                             f"pause_mode: in_place or leave flush_cache_on_update true (pause_mode is {self.pause_mode!r})")
        return self


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
    """The Redis replay buffer and the staleness knob ``max_staleness`` (``buffer.*``)."""

    redis_url: SecretStr | None = None
    """``redis://[USER:PASSWORD@]HOST:PORT/DB`` URL of the replay buffer (a secret when it holds a password: redacted in dumps and logs; pass it as ``ASYNCRL_BUFFER__REDIS_URL``, docs/security.md); None starts an embedded redis-server in the run directory."""
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
    outage_seconds: float = Field(300.0, ge=1.0, le=86400.0)
    """How long a role waits out an unreachable Redis (restarting, loading its AOF) with backoff and one WARNING line before it fails, naming what it waited for (asyncrl/core/outage.py)."""
    timeline: bool = True
    """Record every sample transition with its time and role in the buffer's scripts and export the timelines to ``<run_dir>/trace/`` for ``asyncrl trace`` (docs/buffer.md#timeline); false records and writes nothing (every role that opens the buffer honours it)."""

# ----------------------------------------------------------------------------------------------
# weight sync, monitoring, security, resources (the trainer's sections are in config_trainer.py)


class WeightSyncConfig(_Section):
    """Weight publishing and transport (``weight_sync.*``)."""

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
    http_host: str | None = Field(None, min_length=1, max_length=253)
    """Address the trainer's weight file server binds and puts in the announced uri (None: ``rollout.host``; on Kubernetes the pod IP, never ``0.0.0.0``, which no rollout server can fetch from). Every request must carry ``security.api_key`` as a bearer token when it is set."""


class MonitoringConfig(_Section):
    """Metrics, logs and evaluation (``monitoring.*``)."""

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
    eval_batch_size: int = Field(128, ge=1, le=4096)
    """Rows the periodic evaluation decodes together (``asyncrl eval --batch_size``). Its KV cache
    grows with rows x (prompt + ``rollout.max_response_len``) tokens and the paused roles keep their
    memory, so long answers need fewer rows (configs/smollm2_longtail.yaml: 32; 128 rows of 512
    new tokens reached 10 GB and were killed by the kernel on a 24 GB machine)."""
    eval_timeout_seconds: float = Field(3600.0, ge=1.0, le=86400.0)
    """Longest held-out evaluation; past it the evaluation is killed, reported as failed with one line, and training goes on (roles resume)."""


class SecurityConfig(_Section):
    """API key and Redis password (``security.*``); both are secrets (docs/security.md)."""

    api_key: SecretStr | None = Field(None, min_length=1, max_length=512)
    """Bearer token required by rollout-server endpoints that change state (None: open; loopback only by default). A secret: never dumped or logged; pass it as ``ASYNCRL_SECURITY__API_KEY``, and roles get it from the environment, never argv."""
    redis_password: SecretStr | None = Field(None, min_length=1, max_length=512)
    """Admin (``default`` user) password of the embedded Redis (generated when None). A secret: never dumped or logged; pass it as ``ASYNCRL_SECURITY__REDIS_PASSWORD``. The roles of ``asyncrl train`` get their own Redis users with generated passwords (docs/security.md)."""


class ResourcesConfig(_Section):
    """Assignment of CPU cores and GPUs to roles (``resources.*``)."""

    rollout_cores: list[int] | None = None
    """CPU cores for the rollout servers (None: the controller splits the machine's cores)."""
    trainer_cores: list[int] | None = None
    """CPU cores for the trainer."""
    rollout_gpus: list[int] | None = None
    """GPU ids for rollout servers (SGLang; the embedded torch engine runs on ``cuda`` when this is set, else on CPU)."""
    trainer_gpus: list[int] | None = None
    """GPU ids for trainer ranks."""
    core_sharing: Literal["split", "follow", "shared", "trainer_first", "rollout_first"] = "split"
    """How asynchronous roles share the CPU cores when ``rollout_cores``/``trainer_cores`` are not set: ``split`` pins the trainer to the upper half and the rollout servers to the rest; ``follow`` keeps those thread counts but lets every role run on every core, and a rollout server takes the trainer's threads too while the trainer waits for a batch; the other modes give every role all cores (torch threads = all cores) so an idle role holds none, with the same priority (``shared``) or the other role at ``nice 19`` (``trainer_first``, ``rollout_first``). Synchronous configs always give every role all cores. docs/concepts.md compares them."""

