"""What the embedded engine generates: one output sequence (:class:`EngineSample`) and a prompt's samples (:class:`EngineGroup`).

Kept apart from :mod:`rollout_server.engine` so the engine's mixins (outputs, prefill, KV cache)
and the HTTP layer use these types without importing the engine back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rollout_server.sampling import SamplingParams

__all__ = ["EngineGroup", "EngineSample", "abort_reason"]


def abort_reason(message: str = "Aborted") -> dict:
    """SGLang's abort finish reason (``FINISH_ABORT.to_json()``)."""
    if message == "Aborted":
        return {"type": "abort", "message": message, "status_code": None, "err_type": None}
    return {"type": "abort", "message": message}


@dataclass(eq=False)
class EngineSample:
    """One output sequence being generated (a ``/generate`` request, or one of its ``n`` samples).

    The engine thread appends to the lists and then replaces :attr:`published` (an immutable
    ``(num_tokens, finish_reason)`` snapshot); readers in other threads look at
    ``published`` first and slice the lists up to that length, so they never see a torn state.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)
    input_token_logprobs: list[Any] | None = None
    #: ``[(weight_version, first output index), ...]``: which weights produced which tokens
    version_starts: list[tuple[str, int]] = field(default_factory=list)
    finish_reason: dict | None = None
    published: tuple[int, dict | None] = (0, None)
    created_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_retractions: int = 0
    cached_tokens: int = 0
    generator: Any = None
    #: set by the HTTP layer: anything with ``.set()`` (an asyncio.Event) woken on progress
    waiter: Any = None
    index: int = 0
    #: engine-private: the sample belongs to a request of more samples than the fair reserve
    #: (:attr:`Engine.reserve_rows`); such requests share at most ``max_batch_size - reserve_rows`` rows
    big: bool = False
    #: the named LoRA adapter the request asked for (``lora_path``; rollout_server/engine_lora.py), None: the base
    lora_name: str | None = None
    #: engine-private: that adapter, bound at submission (kept to the sample's end, even if unloaded meanwhile)
    adapter: Any = None
    #: engine-private, fair decode steps (rollout_server/engine_fair.py): arrival order; decode steps
    #: the sample ran in and waited through; the modelled cost of the steps it ran in (plain-row units)
    fair_seq: int = 0
    fair_steps: int = 0
    fair_waits: int = 0
    fair_cost: float = 0.0
    # engine-private
    _stop_scan_from: int = 0
    _stop_text_len: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class EngineGroup:
    """Samples that share one prompt (and so one prefill): one prompt's ``n`` samples.

    The engine's unit of submission, not the buffer's prompt group (:class:`asyncrl.core.types.PromptGroup`,
    which carries a group id, metadata and its place in the run).
    """

    prompt_ids: list[int]
    samples: list[EngineSample]
