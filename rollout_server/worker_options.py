"""A rollout worker's options, counters and fatal error (:mod:`rollout_server.worker`).

:class:`WorkerOptions` are the knobs of one :class:`rollout_server.worker.RolloutWorker` (most
from the config, :meth:`WorkerOptions.from_config`), :class:`WorkerStats` its counters, and
:class:`WorkerError` what it raises when it cannot go on. All three are importable from
:mod:`rollout_server.worker` too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["WorkerOptions", "WorkerError", "WorkerStats"]


class WorkerError(RuntimeError):
    """The worker cannot go on (the engine rejects our requests, or never becomes healthy)."""


@dataclass
class WorkerOptions:
    """Knobs of one rollout worker (most come from the config: :meth:`from_config`).

    Args:
        worker_id: unique per worker (leases are held under it); also the engine ``rid`` prefix.
        temperature: sampling temperature (``rollout.temperature``).
        max_inflight_requests: work items in flight on the engine (``rollout.max_inflight_requests``).
        pause_mode: ``abort`` or ``in_place`` (``rollout.pause_mode``).
        flush_cache_on_update: send weight loads with ``flush_cache`` (``rollout.flush_cache_on_update``);
            false needs ``pause_mode`` ``in_place``.
        transport: ``disk``, ``http`` or ``nccl`` (``weight_sync.transport``).
        stop: stop strings (``rollout.stop``).
        base_model_path: weights of policy version 0 (``model.path``), loaded when a recovery
            rewinds to version 0 without announcing a uri.
        weights_cache_dir: where ``http`` downloads land (default: a temp directory).
        keep_downloads: downloaded versions kept in ``weights_cache_dir``.
        weights_api_key: bearer token of the trainer's ``http`` weight server (``security.api_key``).
        version_poll_seconds: how often ``clock.latest()`` is polled besides pub/sub.
        claim_poll_seconds: wait between claims when the buffer has no work.
        engine_wait_seconds: how long to wait for a lost engine before :class:`WorkerError`.
        drain_timeout_seconds: how long :meth:`RolloutWorker.drain` waits for in-flight items.
        extra_sampling_params: merged into every request's ``sampling_params`` (e.g.
            ``{"ignore_eos": true}`` in benchmarks); may not set the keys the worker owns.
        lora_mode: how an adapter-only version (``trainer.lora``) reaches the engine: ``merge``
            (``/update_weights_from_disk``; the embedded engine merges it) or ``by_name``
            (SGLang's ``/load_lora_adapter`` under a versioned name, ``lora_path`` on every
            request; :class:`rollout_server.worker_weights.WorkerWeightSync`).
        max_lora_adapters: ``by_name``: most adapter versions kept registered on the engine
            (None: ``buffer.max_staleness + 1``, so a segment started under the oldest version
            the buffer still accepts can finish under it).
    """

    worker_id: str
    temperature: float = 1.0
    max_inflight_requests: int = 32
    pause_mode: str = "abort"
    flush_cache_on_update: bool = True
    transport: str = "disk"
    stop: Sequence[str] = ()
    base_model_path: str | None = None
    weights_cache_dir: Path | None = None
    keep_downloads: int = 2
    weights_api_key: Any = field(default=None, repr=False)
    version_poll_seconds: float = 0.5
    claim_poll_seconds: float = 0.05
    engine_wait_seconds: float = 120.0
    drain_timeout_seconds: float = 60.0
    extra_sampling_params: dict = field(default_factory=dict)
    lora_mode: str = "merge"
    max_lora_adapters: int | None = None

    def __post_init__(self) -> None:
        owned = {"temperature", "top_p", "top_k", "max_new_tokens"} & set(self.extra_sampling_params)
        if owned:
            raise ValueError(f"extra_sampling_params may not set {sorted(owned)}: the worker sets them "
                             "(temperature from rollout.temperature, top_p=1, top_k=-1, max_new_tokens from the buffer)")
        if self.pause_mode not in ("abort", "in_place"):
            raise ValueError(f"pause_mode must be 'abort' or 'in_place', got {self.pause_mode!r}")
        if not self.flush_cache_on_update and self.pause_mode != "in_place":
            raise ValueError("flush_cache_on_update=False keeps keys/values of the old weights across an update: "
                             f"it needs pause_mode 'in_place', got {self.pause_mode!r}")
        if self.transport not in ("disk", "http", "nccl"):
            raise ValueError(f"transport must be disk, http or nccl, got {self.transport!r}")
        if self.lora_mode not in ("merge", "by_name"):
            raise ValueError(f"lora_mode must be 'merge' or 'by_name', got {self.lora_mode!r}")
        if self.lora_mode == "by_name" and self.transport == "nccl":
            raise ValueError("lora_mode 'by_name' loads adapters from their directory: transport must be disk or http")
        if self.max_lora_adapters is not None and self.max_lora_adapters < 1:
            raise ValueError(f"max_lora_adapters must be >= 1, got {self.max_lora_adapters}")
        if self.max_inflight_requests < 1:
            raise ValueError(f"max_inflight_requests must be >= 1, got {self.max_inflight_requests}")
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError(f"worker_id must be a non-empty string without spaces, got {self.worker_id!r}")

    @classmethod
    def from_config(cls, cfg: Any, worker_id: str, **overrides: Any) -> "WorkerOptions":
        """Options from an :class:`asyncrl.core.config.AsyncRLConfig` (``overrides`` win)."""
        r = cfg.rollout
        kw: dict[str, Any] = dict(
            worker_id=worker_id, temperature=r.temperature, max_inflight_requests=r.max_inflight_requests,
            pause_mode=r.pause_mode, flush_cache_on_update=r.flush_cache_on_update,
            transport=cfg.weight_sync.transport, stop=list(r.stop),
            base_model_path=cfg.model.path, weights_api_key=cfg.security.api_key,
            lora_mode=cfg.resolved_lora_mode() or "merge",
        )
        kw.update(overrides)
        return cls(**kw)


@dataclass
class WorkerStats:
    """Counters of one worker (also exported as Prometheus metrics when a RolloutMetrics is given)."""

    segments: int = 0
    generated_tokens: int = 0
    completed: int = 0
    scored: int = 0
    reward_errors: int = 0
    parked_budget: int = 0
    parked_abort: int = 0
    lease_lost: int = 0
    version_ahead: int = 0
    engine_errors: int = 0
    weight_updates: int = 0
    weight_update_errors: int = 0
    #: segments that found the clock ahead of the engine at claim time and loaded the weights first
    caught_up: int = 0
    drained: list[str] = field(default_factory=list)
