"""The buffer's settings: the knobs it enforces, stored with the run in Redis on first open.

:class:`BufferSettings` is what ``ReplayBuffer.open`` compares with the settings stored under
``<prefix>settings`` (a mismatch is ``SettingsMismatch``) and what every Lua script receives as
``ARGV[3..11]`` (``lua/settings.lua``). The knobs' meaning is in
docs/architecture.md#the-three-knobs; import them as ``from buffers import BufferSettings``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from buffers.errors import BadRequest

__all__ = ["BufferSettings", "STALE_POLICIES", "FINISH_REASONS", "settings_fields"]

STALE_POLICIES = ("restart", "drop", "keep")
#: segment ends a worker may send with ``end_segment`` (``turn``: a model call of an episode ended)
FINISH_REASONS = ("stop", "length", "abort", "budget", "turn")


@dataclass(frozen=True)
class BufferSettings:
    """The knobs the buffer enforces (docs/architecture.md#the-three-knobs); stored with the run on first open.

    Args:
        rollout_batch_size: R, cap on groups being generated (admitted, not yet READY).
        train_batch_groups: B = ceil(p * R), groups per train batch.
        n_samples_per_prompt: n, samples per group (default of :class:`PromptGroup`).
        max_budget_tokens: M, new tokens per sample per policy version: the config's
            ``rollout.max_budget`` (flag ``--max_budget``) under the name stored with the run in
            Redis and shown by ``asyncrl buffer stats``, which therefore stays.
        max_response_len: hard cap on response tokens (finishes with ``length``).
        max_staleness: eta in policy versions.
        stale_policy: ``restart`` | ``drop`` | ``keep``.
        lease_seconds: a claim not renewed (append/renew) for this long is reclaimed.
        flush_tokens: tokens per appended chunk (used by workers; recorded for tools).
        batches_per_version: train steps per published version (``weight_sync.interval``).

    Raises:
        BadRequest: a value is out of range (message names it).
    """

    rollout_batch_size: int = 16
    train_batch_groups: int = 16
    n_samples_per_prompt: int = 8
    max_budget_tokens: int = 1024
    max_response_len: int = 1024
    max_staleness: int = 0
    stale_policy: str = "restart"
    lease_seconds: float = 30.0
    flush_tokens: int = 16
    batches_per_version: int = 1

    def __post_init__(self) -> None:
        checks = [
            ("rollout_batch_size", self.rollout_batch_size >= 1),
            ("train_batch_groups", 1 <= self.train_batch_groups <= self.rollout_batch_size),
            ("n_samples_per_prompt", 1 <= self.n_samples_per_prompt <= 1024),
            ("max_budget_tokens", self.max_budget_tokens >= 1),
            ("max_response_len", self.max_response_len >= 1),
            ("max_staleness", self.max_staleness >= 0),
            ("stale_policy", self.stale_policy in STALE_POLICIES),
            ("lease_seconds", self.lease_seconds > 0),
            ("flush_tokens", self.flush_tokens >= 1),
            ("batches_per_version", self.batches_per_version >= 1),
        ]
        bad = [name for name, ok in checks if not ok]
        if bad:
            raise BadRequest(
                f"invalid buffer settings {bad}: need R >= 1, 1 <= B <= R, 1 <= n <= 1024, M >= 1, "
                f"max_response_len >= 1, eta >= 0, stale_policy in {STALE_POLICIES}, lease_seconds > 0, "
                f"flush_tokens >= 1, batches_per_version >= 1 (got {self})"
            )

    @classmethod
    def from_config(cls, cfg: Any) -> "BufferSettings":
        """Settings from an :class:`asyncrl.config.AsyncRLConfig`."""
        r, b = cfg.rollout, cfg.buffer
        policy = b.stale_policy.value if hasattr(b.stale_policy, "value") else str(b.stale_policy)
        return cls(
            rollout_batch_size=r.rollout_batch_size,
            train_batch_groups=r.train_batch_groups,
            n_samples_per_prompt=r.n_samples_per_prompt,
            max_budget_tokens=r.max_budget,
            max_response_len=r.max_response_len,
            max_staleness=b.max_staleness,
            stale_policy=policy,
            lease_seconds=b.lease_seconds,
            flush_tokens=b.flush_tokens,
            batches_per_version=cfg.weight_sync.interval,
        )

    @classmethod
    def from_partial_percent(cls, rollout_batch_size: int, partial_percent: float, **kw: Any) -> "BufferSettings":
        """Settings with B = ceil(p * R) (:func:`asyncrl.config.train_batch_groups`)."""
        from asyncrl.config import train_batch_groups

        if not 0 < partial_percent <= 1:
            raise BadRequest(f"partial_percent must be in (0, 1], got {partial_percent}")
        b = train_batch_groups(partial_percent, rollout_batch_size)
        return cls(rollout_batch_size=rollout_batch_size, train_batch_groups=b, **kw)

    def lua_args(self) -> list[Any]:
        """ARGV[3..11] of the buffer scripts (see ``lua/settings.lua``)."""
        return [
            self.rollout_batch_size, self.train_batch_groups, self.n_samples_per_prompt,
            self.max_budget_tokens, self.max_response_len, self.max_staleness, self.stale_policy,
            int(round(self.lease_seconds * 1000)), self.batches_per_version,
        ]

    def to_json(self) -> str:
        """Canonical JSON (stored as ``<prefix>settings``)."""
        return json.dumps(asdict(self), sort_keys=True)


def settings_fields() -> list[str]:
    """Names of the :class:`BufferSettings` fields (for tools)."""
    return [f.name for f in fields(BufferSettings)]
