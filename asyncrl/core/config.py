"""The typed configuration tree shared by every asyncrl role.

One pydantic(-settings) model, :class:`AsyncRLConfig`, covers every role (rollout server,
buffer, trainer, controller). Each knob is owned by the sub-model of the component that uses
it (the sections, in ``asyncrl/core/config_sections.py``, ``config_trainer.py`` and
``config_agent.py``, re-exported here), carries a docstring (shown by ``--help``) and its bounds
(``Field``); rules that involve several fields are validators on the root model, here, with the
loading below.

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

import os
import warnings
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, model_validator

from asyncrl.core.choices import FILE_TASKS

# The sections (and the B = ⌈p·R⌉ formula) live in asyncrl/core/config_sections.py, config_trainer.py and
# config_agent.py; every name stays importable from here (``from asyncrl.core.config import DataConfig``),
# as code and tests do.
from asyncrl.core.config_agent import STEPWISE_MODES, AgentConfig  # noqa: F401  (re-exported)
from asyncrl.core.config_sections import (  # noqa: F401  (re-exported)
    ArithmeticConfig,
    ChainConfig,
    BufferConfig,
    DataConfig,
    FewShotExample,
    ModelConfig,
    MonitoringConfig,
    ResourcesConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    RunConfig,
    SecurityConfig,
    StalePolicy,
    WeightSyncConfig,
    _Section,
    train_batch_groups,
)
from asyncrl.core.config_trainer import (  # noqa: F401  (re-exported)
    CriticConfig,
    GAEConfig,
    KLControlConfig,
    LoraConfig,
    LossConfig,
    OptimizerConfig,
    ReferenceConfig,
    TrainerConfig,
)

__all__ = [
    "AsyncRLConfig",
    "ConfigError",
    "load_config",
    "HEADLINE_FLAGS",
    "train_batch_groups",
]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and what to fix."""


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
    reward: RewardConfig = RewardConfig()
    """Learned rewards: the reward-model role."""
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
    agent: AgentConfig = AgentConfig()
    """Multi-turn workflows (episodes with tools and environment feedback)."""

    def resolved_lora_mode(self) -> str | None:
        """How rollout engines take adapter versions: ``merge``, ``by_name``, or None without ``trainer.lora``."""
        if self.trainer.lora is None:
            return None
        if self.rollout.lora_mode != "auto":
            return self.rollout.lora_mode
        return "by_name" if self.rollout.engine == "sglang" else "merge"

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
        if self.trainer.lora is not None:
            if self.trainer.reference.ema_eta is not None:
                raise ValueError("trainer.lora uses the base model with the adapter disabled as the reference: "
                                 "trainer.reference.ema_eta (a reference that follows the actor) is not available with it")
            if r.engine == "sglang" and r.lora_mode == "merge":
                raise ValueError("rollout.lora_mode=merge needs the embedded engine: SGLang's /update_weights_from_disk "
                                 "does not read an adapter directory; use lora_mode by_name (or auto) with SGLang")
            if self.resolved_lora_mode() == "by_name" and self.weight_sync.transport == "nccl":
                raise ValueError("rollout.lora_mode=by_name loads each adapter version from its directory "
                                 "(/load_lora_adapter): use weight_sync.transport disk or http, or lora_mode merge "
                                 "on the embedded engine")
        if self.trainer.advantage in ("grpo", "dr_grpo", "rloo") and r.n_samples_per_prompt < 2:
            raise ValueError(
                f"trainer.advantage={self.trainer.advantage} needs rollout.n_samples_per_prompt >= 2 "
                f"(got {r.n_samples_per_prompt})"
            )
        if r.generation_size is not None and r.generation_size < r.n_samples_per_prompt:
            raise ValueError(
                f"rollout.generation_size={r.generation_size} must be >= rollout.n_samples_per_prompt="
                f"{r.n_samples_per_prompt} (best-of-n generates generation_size samples and trains the best n)"
            )
        if r.dynamic_sampling and r.n_samples_per_prompt < 2:
            raise ValueError("rollout.dynamic_sampling drops groups whose rewards are all equal, which every group "
                             "of one sample is: set rollout.n_samples_per_prompt >= 2 or turn it off")
        if self.data.selective_rollout.enabled and r.n_samples_per_prompt < 2:
            raise ValueError("data.selective_rollout skips prompts predicted to give zero-variance groups, which every "
                             "group of one sample is: set rollout.n_samples_per_prompt >= 2 or turn it off")
        if loss.overlong_buffer_len >= r.max_response_len:
            raise ValueError(
                f"trainer.loss.overlong_buffer_len={loss.overlong_buffer_len} must be below rollout.max_response_len="
                f"{r.max_response_len} (the soft overlong penalty starts at max_response_len - overlong_buffer_len)"
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
        if self.trainer.precomputed_advantages == "add" and self.trainer.advantage == "gae":
            raise ValueError(
                "trainer.precomputed_advantages: add adds per-token values to a group estimator's advantage; with "
                "advantage: gae the critic computes them: use grpo, dr_grpo, rloo or reinforce_pp, or replace"
            )
        if self.agent.workflow is not None and self.trainer.advantage == "gae":
            raise ValueError(
                "agent.workflow with trainer.advantage: gae is not supported yet (the critic would value environment "
                "tokens): use grpo, dr_grpo, rloo or reinforce_pp for episodes"
            )
        if loss.clip_eps_high < loss.clip_eps_low:
            raise ValueError(
                f"trainer.loss.clip_eps_high ({loss.clip_eps_high}) must be >= clip_eps_low "
                f"({loss.clip_eps_low}) (DAPO clip-higher)"
            )
        if r.api_key_required and not self.security.api_key:
            raise ValueError("rollout.api_key_required is set but security.api_key is empty")
        if self.reward.model.api_key_required and not self.security.api_key:
            raise ValueError("reward.model.api_key_required is set but security.api_key is empty")
        if self.agent.env_server.api_key_required and not self.security.api_key:
            raise ValueError("agent.env_server.api_key_required is set but security.api_key is empty")
        if self.data.task in FILE_TASKS and self.data.path is None:
            raise ValueError(f"data.task={self.data.task} needs data.path (a local file)")
        return self

    @property
    def is_synchronous(self) -> bool:
        """True for p = 1, M >= max_response_len, eta = 0: plain synchronous on-policy RL."""
        r = self.rollout
        return r.partial_percent == 1.0 and r.max_budget >= r.max_response_len and self.buffer.max_staleness == 0


# ----------------------------------------------------------------------------------------------
# loading

#: Dotted config fields that are secrets: never coerced from YAML scalars, never written by
#: :func:`dump_config`, warned about on the command line.
SECRET_FIELDS = ("security.api_key", "security.redis_password", "buffer.redis_url")

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
        if dotted in SECRET_FIELDS and (dotted != "buffer.redis_url" or "@" in value):
            warnings.warn(f"--{key} puts a secret on the command line, where every user sees it in `ps`: set "
                          f"ASYNCRL_{dotted.upper().replace('.', '__')} instead (docs/security.md)", stacklevel=2)
        _set_dotted(overrides, dotted, value if dotted in SECRET_FIELDS else _coerce_scalar(value))
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
        _set_dotted(out, dotted, value if dotted in SECRET_FIELDS else _coerce_scalar(value))  # a secret stays text
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


_DUMP_HEADER = (
    "# Resolved asyncrl config. Secrets (security.api_key, security.redis_password and the password of\n"
    "# buffer.redis_url) are never written here: pass them as ASYNCRL_SECURITY__API_KEY,\n"
    "# ASYNCRL_SECURITY__REDIS_PASSWORD, ASYNCRL_BUFFER__REDIS_URL (docs/security.md).\n"
)


def public_dump(cfg: AsyncRLConfig) -> dict[str, Any]:
    """``cfg`` as a JSON-able dict without secrets: API key and Redis password None, the Redis
    URL without its password (host, port, user and db kept)."""
    from asyncrl.core.secret_values import url_without_password

    data = cfg.model_dump(mode="json")
    data["security"]["api_key"] = None
    data["security"]["redis_password"] = None
    data["buffer"]["redis_url"] = url_without_password(cfg.buffer.redis_url)
    return data


def dump_config(cfg: AsyncRLConfig, path: Path) -> None:
    """Write the resolved config as YAML (loadable with ``--config``), atomically, mode 0600.

    Secrets are left out (:func:`public_dump`): roles get them from their environment.
    """
    import yaml

    from asyncrl.core.secret_values import write_private

    write_private(Path(path), _DUMP_HEADER + yaml.safe_dump(public_dump(cfg), sort_keys=False))


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
