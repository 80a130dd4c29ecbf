"""The embedded continuous-batching torch engine behind the SGLang-compatible HTTP server.

One engine owns one transformers causal LM (fp32 on CPU by default) and decodes every running sample in
one batch per step, in its own thread (torch releases the GIL inside kernels, so the aiohttp
event loop keeps serving while a step runs). The HTTP layer talks to it only through
thread-safe calls (:meth:`Engine.submit`, :meth:`Engine.abort`, :meth:`Engine.call`) and gets
progress back through the ``on_update`` callback, once per engine iteration. This module is the
scheduler (decode steps, pause/abort/retract); admission and prefill, the KV cache, weight
updates and per-sample output are mixins of :class:`Engine` in their own modules.

KV cache layout: :mod:`rollout_server.kv_cache` (one left-padded buffer per layer; a request
that arrives while a batch runs is prefilled on its own, then copied right-aligned into free
slots and joins the very next decode step; the ``n`` samples of a prompt share one prefill).

Failures: one request never fails another. A row whose logits are non-finite (or whose
sampling distribution is, after penalties, bias and temperature) fails alone with a 500 naming
it (:mod:`rollout_server.engine_outputs`, which also holds the stop and length rules); so does
a request whose own data makes the engine raise (a seed the generator refuses, a token id
outside the vocabulary, a stop rule that raises: the HTTP layer refuses these with a 400, but a
caller of the engine's API may not): a batched prefill that raises is redone prompt by prompt,
sampling that raises is redone row by row, and only the request that still raises fails.
Only an exception that belongs to no request (the decode forward pass over the whole batch,
placing rows in the KV cache) fails every live request with a 500; the engine goes on.
Weight updates are validated and converted completely (names, shapes, floating dtypes, finite
values, tied aliases) before the first copy (:mod:`rollout_server.engine_weights`).

Weights change only between steps; each output token records the version that produced it.

Device: the engine runs where its model is (``next(model.parameters()).device``): its KV
buffers, masks, position ids, index tensors and sampling generators are created there, and only
the sampled token ids and their logprobs come back to the host (one ``tolist`` per step). The
server moves the model with ``--device`` (``cpu`` by default; ``cuda`` on a GPU machine).

Pause modes (SGLang's ``/pause_generation``): ``abort`` ends every request with finish reason
abort (partial output kept), ``retract`` drops the running rows' KV and re-queues them (they
are re-prefilled from prompt + output on continue), ``in_place`` just stops stepping (KV kept).
Simplifications (no radix cache: the prompt cache, rollout_server/prompt_cache.py, matches whole
prompts, its context cache a later call's prefix that a finished call's context covers; no
chunked prefill, no tensor parallelism):
docs/rollout.md.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from rollout_server.engine_fair import EngineFair
from rollout_server.engine_outputs import EngineOutputs, eos_ids
from rollout_server.engine_prefill import EnginePrefill
from rollout_server.engine_profile import EngineProfile
from rollout_server.prompt_cache import EnginePromptCache, PromptCache
from rollout_server.engine_sample import EngineGroup, EngineSample, abort_reason
from rollout_server.engine_lora import EngineLora
from rollout_server.engine_weights import DEFERRED, EngineWeights
from rollout_server.kv_cache import KVCacheSlots
from rollout_server.sampling import RequestError

__all__ = ["Engine", "RequestError"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Item:
    """A unit of admission: token ids to prefill and the samples that continue from them."""

    ids: list[int]
    samples: list[EngineSample]
    #: when it joined the waiting queue (time.monotonic(); the scheduler delay counts from the oldest)
    queued_at: float = field(default_factory=time.monotonic)

    @property
    def big(self) -> bool:
        return bool(self.samples) and self.samples[0].big


class Engine(EngineProfile, EnginePrefill, EnginePromptCache, KVCacheSlots, EngineWeights, EngineLora, EngineOutputs,
             EngineFair):
    """Continuous-batching generation over a transformers causal LM (see the module docstring).

    Args:
        model: a transformers causal LM in eval mode (fp32 for behaviour logprobs); the engine
            runs on its device.
        tokenizer: its tokenizer (decoding for stop strings), or None.
        context_len: maximum prompt + output tokens of one sample.
        max_batch_size: most rows decoded together; more requests wait in the queue.
        weight_version: initial version string (SGLang ``--weight-version``).
        max_prefill_tokens: prompt tokens admitted per iteration (keeps decode steps flowing).
        seed: seed of the sampler for requests without ``sampling_seed``.
        threads: ``torch.set_num_threads`` for the engine (None: unchanged).
        on_update: called from the engine thread with the samples that progressed in an
            iteration (the HTTP layer forwards them to its event loop).
        reserve_rows: the fair reserve (None: ``max_batch_size // 8``). Fair scheduling (issue
            #31 item 1): the samples of requests of more samples than this ("big" requests)
            hold at most ``max_batch_size - reserve_rows`` rows together, so a small request
            never waits for a big one to finish; big requests are admitted in arrival order, and
            small ones never take the rows the oldest waiting big one needs (no starvation).
        fair_slowdown: F ≥ 1: while small requests run, a decode step costs at most F times their
            step alone in the engine's cost model; the big requests' rows share the rest, by
            deficit round robin (rollout_server/engine_fair.py). None: 2; ``math.inf``: every
            row runs in every step.
        fair_step_overhead_rows, fair_logprob_weight: the cost model's ``a`` and ``γ``
            (None: :data:`rollout_server.engine_fair.STEP_OVERHEAD_ROWS`, ``TOP_LOGPROB_WEIGHT``).
        max_loaded_loras: most named LoRA adapters registered at once (``/load_lora_adapter``;
            rollout_server/engine_lora.py; SGLang's ``--max-loaded-loras``).
        prompt_cache_tokens: prompt tokens whose keys/values the prompt cache keeps
            (rollout_server/prompt_cache.py; 0: no cache).
        context_cache_tokens: tokens of finished samples' contexts (prompt and output) whose
            keys/values the context cache keeps, so that a later model call of an episode, whose
            prompt extends an earlier call's context, runs only its new tokens through the model
            (rollout_server/prompt_cache.py; SGLang's radix cache does this; 0: no cache).
        scheduler_delay_factor: d ≥ 0: while rows are decoding, waiting requests are admitted
            only once the oldest has waited d times the last prefill's duration, so arrivals
            spread over several decode steps share one prefill forward pass (vLLM's
            ``--scheduler-delay-factor``). 0: admit at every iteration (SGLang's behaviour).
            An idle engine admits at once either way.

    Raises:
        ValueError: ``prompt_cache_tokens``, ``context_cache_tokens`` or ``scheduler_delay_factor`` is negative.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        context_len: int,
        max_batch_size: int = 64,
        weight_version: str = "default",
        max_prefill_tokens: int = 4096,
        seed: int = 0,
        threads: int | None = None,
        on_update: Callable[[list[EngineSample]], None] | None = None,
        reserve_rows: int | None = None,
        max_loaded_loras: int = 8,
        fair_slowdown: float | None = None,
        fair_step_overhead_rows: float | None = None,
        fair_logprob_weight: float | None = None,
        prompt_cache_tokens: int = 4096,
        context_cache_tokens: int = 4096,
        scheduler_delay_factor: float = 0.0,
    ):
        import torch

        if not scheduler_delay_factor >= 0.0:
            raise ValueError(f"scheduler_delay_factor must be >= 0 (a multiple of the last prefill's duration), "
                             f"got {scheduler_delay_factor}")
        self.scheduler_delay_factor = float(scheduler_delay_factor)
        self._last_prefill_seconds = 0.0  # wall time of the last prefill (forward pass and first tokens)
        #: weight updates applied so far, named or not (a row's keys/values are current if none came since its prefill)
        self.weights_epoch = 0
        # weights_epoch after the last update that flushed the caches (SGLang's ``flush_cache``, true
        # by default): a row prefilled before it holds keys/values of weights the caller asked to
        # forget, so the context cache never keeps it (prompt_cache._remember_context)
        self.kv_flush_epoch = 0

        self.torch = torch
        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.context_len = int(context_len)
        self.max_batch_size = int(max_batch_size)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.reserve_rows = min(self.max_batch_size - 1, max(0, int(
            self.max_batch_size // 8 if reserve_rows is None else reserve_rows)))
        self.weight_version = str(weight_version)
        self.on_update = on_update
        #: how long an idle engine waits after the first arrival to batch near-simultaneous requests
        self.admission_wait_seconds = 0.005
        self.threads = threads
        self.num_layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device  # every tensor the engine makes lives here
        self.eos_ids = eos_ids(model, tokenizer)
        self.generator = torch.Generator(device=self.device).manual_seed(int(seed))
        self._init_batch(model)  # batch state (engine thread only): kv_cache.KVCacheSlots
        # queues
        self._inbox: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._waiting: collections.deque[_Item] = collections.deque()
        self._paused: str | None = None
        # (state, version, future, merged adapter info or None, flush_cache)
        self._pending_updates: list[tuple[dict, str | None, Future, dict | None, bool]] = []
        self.lora_adapter: dict | None = None  # the merged LoRA adapter (engine_weights.py), None: none
        self._lora_base: dict | None = None  # base values of the tensors an adapter was merged into
        self._init_lora(max_loaded_loras)  # named adapters applied per request (engine_lora.py)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: dict[str, EngineSample] = {}  # rid -> sample (waiting or running)
        self._finished_unpublished: list[EngineSample] = []
        # statistics (read by metrics; plain ints are updated atomically under the GIL)
        self.stats = {
            "prompt_tokens_total": 0,
            "prefill_forward_tokens_total": 0,  # prompt tokens run through a prefill forward (shared prompts once)
            "prompt_cache_hits_total": 0,  # distinct prompts of a prefill served by the prompt cache
            "prefill_batches_total": 0,  # admissions (each one prefill of the prompts admitted together)
            "context_cache_hits_total": 0,  # prompts whose leading tokens came from a finished call's keys/values
            "generation_tokens_total": 0,
            "num_requests_total": 0,
            "num_aborted_requests_total": 0,
            "num_retractions_total": 0,
            "decode_steps_total": 0,
            "nonfinite_logits_total": 0,
            "request_errors_total": 0,  # requests failed alone by an error of their own (engine_outputs._fail_requests)
            "follow_switches_total": 0,  # thread-count changes under resources.core_sharing: follow
        }
        self._init_fair(fair_slowdown, fair_step_overhead_rows, fair_logprob_weight)  # engine_fair.py
        # resources.core_sharing: follow — all cores' threads while the trainer waits (asyncrl/core/core_follow.py)
        from asyncrl.core.core_follow import follower_from_env

        self.follower = follower_from_env(threads, torch.set_num_threads)
        self._throughput_window: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._profile_init()  # seconds per component of the engine thread (engine_profile.py)
        self.prompt_cache = PromptCache(prompt_cache_tokens) if prompt_cache_tokens else None
        self.context_cache = PromptCache(context_cache_tokens) if context_cache_tokens else None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------------------------------
    # thread-safe API

    def start(self) -> "Engine":
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="asyncrl-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running are aborted."""
        self._stop.set()
        self._inbox.put(("noop",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, groups: Iterable[EngineGroup]) -> None:
        """Queue prompt groups for generation (their samples must have unique rids)."""
        self._inbox.put(("submit", list(groups)))

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort requests whose rid starts with ``rid`` (SGLang's prefix match), or all of them."""
        self._inbox.put(("abort", rid, abort_all))

    def abort_samples(self, samples: Iterable[EngineSample]) -> None:
        """Abort exactly these samples (no rid prefix match: a client that left stops only its own)."""
        self._inbox.put(("abort_samples", frozenset(id(s) for s in samples)))

    def call(self, name: str, *args: Any) -> Future:
        """Run a control command in the engine thread between steps; returns its Future.

        Commands: ``pause(mode)``, ``resume()``, ``update_weights(state_dict, version,
        abort_all[, flush_cache])``, ``update_adapter(adapter_state, adapter_config, checksum, version,
        abort_all[, flush_cache])``,
        ``load_lora(name, path, adapter_state, adapter_config, checksum)``, ``unload_lora(name)``,
        ``flush_cache()``, ``set_version(version)``.
        """
        fut: Future = Future()
        self._inbox.put(("call", name, args, fut))
        return fut

    def has_rid(self, rid: str) -> bool:
        return rid in self._live

    def load(self) -> dict:
        """Counters for /v1/loads and /metrics (a consistent-enough snapshot)."""
        running = sum(1 for r in self._rows if r is not None)
        waiting = sum(len(it.samples) for it in list(self._waiting))
        used = sum(len(r.sample.prompt_ids) + len(r.sample.output_ids) for r in list(self._rows) if r is not None)
        return {
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_used_tokens": used,
            "max_total_num_tokens": self.max_total_num_tokens,
            "token_usage": used / self.max_total_num_tokens if self.max_total_num_tokens else 0.0,
            "gen_throughput": self.gen_throughput(),
            "num_paused_reqs": running + waiting if self._paused in ("in_place", "retract") else 0,
            "paused": self._paused,
        }

    @property
    def max_request_rows(self) -> int:
        """Most samples one request may have (a big request's rows never exceed this; see ``reserve_rows``)."""
        return self.max_batch_size - self.reserve_rows

    @property
    def max_total_num_tokens(self) -> int:
        return self.max_batch_size * self.context_len

    def gen_throughput(self) -> float:
        """Generated tokens per second over the last few seconds of decode steps."""
        w = list(self._throughput_window)
        now = time.monotonic()
        w = [(t, n) for t, n in w if now - t < 5.0]
        if len(w) < 2:
            return 0.0
        span = w[-1][0] - w[0][0]
        return sum(n for _, n in w[1:]) / span if span > 0 else 0.0

    # ------------------------------------------------------------------------------------------
    # engine thread

    def _run(self) -> None:
        torch = self.torch
        if self.threads:
            torch.set_num_threads(int(self.threads))
        self._profile_start()
        with torch.inference_mode():
            while not self._stop.is_set():
                self._profile_add("other")  # the loop's own overhead, an error's handling
                busy = self._can_step() or self._can_admit()
                try:
                    self._drain_inbox(block=not busy)
                    if not busy and self._waiting and not any(r is not None for r in self._rows):
                        # the engine was idle: give requests sent together a moment to arrive together,
                        # so they share one prefill instead of the first one being prefilled alone
                        self._wait(self.admission_wait_seconds)
                        self._drain_inbox(block=False)
                    self._apply_pending_updates()
                    if self.follower is not None:  # between steps: an OpenMP team is never resized mid-operation
                        self.follower.poll()
                        self.stats["follow_switches_total"] = self.follower.switches
                    updated: list[EngineSample] = []
                    if self._paused is None:
                        self._profile_add("other")
                        self._phase = "prefill"
                        updated += self._admit()
                        self._profile_add("prefill_other")
                        if any(r is not None for r in self._rows):
                            self._phase = "decode"
                            updated += self._decode_step()
                            self._profile_add("decode_other")
                    self._publish(updated)
                    self._profile_add("publish")
                except Exception as exc:  # a broken step fails its requests, never the server
                    log.exception("engine step failed")
                    self.error = exc
                    try:
                        self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
                    except Exception:  # the thread must survive, or every later request would hang
                        log.exception("failing the live requests after an engine error failed")
                        self._live.clear()
                        self._waiting.clear()
                        self._pending_updates.clear()
                        self._release_buffers()
            self._fail_all("server shutting down")

    def _can_step(self) -> bool:
        return self._paused is None and any(r is not None for r in self._rows)

    def _can_admit(self) -> bool:
        return self._paused is None and bool(self._waiting) and not self._pending_updates

    def _drain_inbox(self, block: bool) -> None:
        first = True
        while True:
            try:
                msg = self._wait(0.5, self._inbox.get) if (block and first) else self._inbox.get_nowait()
            except queue.Empty:
                return
            first = False
            kind = msg[0]
            if kind == "submit":  # one submit = one request: big when it has more samples than the reserve
                big = sum(len(g.samples) for g in msg[1]) > self.reserve_rows
                gone = self._resolve_adapters([s for g in msg[1] for s in g.samples])
                if gone:  # its adapter was unloaded after the HTTP layer checked the name: the whole request fails
                    for g in msg[1]:
                        for s in g.samples:
                            self._finish(s, {"type": "abort", "status_code": 400, "err_type": "BadRequest",
                                             "message": f"LoRA adapter {gone[0].lora_name!r} is not loaded (unloaded "
                                                        "while the request arrived)"})
                    self._publish([])
                    continue
                for g in msg[1]:
                    for s in g.samples:
                        self._live[s.rid] = s
                        s.big = big
                        self._fair_enter(s)
                    self._waiting.append(_Item(list(g.prompt_ids), list(g.samples)))
                    self.stats["num_requests_total"] += len(g.samples)
            elif kind == "abort":
                self._publish(self._abort(msg[1], msg[2]))
            elif kind == "abort_samples":
                self._publish(self._abort("", False, exact=msg[1]))
            elif kind == "call":
                _, name, args, fut = msg
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    result = getattr(self, "_cmd_" + name)(*args, fut=fut)
                except Exception as exc:
                    fut.set_exception(exc)
                else:
                    if result is not DEFERRED:
                        fut.set_result(result)

    def _wait(self, seconds: float, get: Callable[..., Any] | None = None) -> Any:
        """Block up to ``seconds`` (on ``get(timeout=...)``, or sleeping), charged to ``idle``/``paused``."""
        t0 = time.perf_counter()
        try:
            return get(timeout=seconds) if get is not None else time.sleep(seconds)
        finally:
            dt = time.perf_counter() - t0
            self.profile["paused" if self._paused is not None else "idle"] += dt
            self._inner += dt

    def _publish(self, samples: list[EngineSample]) -> None:
        if self._finished_unpublished:
            samples = list(samples) + self._finished_unpublished
            self._finished_unpublished = []
        if not samples:
            return
        seen: set[int] = set()
        uniq = []
        for s in samples:
            if id(s) not in seen:
                seen.add(id(s))
                s.published = (len(s.output_ids), s.finish_reason)
                uniq.append(s)
        if self.on_update is not None:
            self.on_update(uniq)

    # -- commands ---------------------------------------------------------------------------

    def _cmd_pause(self, mode: str, fut: Future) -> dict:
        updated: list[EngineSample] = []
        if mode == "abort":
            updated = self._abort("", True)
        elif mode == "retract":
            updated = self._retract_all()
        elif mode != "in_place":
            raise RequestError(f"unknown pause mode {mode!r}: use abort, retract or in_place")
        self._paused = mode
        self._publish(updated)
        return {"num_paused_requests": self.load()["num_running_reqs"] + len(self._waiting)}

    def _cmd_resume(self, fut: Future) -> dict:
        self._paused = None
        return {}

    def _cmd_set_version(self, version: str, fut: Future) -> str:
        self.weight_version = str(version)
        return self.weight_version

    def _cmd_flush_cache(self, fut: Future) -> bool:
        if any(r is not None for r in self._rows) or self._waiting:
            return False
        self._release_buffers()
        for cache in (self.prompt_cache, self.context_cache):
            if cache is not None:
                cache.clear()
        return True

    # -- abort / retract ----------------------------------------------------------------------

    def _abort(self, rid: str, abort_all: bool, exact: frozenset[int] = frozenset()) -> list[EngineSample]:
        """Abort by rid prefix, all, or (``exact``) the samples with these ``id()``s."""
        if exact:
            hit = lambda s: id(s) in exact  # noqa: E731
        elif not rid and not abort_all:
            return []  # SGLang ignores an empty rid without abort_all
        else:
            hit = lambda s: abort_all or s.rid.startswith(rid)  # noqa: E731
        updated: list[EngineSample] = []
        kept: collections.deque[_Item] = collections.deque()
        for item in self._waiting:
            keep = []
            for s in item.samples:
                if hit(s):
                    self._finish(s, abort_reason("Abort in waiting queue"))
                    updated.append(s)
                else:
                    keep.append(s)
            if keep:
                kept.append(_Item(item.ids, keep, item.queued_at))
        self._waiting = kept
        for i, row in enumerate(self._rows):
            if row is not None and hit(row.sample):
                self._finish(row.sample, abort_reason("Aborted"))
                self._rows[i] = None
                updated.append(row.sample)
        self.stats["num_aborted_requests_total"] += len(updated)
        self._maybe_compact()
        return updated

    def _retract_all(self) -> list[EngineSample]:
        items = []
        for i, row in enumerate(self._rows):
            if row is not None:
                s = row.sample
                s.num_retractions += 1
                self.stats["num_retractions_total"] += 1
                items.append(_Item(s.prompt_ids + s.output_ids, [s]))
                self._rows[i] = None
        self._waiting.extendleft(reversed(items))
        self._maybe_compact()
        return []

    def _fail_all(self, message: str) -> None:
        """End every live request (running, queued, or mid-admission) with a 500 and reset the batch."""
        updated = []
        for s in list(self._live.values()):
            if not s.finished:
                self._finish(s, {"type": "abort", "message": message, "status_code": 500, "err_type": "InternalServerError"})
                updated.append(s)
        self._live.clear()
        self._waiting.clear()
        self._release_buffers()
        for update in self._pending_updates:
            update[2].set_exception(RuntimeError(message))
        self._pending_updates.clear()
        self._publish(updated)

    # -- decode -------------------------------------------------------------------------------

    def _decode_step(self) -> list[EngineSample]:
        """One token for every row the fair policy runs (all rows, or a prefix of the slots: engine_fair.py)."""
        torch = self.torch
        width = self._fair_width()  # None: every row; else the step runs slots [0, width) (arranged)
        if self._squeeze_holes():
            self.stats["fair_squeezes_total"] += 1
        self._ensure_capacity(len(self._rows), self._length + 1)
        B = len(self._rows) if width is None else width
        col = self._length
        if width is not None:
            self._leave_hole(width)  # the rows left out keep everything; the column is a masked hole in them
        self._mask[:B, col] = True
        mask4 = self._mask[:B, None, None, : col + 1]
        out = self._forward_with_adapters(
            [r.sample.adapter if r is not None else None for r in self._rows[:B]],
            input_ids=self._next[:B, None],
            attention_mask=mask4,
            position_ids=self._pos[:B, None],
            past_key_values=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._length = col + 1
        self._pos[:B] += 1
        live = [i for i, r in enumerate(self._rows[:B]) if r is not None]
        logits = out.logits[:, -1, :].float()
        if len(live) < B:
            logits = logits[torch.tensor(live, device=self.device)]
        samples = [self._rows[i].sample for i in live]
        self.stats["decode_steps_total"] += 1
        self._fair_account(width, samples)
        bad = self._nonfinite_rows(logits)
        failed: list[EngineSample] = []
        if bad:
            # a row whose logits are NaN/inf fails alone (500 with a clear message); the batch goes on
            bad_set = set(bad)
            for k in bad:
                self._rows[live[k]] = None
            failed = self._fail_nonfinite([samples[k] for k in bad], "a decode step")
            keep = [k for k in range(len(live)) if k not in bad_set]
            live = [live[k] for k in keep]
            samples = [samples[k] for k in keep]
            logits = logits[torch.tensor(keep, dtype=torch.long, device=self.device)]
            if not live:
                self._maybe_compact()
                return failed
        tokens, lps, tops, failed2 = self._sample(logits, samples)
        if failed2:
            gone = {id(s) for s in failed2}
            for k, s in enumerate(samples):
                if id(s) in gone:
                    self._rows[live[k]] = None
            failed += failed2
            keep = [k for k, s in enumerate(samples) if id(s) not in gone]
            live = [live[k] for k in keep]
            samples = [samples[k] for k in keep]
            if not live:
                self._maybe_compact()
                return failed
        if len(live) < B:
            self._next[torch.tensor(live, device=self.device)] = torch.tensor(tokens, dtype=torch.long, device=self.device)
        else:
            self._next[:B] = torch.tensor(tokens, dtype=torch.long, device=self.device)
        updated = self._append_tokens(samples, tokens, lps, tops, live)
        if failed and not any(s.finished for s in samples):
            self._maybe_compact()
        return failed + updated
