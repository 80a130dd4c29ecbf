"""The ``agent.*`` section of the config (multi-turn workflows, docs/agents.md).

Its own module beside :mod:`asyncrl.core.config_sections` (which had grown past 600 lines); import it
from :mod:`asyncrl.core.config`, like every section.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.core.config_sections import _Section

__all__ = ["AgentConfig", "EnvLatencyConfig", "EnvServerConfig", "LATENCY_DISTRIBUTIONS", "STEPWISE_MODES"]

#: The step-wise advantage modes; ``per_step`` is deprecated and mapped to ``broadcast`` (rllm PR #398).
STEPWISE_MODES = ("broadcast",)


#: How the environment server draws the latency of one call (docs/agents.md#a-slow-environment-the-environment-server).
LATENCY_DISTRIBUTIONS = ("none", "constant", "lognormal")


class EnvLatencyConfig(_Section):
    """The simulated service time of one environment-server call (``agent.env_server.latency.*``).

    Documented in docs/agents.md (with the published measurements the shipped values are fitted
    to), sampled by :class:`asyncrl.env_server.latency.LatencyModel`.
    """

    distribution: Literal["none", "constant", "lognormal"] = "none"
    """``none``: no added latency (the call takes what the tool takes); ``constant``: every call takes ``median_seconds``; ``lognormal``: ln(latency) ~ Normal(ln(median_seconds), sigma^2), the shape of measured sandbox start-and-exec times (docs/agents.md)."""
    median_seconds: float = Field(0.0, ge=0.0, le=3600.0)
    """The median latency of one call in seconds (``constant``: every call's latency; ``lognormal``: exp(mu))."""
    sigma: float = Field(0.0, ge=0.0, le=5.0)
    """``lognormal``: the standard deviation of ln(latency); 0 makes it constant. The p95 is median * exp(1.645 sigma)."""
    max_seconds: float | None = Field(None, gt=0.0, le=3600.0)
    """Clip each drawn latency at this many seconds (None: no clip; the call's deadline still applies)."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """Seed of the draws. A call's latency is a function of (seed, call id): a replayed call waits as long as it did the first time."""

    @model_validator(mode="after")
    def _needs_a_median(self) -> "EnvLatencyConfig":
        if self.distribution != "none" and self.median_seconds <= 0.0:
            raise ValueError(f"agent.env_server.latency.distribution {self.distribution!r} needs median_seconds > 0")
        return self


class EnvServerConfig(_Section):
    """The environment-server role: tools served over HTTP to the rollout workers (``agent.env_server.*``, docs/agents.md)."""

    enabled: bool = False
    """Run the built-in workflows' tool (``calculator``'s calculator) on the environment server instead of in the rollout worker's process. ``asyncrl train`` starts and supervises the server unless ``url`` is set."""
    url: str | None = Field(None, pattern=r"^https?://[^\s/]+(:\d+)?/?$")
    """Attach to an environment server running elsewhere (``http://host:port``); None: ``asyncrl train`` launches one on ``host:port``."""
    host: str = "127.0.0.1"
    """Interface the launched environment server listens on (loopback unless configured otherwise)."""
    port: int = Field(30600, ge=0, le=65535)
    """Port of the launched environment server (0 or busy: ``asyncrl train`` picks a free one and tells every role)."""
    deadline_seconds: float = Field(10.0, gt=0.0, le=3600.0)
    """Deadline of one tool call, queueing on the server included. A call past it ends as the observation ``error: the tool took longer than D s`` (the episode continues); the server stops waiting at the deadline and the worker gives up 2 s after it."""
    outage_seconds: float = Field(300.0, gt=0.0, le=86400.0)
    """How long one call waits out an environment server that cannot be reached or is draining (refused or reset connections, HTTP 503 or 5xx), retrying with backoff 0.1 s doubling to 2 s. Past it the workflow fails with ``EnvServerUnavailable`` (the sample is FAILED, counted ``failed_samples:workflow_error``)."""
    max_concurrent_calls: int = Field(64, ge=1, le=65536)
    """Calls the server runs at once (its sandbox pool); later calls wait, and the wait counts toward their deadline."""
    max_expression_chars: int = Field(200, ge=1, le=100_000)
    """The longest ``expression`` of one ``POST /tools/calculate`` request (400 beyond)."""
    drain_timeout_seconds: float = Field(30.0, gt=0.0, le=3600.0)
    """On SIGTERM the server refuses new calls (503: the workers retry elsewhere or wait) and finishes those in flight, for at most this long."""
    api_key_required: bool = False
    """Require ``security.api_key`` as a bearer token on the tool endpoints (``/health`` and ``/metrics`` stay open)."""
    latency: EnvLatencyConfig = EnvLatencyConfig()
    """The simulated latency of one call: a documented distribution (docs/agents.md), never a hidden sleep."""

    @property
    def server_url(self) -> str:
        """Where rollout workers reach the environment server: ``url``, else ``http://host:port``."""
        if self.url:
            return self.url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


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
    env_server: EnvServerConfig = EnvServerConfig()
    """The environment-server role (off unless ``agent.env_server.enabled``): the tool of a built-in workflow called over HTTP, with a deadline per call and a documented latency distribution (docs/agents.md)."""
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
