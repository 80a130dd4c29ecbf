"""The buffer's settings: the knobs it enforces, stored with the run in Redis on first open.

:class:`BufferSettings` is what ``ReplayBuffer.open`` compares with the settings stored under
``<prefix>settings`` (a mismatch is ``SettingsMismatch``) and what every Lua script receives as
``ARGV[3..11]`` (``lua/settings.lua``). The knobs' meaning is in
docs/architecture.md#the-three-knobs; import them as ``from buffers import BufferSettings``.

One field is stored under another name (:data:`STORED_NAMES`): the budget is ``max_budget`` here,
as in the config (``rollout.max_budget``) and the flag (``--max_budget``), but every run's stored
settings JSON, and ``asyncrl buffer stats``, keep its old name ``max_budget_tokens``. So a run
created before the rename resumes unchanged, and a role of an older release (a rolling upgrade)
still opens a run created by this one: the stored JSON is byte for byte what it always was.
:meth:`BufferSettings.to_stored` and :meth:`BufferSettings.from_stored` are the only places that
translate.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from asyncrl.core.types import REPORTED_FINISH_REASONS
from buffers.errors import BadRequest

__all__ = ["BufferSettings", "STALE_POLICIES", "FINISH_REASONS", "STORED_NAMES", "settings_fields"]

STALE_POLICIES = ("restart", "drop", "keep")
#: segment ends a worker may send with ``end_segment`` (``turn``: a model call of an episode ended)
FINISH_REASONS = REPORTED_FINISH_REASONS  # asyncrl.core.types: the one finish-reason vocabulary
#: field name -> the name it is stored under in a run's settings JSON (see the module docstring)
STORED_NAMES = {"max_budget": "max_budget_tokens"}
_FIELD_NAMES = {stored: name for name, stored in STORED_NAMES.items()}


@dataclass(frozen=True)
class BufferSettings:
    """The knobs the buffer enforces (docs/architecture.md#the-three-knobs); stored with the run on first open.

    Args:
        rollout_batch_size: R, cap on groups being generated (admitted, not yet READY).
        train_batch_groups: B = ceil(p * R), groups per train batch.
        n_samples_per_prompt: n, samples per group (default of :class:`PromptGroup`).
        max_budget: M, new tokens per sample per policy version (``rollout.max_budget``, flag
            ``--max_budget``); stored with the run as ``max_budget_tokens`` (:data:`STORED_NAMES`).
        max_response_len: hard cap on response tokens (finishes with ``length``).
        max_staleness: eta in policy versions.
        stale_policy: ``restart`` | ``drop`` | ``keep``.
        lease_seconds: a claim not renewed (append/renew) for this long is reclaimed.
        flush_tokens: tokens per appended chunk (used by workers; recorded for tools).
        batches_per_version: train steps per published version (``weight_sync.interval``).
        generation_size: G, samples generated per group when best-of-n is on (``rollout.generation_size``):
            0 = n (off); else n <= G <= 1024 and only the best n by reward are trained, the rest
            are DISCARDED (AReaL ``generation_size``; docs/buffer.md#best-of-n-and-dynamic-sampling).
        dynamic_sampling: drop a group whose trained samples all have the same reward (reason
            ``zero_variance``) instead of making it READY (DAPO dynamic sampling, Yu et al. 2025,
            arXiv:2503.14476, section 3.2); ``rollout.dynamic_sampling``.
        record_pass_rates: record each finished group's mean reward in ``pass_rates`` for the
            feeder's pass-rate dataset filter (on when ``data.dataset_max_filter_percentage`` > 0).
        record_prompt_history: when a group finishes, update its train problem's zero-variance streak in
            ``prompt_history`` (and clear its ``prompt_skips``) for the selective-rollout rule (GRESO,
            arXiv:2506.02177; on when ``data.selective_rollout.enabled``; :mod:`asyncrl.feeder.selective_rollout`).

    These four are not Lua arguments: the scripts read them from the stored settings JSON
    when a group finishes (``run_settings()`` in ``lua/settings.lua``).

    Raises:
        BadRequest: a value is out of range (message names it).
    """

    rollout_batch_size: int = 16
    train_batch_groups: int = 16
    n_samples_per_prompt: int = 8
    max_budget: int = 1024
    max_response_len: int = 1024
    max_staleness: int = 0
    stale_policy: str = "restart"
    lease_seconds: float = 30.0
    flush_tokens: int = 16
    batches_per_version: int = 1
    generation_size: int = 0
    dynamic_sampling: bool = False
    record_pass_rates: bool = False
    record_prompt_history: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("rollout_batch_size", self.rollout_batch_size >= 1),
            ("train_batch_groups", 1 <= self.train_batch_groups <= self.rollout_batch_size),
            ("n_samples_per_prompt", 1 <= self.n_samples_per_prompt <= 1024),
            ("max_budget", self.max_budget >= 1),
            ("max_response_len", self.max_response_len >= 1),
            ("max_staleness", self.max_staleness >= 0),
            ("stale_policy", self.stale_policy in STALE_POLICIES),
            ("lease_seconds", self.lease_seconds > 0),
            ("flush_tokens", self.flush_tokens >= 1),
            ("batches_per_version", self.batches_per_version >= 1),
            ("generation_size", self.generation_size == 0
             or self.n_samples_per_prompt <= self.generation_size <= 1024),
            ("dynamic_sampling", not self.dynamic_sampling or self.n_samples_per_prompt >= 2),
        ]
        bad = [name for name, ok in checks if not ok]
        if bad:
            raise BadRequest(
                f"invalid buffer settings {bad}: need R >= 1, 1 <= B <= R, 1 <= n <= 1024, M >= 1, "
                f"max_response_len >= 1, eta >= 0, stale_policy in {STALE_POLICIES}, lease_seconds > 0, "
                f"flush_tokens >= 1, batches_per_version >= 1, generation_size 0 or in [n, 1024], "
                f"dynamic_sampling only with n >= 2 (got {self})"
            )

    @classmethod
    def from_config(cls, cfg: Any) -> "BufferSettings":
        """Settings from an :class:`asyncrl.core.config.AsyncRLConfig`."""
        r, b = cfg.rollout, cfg.buffer
        policy = b.stale_policy.value if hasattr(b.stale_policy, "value") else str(b.stale_policy)
        return cls(
            rollout_batch_size=r.rollout_batch_size,
            train_batch_groups=r.train_batch_groups,
            n_samples_per_prompt=r.n_samples_per_prompt,
            max_budget=r.max_budget,
            max_response_len=r.max_response_len,
            max_staleness=b.max_staleness,
            stale_policy=policy,
            lease_seconds=b.lease_seconds,
            flush_tokens=b.flush_tokens,
            batches_per_version=cfg.weight_sync.interval,
            generation_size=r.generation_size or 0,
            dynamic_sampling=r.dynamic_sampling,
            record_pass_rates=cfg.data.dataset_max_filter_percentage > 0,
            record_prompt_history=cfg.data.selective_rollout.enabled,
        )

    @classmethod
    def from_partial_percent(cls, rollout_batch_size: int, partial_percent: float, **kw: Any) -> "BufferSettings":
        """Settings with B = ceil(p * R) (:func:`asyncrl.core.config.train_batch_groups`)."""
        from asyncrl.core.config import train_batch_groups

        if not 0 < partial_percent <= 1:
            raise BadRequest(f"partial_percent must be in (0, 1], got {partial_percent}")
        b = train_batch_groups(partial_percent, rollout_batch_size)
        return cls(rollout_batch_size=rollout_batch_size, train_batch_groups=b, **kw)

    def lua_args(self) -> list[Any]:
        """ARGV[3..11] of the buffer scripts (see ``lua/settings.lua``)."""
        return [
            self.rollout_batch_size, self.train_batch_groups, self.n_samples_per_prompt,
            self.max_budget, self.max_response_len, self.max_staleness, self.stale_policy,
            int(round(self.lease_seconds * 1000)), self.batches_per_version,
        ]

    @property
    def samples_generated(self) -> int:
        """Samples generated per prompt group: G with best-of-n, else n."""
        return max(self.generation_size, self.n_samples_per_prompt)

    def to_stored(self) -> dict[str, Any]:
        """The settings as stored with the run: every field, under its stored name (:data:`STORED_NAMES`)."""
        return {STORED_NAMES.get(k, k): v for k, v in asdict(self).items()}

    def to_json(self) -> str:
        """Canonical JSON of :meth:`to_stored` (sorted keys), stored as ``<prefix>settings``."""
        return json.dumps(self.to_stored(), sort_keys=True)

    @classmethod
    def from_stored(cls, raw: str | bytes | dict[str, Any]) -> "BufferSettings":
        """Settings from a run's stored JSON (or its parsed object), read under the stored names.

        Raises:
            ValueError: not JSON, not an object, or a field given under both its names.
            TypeError: an unknown or missing field.
            BadRequest: a value out of range.
        """
        data = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
        if not isinstance(data, dict):
            raise ValueError(f"stored settings must be a JSON object, got {type(data).__name__}")
        both = [name for name, stored in STORED_NAMES.items() if name in data and stored in data]
        if both:
            raise ValueError(f"stored settings name {both} twice (as {[STORED_NAMES[n] for n in both]} too)")
        return cls(**{_FIELD_NAMES.get(k, k): v for k, v in data.items()})


def settings_fields() -> list[str]:
    """Names of the :class:`BufferSettings` fields (for tools)."""
    return [f.name for f in fields(BufferSettings)]
