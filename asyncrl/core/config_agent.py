"""The ``agent.*`` section of the config (multi-turn workflows, docs/agents.md).

Its own module beside :mod:`asyncrl.core.config_sections` (which had grown past 600 lines); import it
from :mod:`asyncrl.core.config`, like every section.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.core.config_sections import _Section

__all__ = ["AgentConfig", "STEPWISE_MODES"]

#: The step-wise advantage modes; ``per_step`` is deprecated and mapped to ``broadcast`` (rllm PR #398).
STEPWISE_MODES = ("broadcast",)


class AgentConfig(_Section):
    """Multi-turn workflows: episodes with tools and environment feedback (``agent.*``, docs/agents.md)."""

    workflow: str | None = None
    """The workflow each sample runs: a built-in (``arithmetic_retry``, ``calculator``) or ``module:function`` (an ``async def run(task, model, env) -> Episode``). None: single-turn samples (generate, then the reward function)."""
    env: str | None = None
    """``module:function`` building a user workflow's environment from the task: ``factory(task) -> env`` (seed it with ``task.seed``). Built-in workflows bring their own."""
    representation: Literal["concat", "stepwise"] = "concat"
    """How an episode is trained: ``concat`` = one sample, the whole conversation with environment tokens masked; ``stepwise`` = each model call its own sample (its context = prompt + everything before it)."""
    stepwise_mode: str = "broadcast"
    """Advantages of the steps of a trajectory: ``broadcast`` = the trajectory's reward and advantage apply to every step. ``per_step`` is deprecated (DeprecationWarning, mapped to ``broadcast``): compute per-step advantages in a ``trajectory_grouping_hook`` or set them in the workflow."""
    trajectory_grouping_hook: str | None = None
    """``module:function`` called by the trainer with the batch's groups (``list[trainer.batch.TrainGroup]``, samples = episodes); returns the groups to train (it may regroup trajectories and set rewards or advantages). None: one group per prompt."""
    max_turns: int = Field(4, ge=1, le=256)
    """Model calls allowed per episode (``K``; built-in workflows stop at it with termination ``turn_limit``)."""
    max_tokens_per_turn: int = Field(64, ge=1, le=1_000_000)
    """Default output limit of one model call (the whole conversation is bounded by ``rollout.max_response_len``)."""
    turn_discount: float = Field(0.8, gt=0.0, le=1.0)
    """Built-in ``arithmetic_retry``: a correct answer at turn k (1-based) earns ``turn_discount ** (k - 1)``."""
    tool_timeout_seconds: float = Field(5.0, gt=0.0, le=3600.0)
    """A tool call running longer is abandoned; its observation says so (a failing tool is an observation, not a crash)."""
    opsd_teacher_url: str | None = Field(None, pattern=r"^https?://")
    """On-policy self-distillation (``@opsd`` workflows, e.g. ``arithmetic_opsd``): an SGLang-compatible server holding the teacher (a reference model). None: the teacher is the policy itself on the rollout engine, given the privileged context."""
    opsd_coef: float | None = Field(None, gt=0.0, le=100.0)
    """On-policy self-distillation: the weight λ of each token's clipped teacher-minus-student log-ratio (``A_t = λ · clip(...)``). None: the decorator's own (``opsd(coef=...)``, default 1). With ``trainer.precomputed_advantages: add`` the weighted log-ratios are added to the group estimator's advantage (dense shaping on top of GRPO)."""
    opsd_hint: Literal["system", "user"] | None = None
    """On-policy self-distillation: where the teacher's privileged context goes. ``system``: a system message before the prompt; ``user``: appended to the prompt's last user message (on SmolLM2-135M the teacher then answers right twice as often, docs/agents.md). None: the decorator's own (``opsd(placement=...)``, default ``system``)."""
    episode_timeout_seconds: float = Field(600.0, gt=0.0)
    """Live seconds of one episode on one server; the next call past it ends the episode with termination ``timeout``. For ``openai_harness`` also the harness's limit: it is killed past it."""
    harness_command: list[Annotated[str, Field(min_length=1, max_length=4096)]] | None = Field(None, min_length=1, max_length=64)
    """Built-in ``openai_harness``: the argv of the agent program run once per episode (e.g. ``["python", "-m", "asyncrl.agents.examples.openai_arithmetic_retry"]``), with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (the episode's session key) and ``ASYNCRL_TASK`` in its environment. Put no secrets on it (argv is visible to every local user). Required by ``openai_harness``, ignored otherwise."""

    @field_validator("stepwise_mode", mode="before")
    @classmethod
    def _deprecated_per_step(cls, v: object) -> object:
        if v == "per_step":
            warnings.warn("agent.stepwise_mode 'per_step' is deprecated and is mapped to 'broadcast'; compute per-step "
                          "advantages in agent.trajectory_grouping_hook or set step.advantages in the workflow",
                          DeprecationWarning, stacklevel=2)
            return "broadcast"
        if v not in STEPWISE_MODES:
            raise ValueError(f"agent.stepwise_mode must be one of {STEPWISE_MODES} (or the deprecated 'per_step'), got {v!r}")
        return v

    @model_validator(mode="after")
    def _harness_needs_command(self) -> "AgentConfig":
        if self.workflow == "openai_harness" and not self.harness_command:
            raise ValueError("agent.workflow openai_harness needs agent.harness_command: the argv of the agent program "
                             "to run per episode, e.g. [python, -m, asyncrl.agents.examples.openai_arithmetic_retry]")
        return self
