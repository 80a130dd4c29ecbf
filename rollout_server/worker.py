"""The streaming rollout worker: buffer work -> engine ``/generate`` stream -> buffer.

Steps 3-7 and 12 of docs/architecture.md#data-flow-of-one-sample.

One :class:`RolloutWorker` drives **one** rollout engine (SGLang or the embedded torch engine,
through :class:`rollout_server.client.EngineClient`) for **one** run's replay buffer. Several
rollout servers share a buffer by running one worker each (``asyncrl rollout-server
--server_index i`` per server, or one process with one worker per URL of
``rollout.server_urls``): the buffer's leases decide who generates what, so workers never talk
to each other. Pausing for a weight update is per engine, which is why a worker owns exactly
one engine. Beside this module: ``rollout_server/worker_weights.py`` (the version clock and
weight loading, :class:`~rollout_server.worker_weights.WorkerWeightSync`, a base of
:class:`RolloutWorker`) and ``rollout_server/worker_options.py`` (:class:`WorkerOptions`,
:class:`WorkerStats`, :class:`WorkerError`, all importable from here).

What a worker does, concurrently (asyncio tasks):

* **Claim loop.** Keeps ``rollout.max_inflight_requests`` work items in flight
  (``ReplayBuffer.claim``: unscored completes, resumable partials, fresh samples, then idle
  budget-parked ones). A ``GENERATE`` item becomes one streamed ``/generate`` with
  ``input_ids = prompt_ids + response_ids`` (token ids, never re-tokenized text),
  ``temperature`` from the config, ``top_p = 1``, ``top_k = -1`` (so behaviour logprobs are
  ``log_softmax(logits / T)``, the trainer's quantity), ``max_new_tokens`` from the item
  (``min(M - produced under this version, max_response_len - len(response_ids))``, computed by
  the buffer) and ``return_logprob``. New tokens, their logprobs and their policy versions are
  appended every ``buffer.flush_tokens`` tokens; the end of the call ends the segment:
  ``stop`` -> COMPLETE, then scored by the task's reward function (a raising reward marks the
  sample FAILED with the error); ``length`` at ``max_response_len`` -> COMPLETE (``length``);
  ``length`` below it -> PARTIAL parked at the budget (sent as ``budget``); ``abort`` (weight
  update, shutdown, engine lost) -> PARTIAL, resumable now. A ``SCORE`` item (its previous
  worker died after completing it) is only scored.
* **Version clock (pull).** Subscribes to the weights channel and polls
  ``clock.latest()`` (pub/sub can miss messages). On a newer version (or a new lineage) it
  fetches the weights first (``http``: download + sha256 check via
  :func:`asyncrl.core.weights.download_weights` into a local cache; ``disk``: the announced
  directory), then pauses the engine (``rollout.pause_mode``: ``abort`` ends every request, its
  partial output becoming an old-version segment; ``in_place`` keeps the KV cache and relies on
  per-token versions), loads the weights with ``/update_weights_from_disk`` and
  ``weight_version``, and continues. Claiming stops during the update. Resumable partials
  come back through the claim loop. ``nccl``: the trainer pushes the weights itself
  (``/update_weights_from_distributed``); the worker only waits until the engine reports the
  announced version.
* **Per-token versions** come from the engine (per-token ``meta_info.weight_versions`` spans,
  else ``meta_info.weight_version``), never from the worker's belief. A version string that is
  not an integer (SGLang's ``"default"``) means the weights the worker loaded last. With LoRA
  adapters by name (``lora_mode: by_name``) a request names its adapter (``lora_path``), which
  serves it to its end, so its tokens carry that adapter's version (worker_weights.py).
* **Heartbeat.** Renews the leases of everything in flight every ``lease_seconds / 3``; an
  item whose lease is gone is cancelled (the closed stream aborts the engine request) and left
  to its new owner.
* **Errors** (docs/buffer.md): ``LeaseLost`` -> drop the item (someone else owns it now);
  ``VersionAhead`` (the engine holds weights of an abandoned lineage) -> park the item without
  its tokens and reload the announced weights; engine unreachable -> park what was received,
  wait for ``/health``, reload weights (a restarted engine starts from the base model);
  the engine failing on a request (HTTP 5xx or an error chunk) -> park what was received and
  retry, up to ``MAX_ENGINE_FAILURES`` times per sample; the engine rejecting a request (HTTP
  4xx, e.g. a prompt longer than the context) -> the worker stops with :class:`WorkerError`
  naming the sample: the run is misconfigured.
* **Drain** (:meth:`RolloutWorker.drain`, SIGTERM): stop claiming, abort this worker's
  requests on the engine, park every in-flight sample as PARTIAL with all its tokens.

Simplifications: the per-sample duration metric measures from this worker's first claim of
the sample (exact when one worker generated the whole sample); ``disk`` weights are not
re-hashed (the trainer renames complete directories into place atomically); ``http`` downloads
are kept under ``weights_cache_dir`` (the last ``keep_downloads`` versions).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from asyncrl.core.aio import cancel_and_wait
from asyncrl.core.types import SampleStatus, WorkItem, WorkKind
from buffers.errors import LeaseLost, UnknownItem, VersionAhead
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rollout_server.client import EngineClient, EngineError, EngineUnavailable
from rollout_server.worker_options import WorkerError, WorkerOptions, WorkerStats
from rollout_server.worker_weights import WorkerWeightSync

__all__ = ["WorkerOptions", "RolloutWorker", "WorkerError", "WorkerStats"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Active:
    item: WorkItem
    task: asyncio.Task | None = None
    lost: bool = False
    requested: bool = False
    scoring: bool = False


def _now() -> float:
    return time.monotonic()


class RolloutWorker(WorkerWeightSync):
    """Streams rollouts of one engine into one replay buffer (see the module docstring).

    Args:
        buffer: an open :class:`buffers.ReplayBuffer` (its settings give ``flush_tokens``,
            ``lease_seconds`` and ``max_response_len``).
        client: the engine's :class:`EngineClient`.
        scorer: an :class:`asyncrl.tasks.rewards.RewardScorer` (never raises; errors -> FAILED).
        tokenizer: decodes prompt and response ids into text for the reward function.
        options: :class:`WorkerOptions`.
        metrics: optional :class:`asyncrl.metrics.RolloutMetrics`.
        episodes: optional :class:`rollout_server.episodes.EpisodeRunner`: each work item is then
            an episode of a multi-turn workflow (docs/agents.md) instead of one engine call.

    Usage::

        worker = RolloutWorker(buf, EngineClient(url), scorer, tokenizer, WorkerOptions("w0"))
        stop = asyncio.Event()
        await worker.run(stop)        # returns after stop is set and the worker drained
    """

    #: engine failures (HTTP 5xx / error chunks) tolerated per sample before the worker stops
    MAX_ENGINE_FAILURES = 3

    def __init__(self, buffer: Any, client: EngineClient, scorer: Any, tokenizer: Any, options: WorkerOptions,
                 metrics: Any = None, episodes: Any = None) -> None:
        self.buffer = buffer
        self.episodes = episodes
        self.client = client
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.opts = options
        self.metrics = metrics
        self.settings = buffer.settings
        self.stats = WorkerStats()
        self.version: int | None = None
        self.lineage: int | None = None
        #: lora_mode by_name: the adapter name of ``version`` (None: the base model); worker_weights.py
        self.adapter: str | None = None
        self._adapters: dict[str, int] = {}  # adapter names this worker registered on the engine (load order) -> version
        self._engine_adapters: set[str] = set()  # names the engine listed at the last load/unload
        self._adapter_pruning: asyncio.Task | None = None
        self._active: dict[str, _Active] = {}
        self._first_claim: dict[str, float] = {}
        self._claim_gate = asyncio.Event()
        self._claim_gate.set()
        self._slot_free = asyncio.Event()
        self._announced = asyncio.Event()
        self._update_lock = asyncio.Lock()
        self._draining = False
        self._stopping = False
        self._resync = False
        self._engine_lost = False
        self._fatal: BaseException | None = None
        self._in_outage = False  # a Redis outage is in progress (one WARNING line per outage)
        self._outage_samples = 0  # in-flight samples it interrupted
        self._retry_after = 0.0
        self._rid_counter = 0
        self._engine_failures: dict[str, int] = {}

    # ------------------------------------------------------------------ public API
    @property
    def inflight(self) -> int:
        """Work items this worker holds right now (generating or scoring)."""
        return len(self._active)

    async def run(self, stop: asyncio.Event | None = None) -> WorkerStats:
        """Claim and generate until ``stop`` is set, then drain; returns the counters.

        Raises:
            WorkerError: the engine rejected a request or stayed unreachable (in-flight samples
                are parked first).
            buffers.errors.BufferError: the buffer failed in a way the worker cannot handle.
        """
        stop = stop or asyncio.Event()
        await self.sync_weights(initial=True)
        await self._warm_scorer()
        helpers = [asyncio.create_task(self._watch_versions(), name="version-watch"),
                   asyncio.create_task(self._subscribe(), name="version-subscribe"),
                   asyncio.create_task(self._heartbeat(), name="lease-heartbeat")]
        try:
            await self._claim_loop(stop)
        finally:
            try:
                await self.drain()
            finally:
                self._stopping = True  # the helpers' loops end even if a cancellation is swallowed
                await cancel_and_wait(helpers)
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    async def drain(self) -> list[str]:
        """Stop claiming, abort this worker's engine requests, park every in-flight sample.

        Samples that were generating end their segment with ``abort`` (PARTIAL with every token
        received; one with no tokens goes back to PENDING); samples being scored finish scoring.
        Returns the ids of the samples that were generating when the drain began (also kept in
        ``stats.drained``).
        """
        self._draining = True
        generating = [sid for sid, a in self._active.items() if a.item.kind == WorkKind.GENERATE and not a.scoring]
        self.stats.drained = list(generating)
        deadline = _now() + self.opts.drain_timeout_seconds
        while self._active and _now() < deadline:
            if any(a.requested and not a.scoring for a in self._active.values()):
                with contextlib.suppress(EngineUnavailable, EngineError):
                    await self.client.abort(rid=self.opts.worker_id + "-")
            tasks = [a.task for a in self._active.values() if a.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=0.25)
        if self._active:  # engine hung: leave the rest to lease expiry
            log.warning("drain: %d samples still in flight after %.0f s; their leases will expire",
                        len(self._active), self.opts.drain_timeout_seconds)
            for a in list(self._active.values()):
                if a.task is not None:
                    a.lost = True
                    a.task.cancel()
        return generating

    # ------------------------------------------------------------------ claim loop
    async def _claim_loop(self, stop: asyncio.Event) -> None:
        stop_wait = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set() and self._fatal is None:
                if self._engine_lost:
                    await self._recover_engine(stop)
                    continue
                if self._resync and _now() >= self._retry_after:
                    self._resync = False
                    await self.sync_weights(initial=True)
                if not self._claim_gate.is_set():
                    await _wait_any(self._claim_gate.wait(), stop_wait, timeout=1.0)
                    continue
                free = self.opts.max_inflight_requests - len(self._active)
                if free <= 0:
                    self._slot_free.clear()
                    await _wait_any(self._slot_free.wait(), stop_wait, timeout=1.0)
                    continue
                try:
                    t_claim = _now()
                    items = await self.buffer.claim(self.opts.worker_id, free)
                    self._spent("claim", t_claim)
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    self._note_outage(f"claim failed ({exc}); retrying every second")
                    await _wait_any(asyncio.sleep(1.0), stop_wait, timeout=1.0)
                    continue
                self._note_recovery()
                if not items:
                    self._set_idle(not self._active)
                    self._slot_free.clear()
                    await _wait_any(self._slot_free.wait(), stop_wait, timeout=self.opts.claim_poll_seconds)
                    continue
                self._set_idle(False)
                for item in items:
                    self._start(item)
        finally:
            stop_wait.cancel()

    def _note_outage(self, what: str) -> None:
        """One WARNING line per Redis outage (the first symptom); the rest are counted, at DEBUG."""
        if not self._in_outage:
            self._in_outage = True
            log.warning("redis unreachable: %s; further interruptions during this outage are counted, not logged",
                        what)
        else:
            log.debug("redis unreachable: %s", what)

    def _note_recovery(self) -> None:
        """One line when the first Redis call after an outage (a claim, a clock poll) succeeds."""
        if self._in_outage:
            self._in_outage = False
            log.warning("redis reachable again; %d in-flight samples were interrupted during the outage and are "
                        "reclaimed when their leases expire", self._outage_samples)
            self._outage_samples = 0

    def _start(self, item: WorkItem) -> None:
        a = _Active(item)
        self._active[item.sample_id] = a
        self._first_claim.setdefault(item.sample_id, _now())
        a.task = asyncio.create_task(self._process(a), name=f"sample-{item.sample_id}")
        self._report_inflight()

    async def _process(self, a: _Active) -> None:
        try:
            if self.episodes is not None:
                await self._episode(a)
            elif a.item.kind == WorkKind.SCORE:
                await self._score(a.item, a.item.response_ids)
            else:
                await self.generate(a)
        except asyncio.CancelledError:
            if not a.lost:
                raise
        except LeaseLost:
            self.stats.lease_lost += 1
            log.info("lease of sample %s lost; it belongs to another worker now", a.item.sample_id)
        except UnknownItem:
            log.info("sample %s no longer exists (group dropped or drained)", a.item.sample_id)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            self._outage_samples += 1
            self._note_outage(f"sample {a.item.sample_id} interrupted ({exc}); its lease will expire and it is "
                              "reclaimed")
        except WorkerError as exc:
            self._fatal = self._fatal or exc
        except Exception as exc:  # a buffer or scorer failure must not kill the worker silently
            log.exception("sample %s failed in the worker", a.item.sample_id)
            self._fatal = self._fatal or exc
        finally:
            self._active.pop(a.item.sample_id, None)
            self._slot_free.set()
            self._report_inflight()

    # ------------------------------------------------------------------ one engine call
    def sampling_params(self, item: WorkItem) -> dict:
        """SGLang ``sampling_params`` of the engine call for ``item`` (RL sampling: top_p 1, top_k -1)."""
        params: dict[str, Any] = {"temperature": self.opts.temperature, "top_p": 1.0, "top_k": -1,
                                  "max_new_tokens": int(item.max_new_tokens), "skip_special_tokens": False,
                                  "no_stop_trim": True}
        if self.opts.stop:
            params["stop"] = list(self.opts.stop)
        params.update(self.opts.extra_sampling_params)
        return params

    def finish_reason(self, item: WorkItem, engine_finish: str | None, response_len: int) -> str:
        """Buffer finish reason of a segment from the engine's (``stop``/``length``/``abort``/None).

        ``length`` becomes ``length`` at ``max_response_len`` (COMPLETE) and ``budget`` below it
        (the per-version budget ran out: PARTIAL parked at the budget); None (stream ended
        without a finish reason) is ``abort``.
        """
        if engine_finish == "stop":
            return "stop"
        if engine_finish == "length":
            return "length" if response_len >= self.settings.max_response_len else "budget"
        return "abort"

    def _version_of(self, v: str) -> int:
        try:
            return int(v)
        except (TypeError, ValueError):
            return int(self.version or 0)

    def _next_rid_name(self, what: str) -> str:
        self._rid_counter += 1
        return f"{self.opts.worker_id}-{what}-{self._rid_counter}-{uuid.uuid4().hex[:6]}"

    def _next_rid(self, item: WorkItem) -> str:
        self._rid_counter += 1
        return f"{self.opts.worker_id}-{item.sample_id}-{self._rid_counter}-{uuid.uuid4().hex[:6]}"

    async def process(self, item: WorkItem) -> SampleStatus | None:
        """Handle one claimed item outside the claim loop (generate one segment and/or score it).

        Returns the sample's status after the segment (None when the item was given up).
        Raises as :meth:`generate`.
        """
        a = _Active(item)
        self._first_claim.setdefault(item.sample_id, _now())
        if self.episodes is not None:
            return await self._episode(a)
        if item.kind == WorkKind.SCORE:
            await self._score(item, item.response_ids)
            return SampleStatus.SCORED
        return await self.generate(a)

    async def generate(self, a: _Active) -> SampleStatus | None:
        """One engine call (segment) for a GENERATE item; scores it if it completed.

        Returns the sample's status after the segment (None when the item was given up).

        Raises:
            LeaseLost / UnknownItem: the item is no longer ours (nothing more is written).
            WorkerError: the engine rejected the request (4xx).
        """
        item = a.item
        if self._draining:  # claimed just before the drain: give it back untouched
            await self.buffer.end_segment(item, "abort")
            self._note_parked("shutdown")
            return None
        if (self.version is not None and item.lineage == self.lineage and item.clock_version > self.version
                and self.opts.transport != "nccl"):
            # The clock moved after the engine's last load and this worker has not noticed yet
            # (it polls and subscribes): load the new weights before generating, rather than
            # produce tokens the staleness bound may reject (with max_staleness 0, every one).
            await self._catch_up()
        if item.response_ids and self.metrics is not None:
            self.metrics.resumed()
        response = list(item.response_ids)
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        flush = self.settings.flush_tokens
        engine_finish: str | None = None
        t0 = _now()
        rid = self._next_rid(item)
        a.requested = True
        lora, tag = self._adapter_request()  # by_name: lora_path of this version's adapter, and its label
        stream = self.client.generate_stream(item.prompt_ids + item.response_ids, self.sampling_params(item),
                                             rid=rid, return_logprob=True, **lora)
        try:
            async with contextlib.aclosing(stream):
                async for d in stream:
                    vers += self._token_versions(d, tag)
                    ids += d.token_ids
                    lps += d.logprobs
                    if d.finish_reason is not None:
                        engine_finish = d.finish_reason.get("type")
                        break
                    if len(ids) >= flush:
                        t_write = _now()
                        await self.buffer.append(item, ids, lps, vers)
                        self._spent("buffer_write", t_write)
                        response += ids
                        self._count_tokens(len(ids))
                        ids, lps, vers = [], [], []
        except VersionAhead:
            return await self._version_ahead(item)
        except EngineUnavailable as exc:
            n = self._engine_failures[item.sample_id] = self._engine_failures.get(item.sample_id, 0) + 1
            log.warning("engine stream broke for sample %s (%d/%d): %s", item.sample_id, n,
                        self.MAX_ENGINE_FAILURES, exc)
            if n >= self.MAX_ENGINE_FAILURES and await self.client.health():
                # The engine answers /health but keeps breaking this sample's stream: stop loudly
                # instead of reclaiming and breaking it forever (the run must never hang).
                await self._end(item, "abort", ids, lps, vers)
                raise WorkerError(f"the stream of sample {item.sample_id} broke {n} times while the engine at "
                                  f"{self.client.url} stayed healthy (last: {exc}); stopping") from exc
            self._engine_lost = True
            engine_finish = None
        except EngineError as exc:
            self.stats.engine_errors += 1
            await self._end(item, "abort", ids, lps, vers)
            self._record_request("error", _now() - t0, len(ids), 0)
            if exc.status >= 500:  # the engine failed on this request: retry it (elsewhere, or here)
                n = self._engine_failures[item.sample_id] = self._engine_failures.get(item.sample_id, 0) + 1
                log.warning("engine error on sample %s (%d/%d): %s", item.sample_id, n, self.MAX_ENGINE_FAILURES,
                            exc.message)
                if n < self.MAX_ENGINE_FAILURES:
                    return None
                raise WorkerError(f"the engine at {self.client.url} failed {n} times on sample {item.sample_id} "
                                  f"(last: {exc.message}); stopping instead of retrying it forever") from exc
            raise WorkerError(
                f"the engine at {self.client.url} rejected the request for sample {item.sample_id} "
                f"(prompt {len(item.prompt_ids)} + response {len(item.response_ids)} tokens, max_new_tokens "
                f"{item.max_new_tokens}): {exc.message}. Check model.max_context_len / --max_response_len "
                "against the engine's context length."
            ) from exc
        response += ids
        self._count_tokens(len(ids))
        reason = self.finish_reason(item, engine_finish, len(response))
        status = await self._end(item, reason, ids, lps, vers)
        if status is None:
            return None
        prompt_tokens = len(item.prompt_ids) + len(item.response_ids)
        self._record_request(reason, _now() - t0, len(response) - len(item.response_ids), prompt_tokens)
        self.stats.segments += 1
        if status == SampleStatus.COMPLETE:
            self.stats.completed += 1
            if self.metrics is not None:
                started = self._first_claim.get(item.sample_id, t0)
                self.metrics.sample_completed("length" if reason == "length" else "stop", _now() - started,
                                              len(response))
            a.scoring = True
            await self._score(item, response)
        elif reason == "budget":
            self.stats.parked_budget += 1
            self._note_parked("budget")
        else:
            self.stats.parked_abort += 1
            self._note_parked("shutdown" if self._draining else "weight_update")
        if status == SampleStatus.PENDING:
            self._first_claim.pop(item.sample_id, None)
        return status

    async def _episode(self, a: _Active) -> SampleStatus | None:
        """Run (replay, then continue) the episode of a claimed item (rollout_server/episodes.py)."""
        if self._draining and a.item.kind == WorkKind.GENERATE:  # claimed just before the drain
            await self.buffer.end_segment(a.item, "abort")
            self._note_parked("shutdown")
            return None
        a.requested = a.item.kind == WorkKind.GENERATE
        status = await self.episodes.run(a.item)
        if status in (SampleStatus.SCORED, SampleStatus.FAILED, SampleStatus.PENDING):
            self._first_claim.pop(a.item.sample_id, None)
        return status

    async def _end(self, item: WorkItem, reason: str, ids: list[int], lps: list[float],
                   vers: list[int]) -> SampleStatus | None:
        t_write = _now()
        try:
            return await self.buffer.end_segment(item, reason, ids, lps, vers)
        except VersionAhead:
            return await self._version_ahead(item)
        finally:
            self._spent("buffer_write", t_write)

    async def _version_ahead(self, item: WorkItem) -> None:
        """The engine produced tokens of a version newer than the clock: park the item without them, reload."""
        self.stats.version_ahead += 1
        log.warning("sample %s: the engine's weights are newer than the clock (abandoned lineage); reloading",
                    item.sample_id)
        await self.buffer.end_segment(item, "abort")
        self._resync = True
        return None

    def _note_parked(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.parked(reason)

    def _count_tokens(self, n: int) -> None:
        self.stats.generated_tokens += n

    def _spent(self, component: str, since: float) -> float:
        """Add the time since ``since`` (monotonic) to ``component``'s worker seconds; returns now."""
        now = _now()
        if self.metrics is not None:
            self.metrics.worker_time(component, max(0.0, now - since))
        return now

    def _record_request(self, reason: str, seconds: float, generated: int, prompt_tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.request_finished(reason, max(0.0, seconds), max(0, generated), prompt_tokens)

    # ------------------------------------------------------------------ scoring
    async def _score(self, item: WorkItem, response_ids: list[int]) -> None:
        """Run the reward function (in a thread: it may be slow) and record reward or error."""
        t_score = _now()
        prompt = self.tokenizer.decode(item.prompt_ids, skip_special_tokens=False)
        response = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(None, self.scorer.score, prompt, response, dict(item.metadata))
        t_write = self._spent("scoring", t_score)
        if result.failed:
            self.stats.reward_errors += 1
            await self.buffer.score(item, error=result.error)
            if self.metrics is not None:
                self.metrics.scored(0.0, "error")
        else:
            await self.buffer.score(item, reward=result.reward)
            if self.metrics is not None:
                good = result.correct == 1.0 if result.correct is not None else result.reward > 0
                self.metrics.scored(result.reward, "correct" if good else "incorrect")
        self._spent("buffer_write", t_write)
        self.stats.scored += 1
        self._first_claim.pop(item.sample_id, None)

    async def _warm_scorer(self) -> None:
        """Score one dummy response in a worker thread before claiming, so the reward function's
        one-off start-up (math-verify imports, its helper process off the main thread) is not
        paid — or timed out — on the first real sample."""
        loop = asyncio.get_running_loop()
        for _ in range(3):
            res = await loop.run_in_executor(None, self.scorer.score, "warm-up", "Answer: 0", {"gold": "0"})
            if not res.failed or "Timeout" not in (res.error or ""):
                return
        log.warning("the reward function timed out three times while warming up: %s", res.error)

    # ------------------------------------------------------------------ leases
    async def _heartbeat(self) -> None:
        period = max(0.05, self.settings.lease_seconds / 3.0)
        while not self._stopping:
            await asyncio.sleep(period)
            actives = [a for a in self._active.values() if not a.lost]
            if not actives:
                continue
            try:
                held = await self.buffer.renew([a.item for a in actives])
                if held < len(actives):
                    for a in actives:
                        if await self.buffer.renew([a.item]) == 0 and a.task is not None and not a.task.done():
                            a.lost = True
                            self.stats.lease_lost += 1
                            a.task.cancel()
            except Exception:  # Redis hiccup: the next beat retries; appends also renew
                log.warning("lease renewal failed", exc_info=True)

    # ------------------------------------------------------------------ version clock
    # ------------------------------------------------------------------ metrics
    def _report_inflight(self) -> None:
        if self.metrics is not None:
            self.metrics.inflight_requests.set(len(self._active))

    def _set_idle(self, idle: bool) -> None:
        if self.metrics is not None:
            self.metrics.idle.set_idle(idle)


async def _wait_any(aw: Any, stop_task: asyncio.Task, timeout: float) -> None:
    """Wait until ``aw`` completes, ``stop_task`` is done, or ``timeout`` seconds pass."""
    t = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({t, stop_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not t.done():
            t.cancel()
