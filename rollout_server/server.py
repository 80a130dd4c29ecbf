"""aiohttp server exposing the embedded engine with SGLang's native HTTP API (the subset in
docs/rollout.md#http-api-the-sglang-subset-same-shapes, same request and response shapes), so
asyncrl has one client for both.

Endpoints: ``/generate`` (input_ids or text, batches, ``n``, SGLang's sampling params,
``return_logprob`` with ``[logprob, id, null]`` triples, SSE streaming — cumulative chunks by
default, deltas with ``--incremental_streaming_output``), ``/abort_request``,
``/pause_generation`` (abort / retract / in_place), ``/continue_generation``,
``/update_weights_from_disk``, ``/update_weights_from_tensor`` (base64 **safetensors**, never
pickle), ``/init_weights_update_group`` + ``/update_weights_from_distributed`` +
``/destroy_weights_update_group`` (torch.distributed gloo between CPU processes),
``/update_weight_version``, ``/load_lora_adapter`` / ``/unload_lora_adapter`` (named adapters
that ``/generate``'s ``lora_path`` applies per request), ``/get_model_info``, ``/get_server_info``, ``/get_weight_version``,
``/health``, ``/health_generate``, ``/flush_cache``, ``/v1/loads``, ``/v1/models``, ``/metrics``.

With an API key every endpoint except ``/health*`` and ``/metrics`` needs ``Authorization:
Bearer <key>`` (or ``x-api-key``), else 401 ``{"error": "Unauthorized"}`` (SGLang's
middleware). Every body is validated by its endpoint's schema (:mod:`rollout_server.schemas`:
strict types, bounded sizes and numbers); bad requests get 400 ``{"error": {"message": ...}}``
naming the field before anything reaches the engine, so they never disturb other requests.

Deviations from SGLang, on purpose: ``/health`` answers 200 without a test generation (use
``/health_generate`` for that); ``/health_generate`` answers 200 at once while the engine is
paused; an EOS reached exactly at ``max_new_tokens`` reports ``stop`` (not ``length``);
``meta_info.weight_versions`` (per-token version spans) is always present, and
``meta_info.lora_path`` names the adapter a request generated under (when it named one).

This module holds the app, its lifecycle, auth, ``/generate`` (plain and streamed), the control,
info and health endpoints and the ``sglang:`` metrics; request parsing and response shapes are in
:mod:`rollout_server.requests`, the weight endpoints in :mod:`rollout_server.weight_endpoints`.

Run: ``python -m rollout_server.server --model-path DIR [--port P] [--api-key K]
[--incremental_streaming_output] [--weight-version V]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
import uuid
from typing import Any

from aiohttp import web

from asyncrl.core.aio import wait_event
from asyncrl.core.net import SERVER_KWARGS, content_encoding_refusal, key_matches, presented_key
from rollout_server.engine import Engine
from rollout_server.engine_sample import EngineGroup, EngineSample
from rollout_server.limits import RETRY_AFTER_SECONDS, BodyReader
from rollout_server.requests import (
    GenerateLimits,
    decode_output,
    dumps,
    error_response,
    max_token_bytes,
    parse_generate,
    read_body,
    refused,
    response_object,
)
from rollout_server.sampling import RequestError
from rollout_server.schemas import AbortBody, ContinueBody, PauseBody, sampling_params_from_dict
from rollout_server.server_metrics import EngineCollector, metric_model_name
from rollout_server.streaming import SampleStream
from rollout_server.server_options import ServerOptions, parse_args as _parse_args
from rollout_server.weight_endpoints import WeightEndpoints, destroy_group

__all__ = ["ServerOptions", "RolloutHTTPServer", "build_app", "main", "parse_args", "VERSION"]

log = logging.getLogger(__name__)

#: reported as ``version`` by /get_server_info and /v1/loads
VERSION = "asyncrl-embedded-0.1.0"

_OPEN_PATHS = ("/health", "/health_generate", "/metrics")
_HEALTH_TIMEOUT_SECONDS = 20.0
#: how often a request with no progress (queued, paused) checks whether its client is still there
_DISCONNECT_POLL_SECONDS = 0.25


class RolloutHTTPServer(WeightEndpoints):
    """The HTTP layer over one :class:`Engine` (see the module docstring for the API)."""

    def __init__(self, opts: ServerOptions, model: Any = None, tokenizer: Any = None, registry: Any = None):
        self.opts = opts
        self._model, self._tokenizer = model, tokenizer
        self.engine: Engine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._paused_mode: str | None = None
        self._weights_lock: asyncio.Lock | None = None
        self._dist_groups: dict[str, Any] = {}
        self._joining: set[str] = set()
        self.limits = opts.limits
        #: samples of /generate requests admitted and not yet answered (running, queued or waiting on a pause)
        self.num_admitted = 0
        self._parse_pool: Any = None
        self.body_reader: BodyReader | None = None
        self.weights_body_reader: BodyReader | None = None
        self.generate_limits = GenerateLimits()
        self.registry = registry
        self.rollout_metrics = None
        self.ready = False
        self.started_time = time.time()

    # -- lifecycle ---------------------------------------------------------------------------------

    def load(self) -> None:
        """Load model and tokenizer (unless given) and create the engine; blocking."""
        import torch

        if self.opts.engine_threads:
            torch.set_num_threads(int(self.opts.engine_threads))
        if self._model is None:
            from asyncrl.models import load_causal_lm, load_tokenizer

            self._model = load_causal_lm(self.opts.model_path, self.opts.dtype).to(self.opts.device)
            self._tokenizer = None if self.opts.skip_tokenizer_init else load_tokenizer(self.opts.model_path)
        ctx = self.opts.context_length or getattr(self._model.config, "max_position_embeddings", None) or 2048
        self.engine = Engine(
            self._model,
            self._tokenizer,
            context_len=int(ctx),
            max_batch_size=self.opts.max_running_requests,
            weight_version=self.opts.weight_version,
            seed=self.opts.random_seed,
            max_loaded_loras=self.opts.max_loaded_loras,
            threads=self.opts.engine_threads,
            on_update=self._on_engine_update,
            reserve_rows=self.limits.fair_reserve_rows,
            fair_slowdown=self.limits.fair_slowdown,
            scheduler_delay_factor=self.opts.scheduler_delay_factor,
        )
        self._setup_limits()
        self._setup_metrics()

    def _setup_limits(self) -> None:
        """Body readers and /generate limits from :class:`~rollout_server.limits.ServerLimits` and the model."""
        from concurrent.futures import ThreadPoolExecutor

        lim, eng = self.limits, self.engine
        # one thread: big bodies are parsed and texts tokenized there, off the event loop, one at a time
        self._parse_pool = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-parse")
        self.body_reader = BodyReader(lim.request_bytes(eng.context_len), lim.body_timeout_seconds, executor=self._parse_pool)
        num_params = sum(p.numel() for p in self._model.parameters())
        self.weights_body_reader = BodyReader(lim.weights_request_bytes(num_params), lim.body_timeout_seconds,
                                              flag="max-weights-request-bytes", executor=self._parse_pool)
        text_bytes = eng.context_len * max_token_bytes(self._tokenizer) if self._tokenizer is not None else None
        self.generate_limits = GenerateLimits(lim.max_prompts_per_request, lim.max_top_logprobs_num, text_bytes,
                                              lim.max_request_cost)

    async def on_startup(self, app: web.Application) -> None:
        self.loop = asyncio.get_running_loop()
        self._weights_lock = asyncio.Lock()
        if self.engine is None:
            await self.loop.run_in_executor(None, self.load)
        self.engine.start()
        self.ready = True

    async def on_cleanup(self, app: web.Application) -> None:
        self.ready = False
        if self.engine is not None:
            await self.loop.run_in_executor(None, self.engine.stop)
        for pg in self._dist_groups.values():
            destroy_group(pg)
        self._dist_groups.clear()
        if self._parse_pool is not None:
            self._parse_pool.shutdown(wait=False, cancel_futures=True)

    def _on_engine_update(self, samples: list[EngineSample]) -> None:
        """Engine thread -> event loop: wake the handlers waiting on these samples."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        waiters = {id(s.waiter): s.waiter for s in samples if s.waiter is not None}
        finished = [s for s in samples if s.published[1] is not None]
        try:
            loop.call_soon_threadsafe(self._wake, list(waiters.values()), finished)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _wake(self, waiters: list, finished: list[EngineSample]) -> None:
        for w in waiters:
            w.set()
        for s in finished:
            self._observe_finished(s)

    # -- metrics -------------------------------------------------------------------------------------

    def _setup_metrics(self) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        if self.registry is None:
            try:
                from asyncrl.metrics import role_registry

                self.registry, self.rollout_metrics = role_registry("rollout")
            except ImportError:  # pragma: no cover - metrics module is part of the package
                self.registry = CollectorRegistry()
        labels = ["model_name"]
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
        self._ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token.", labels, buckets=buckets, registry=self.registry)
        self._e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency.", labels, buckets=buckets, registry=self.registry)
        self.registry.register(EngineCollector(self))

    def _observe_finished(self, s: EngineSample) -> None:
        name = metric_model_name(self.opts.served_model_name)
        if s.first_token_time is not None:
            self._ttft.labels(name).observe(max(0.0, s.first_token_time - s.created_time))
        if s.finished_time is not None:
            self._e2e.labels(name).observe(max(0.0, s.finished_time - s.created_time))

    # -- auth ---------------------------------------------------------------------------------------

    @web.middleware
    async def auth_middleware(self, request: web.Request, handler):
        """Refuse a ``Content-Encoding`` (415), then check the API key (401; 400 for a non-ASCII
        credential header), all before a byte of the body is read (the connection is then closed,
        never lingered on: :data:`asyncrl.core.net.SERVER_KWARGS`)."""
        refusal = content_encoding_refusal(request.headers)
        if refusal is not None:
            resp = error_response(refusal, 415)
            resp.force_close()
            return resp
        key = self.opts.api_key
        if key and request.method != "OPTIONS" and not request.path.startswith(_OPEN_PATHS):
            header, raw = presented_key(request.headers)
            if raw is None:
                resp = error_response(f"the {header} header holds non-ASCII characters: send the API key as it was "
                                      "given (ASCII)", 400)
                resp.force_close()
                return resp
            if not key_matches(raw, key):
                resp = web.json_response({"error": "Unauthorized"}, status=401)
                if request.body_exists:
                    resp.force_close()
                return resp
        return await handler(request)

    # -- /generate ---------------------------------------------------------------------------------

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        """``POST /generate`` (:class:`~rollout_server.schemas.GenerateBody`): one response, a list, or an SSE stream.

        Bounded before any work (docs/rollout.md#limits): the body's size and arrival time, the
        prompts per request, ``text`` length (tokenized off the event loop), ``top_logprobs_num``;
        a request that would overfill the queue gets a 503 with ``Retry-After``. A client that
        leaves (any form of disconnect) has its samples aborted within one decode step.
        """
        try:
            raw = await self.body_reader.read(request)
            groups, samples, is_batch, stream = await parse_generate(raw, self.engine, self._tokenizer,
                                                                     self.body_reader, self.generate_limits)
        except RequestError as exc:
            return refused(exc)
        capacity = self.engine.max_batch_size + self.limits.max_queued_requests
        if len(samples) > capacity:
            return error_response(f"the request has {len(samples)} samples (prompts x n); this server holds at most "
                                  f"{capacity} (max_running_requests + --max-queued-requests): split it")
        if self.num_admitted + len(samples) > capacity:
            resp = error_response(
                f"The request queue is full: {self.num_admitted} samples running or waiting, at most {capacity} "
                f"(max_running_requests {self.engine.max_batch_size} + --max-queued-requests "
                f"{self.limits.max_queued_requests}); retry after {RETRY_AFTER_SECONDS} s", 503)
            resp.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
            return resp
        self.num_admitted += len(samples)
        try:
            return await self._generate(request, groups, samples, is_batch, stream)
        finally:
            self.num_admitted -= len(samples)
            self._abort_samples(samples)  # the client left, or the handler failed: stop the work at once

    async def _generate(self, request: web.Request, groups: list[EngineGroup], samples: list[EngineSample],
                        is_batch: bool, stream: bool) -> web.StreamResponse:
        while not self._unpaused.is_set():  # new requests wait while the engine is paused
            if _client_gone(request):
                raise asyncio.CancelledError()
            await wait_event(self._unpaused, _DISCONNECT_POLL_SECONDS)
        waiter = asyncio.Event()
        for s in samples:
            s.waiter = waiter
            s.created_time = time.time()
        self.engine.submit(groups)
        if stream:
            return await self._stream(request, samples, waiter)
        while not all(s.published[1] is not None for s in samples):
            if _client_gone(request):  # checked at every wake-up: every decode step that advanced these samples
                raise asyncio.CancelledError()  # the finally of handle_generate aborts them
            if await wait_event(waiter, _DISCONNECT_POLL_SECONDS):  # not wait_for: see asyncrl.core.aio
                waiter.clear()
        for s in samples:
            status = (s.finish_reason or {}).get("status_code")
            if status in (400, 500, 503) and not is_batch:
                return web.json_response({"error": {"message": s.finish_reason.get("message", "error")}}, status=status)
        # a big response (up to --max-request-cost entries) is built and serialised off the event loop
        body = await self.body_reader.run(_output_bytes(samples), self._final_body, samples, is_batch)
        return web.Response(body=body, content_type="application/json")

    def _final_body(self, samples: list[EngineSample], is_batch: bool) -> bytes:
        """The JSON body of a finished non-streamed request (runs on the parse thread when big)."""
        outs = [
            response_object(
                s, s.published, 0, final=True, incremental=False, with_text=self._tokenizer is not None,
                current_version=self.engine.weight_version,
                text_now=decode_output(self._tokenizer, s, s.output_ids[: s.published[0]], s.published[1]) if self._tokenizer else "",
            )
            for s in samples
        ]
        return dumps(outs if is_batch else outs[0]).encode()

    def _abort_samples(self, samples: list[EngineSample]) -> None:
        """Abort the samples not yet finished (by identity: never another request sharing a rid prefix)."""
        left = [s for s in samples if s.published[1] is None]
        if left:
            self.engine.abort_samples(left)

    async def _stream(self, request: web.Request, samples: list[EngineSample], waiter: asyncio.Event) -> web.StreamResponse:
        """SSE chunks until every sample finished; the caller aborts what is left on any exit (a
        disconnect surfaces as ``ConnectionResetError``, ``ConnectionError``, a cancellation or a
        closing transport). Cumulative chunks are spaced so that a stream's total output stays
        linear in its length (``--cumulative-stream-entries``)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        multi = len(samples) > 1
        streams = [SampleStream(s, self._tokenizer, self.opts.incremental_streaming_output, multi) for s in samples]
        while not all(st.done for st in streams):
            if _client_gone(request):
                raise asyncio.CancelledError()
            if not await wait_event(waiter, _DISCONNECT_POLL_SECONDS):
                continue
            waiter.clear()
            due = [(st, snap) for st in streams
                   if (snap := st.due(self.opts.stream_interval, self.limits.cumulative_stream_entries)) is not None]
            if due:  # big chunks are built and serialised off the event loop
                size = _output_bytes([st.sample for st, _ in due])
                await resp.write(await self.body_reader.run(size, self._chunks, due))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _chunks(self, due: list) -> bytes:
        """The SSE bytes of one wake-up of a stream: a chunk per ``(SampleStream, (n, finish))`` in ``due``."""
        version = self.engine.weight_version
        return b"".join(st.chunk(n, fin, version) for st, (n, fin) in due)

    # -- abort / pause ------------------------------------------------------------------------------

    async def handle_abort(self, request: web.Request) -> web.Response:
        """``POST /abort_request`` (:class:`~rollout_server.schemas.AbortBody`)."""
        try:
            body = await read_body(request, AbortBody, self.body_reader, what="/abort_request")
        except RequestError as exc:
            return refused(exc)
        self.engine.abort(body.rid, body.abort_all)
        return web.Response(status=200)

    async def handle_pause(self, request: web.Request) -> web.Response:
        """``POST /pause_generation`` (:class:`~rollout_server.schemas.PauseBody`)."""
        try:
            mode = (await read_body(request, PauseBody, self.body_reader, what="/pause_generation")).mode
        except RequestError as exc:
            return refused(exc)
        self._unpaused.clear()
        self._paused_mode = mode
        await asyncio.wrap_future(self.engine.call("pause", mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def handle_continue(self, request: web.Request) -> web.Response:
        """``POST /continue_generation`` (:class:`~rollout_server.schemas.ContinueBody`)."""
        try:
            await read_body(request, ContinueBody, self.body_reader, what="/continue_generation")
        except RequestError as exc:
            return refused(exc)
        await asyncio.wrap_future(self.engine.call("resume"))
        self._paused_mode = None
        self._unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # -- info / health ------------------------------------------------------------------------------

    async def handle_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.opts.model_path,
            "tokenizer_path": self.opts.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version,
            "lora_adapter": self.engine.lora_adapter,  # the merged LoRA adapter (checksum, version), None: none
            # asyncrl's: the named adapters of /load_lora_adapter (name -> name, path, checksum, rank, ...)
            "lora_adapters": {n: a.info() for n, a in list(self.engine.named_adapters.items())},
            "has_image_understanding": False,
            "has_audio_understanding": False,
        })

    async def handle_server_info(self, request: web.Request) -> web.Response:
        o, e = self.opts, self.engine
        load = e.load()
        return web.json_response({
            "model_path": o.model_path, "tokenizer_path": o.model_path, "served_model_name": o.served_model_name,
            "host": o.host, "port": o.port, "tp_size": 1, "dp_size": 1, "dtype": str(e.dtype).replace("torch.", ""),
            "device": str(e.device), "context_length": e.context_len, "max_running_requests": e.max_batch_size,
            "max_total_num_tokens": e.max_total_num_tokens, "max_req_input_len": e.context_len - 1,
            "weight_version": e.weight_version, "incremental_streaming_output": o.incremental_streaming_output,
            "stream_output": o.incremental_streaming_output, "stream_interval": o.stream_interval,
            "skip_tokenizer_init": self._tokenizer is None, "enable_metrics": True, "random_seed": o.random_seed,
            "api_key_required": bool(o.api_key), "engine": "asyncrl-torch", "engine_threads": o.engine_threads,
            "internal_states": [{"paused": load["paused"], "num_running_reqs": load["num_running_reqs"]}],
            "engine_profile_seconds": e.profile_snapshot(),  # engine_profile.py: the engine thread by component
            "version": VERSION,
        })

    async def handle_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def handle_health(self, request: web.Request) -> web.Response:
        ok = self.ready and self.engine is not None and self.engine.alive
        return web.Response(status=200 if ok else 503)

    async def handle_health_generate(self, request: web.Request) -> web.Response:
        if not (self.ready and self.engine is not None and self.engine.alive):
            return web.Response(status=503)
        if not self._unpaused.is_set():
            return web.Response(status=200)
        sp = sampling_params_from_dict({"max_new_tokens": 1, "temperature": 0}, self.engine.vocab_size)
        s = EngineSample(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt_ids=[0], params=sp)
        s.waiter = asyncio.Event()
        self.engine.submit([EngineGroup([0], [s])])
        deadline = time.monotonic() + _HEALTH_TIMEOUT_SECONDS
        while s.published[1] is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.engine.abort(s.rid)
                return web.Response(status=503)
            if not await wait_event(s.waiter, left):
                continue
            s.waiter.clear()
        return web.Response(status=200)

    async def handle_flush_cache(self, request: web.Request) -> web.Response:
        ok = await asyncio.wrap_future(self.engine.call("flush_cache"))
        text = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                "requests, the operation will not be performed.)\n")
        return web.Response(text=text, status=200 if ok else 400)

    async def handle_loads(self, request: web.Request) -> web.Response:
        load = self.engine.load()
        now = time.time()
        entry = {
            "dp_rank": 0, "timestamp": now, "num_running_reqs": load["num_running_reqs"],
            "num_waiting_reqs": load["num_waiting_reqs"], "num_used_tokens": load["num_used_tokens"],
            "num_total_tokens": load["max_total_num_tokens"], "max_total_num_tokens": load["max_total_num_tokens"],
            "token_usage": load["token_usage"], "gen_throughput": load["gen_throughput"], "cache_hit_rate": 0.0,
            "utilization": load["num_running_reqs"] / self.engine.max_batch_size,
            "max_running_requests": self.engine.max_batch_size, "num_paused_reqs": load["num_paused_reqs"],
        }
        return web.json_response({"timestamp": now, "version": VERSION, "accelerator": "cpu", "num_accelerators": 0, "loads": [entry]})

    async def handle_models(self, request: web.Request) -> web.Response:
        name = self.opts.served_model_name
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(self.started_time), "owned_by": "asyncrl", "root": name,
            "max_model_len": self.engine.context_len,
        }]})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        """Always the classic text format: OpenMetrics negotiation (what Prometheus 2.x asks
        for) would make prometheus_client rename ``sglang:`` names to ``sglang_`` (see
        :func:`asyncrl.metrics.exposition`), leaving the dashboard's engine panels empty."""
        from asyncrl.metrics import exposition

        if self.rollout_metrics is not None:  # the engine thread's seconds by component, up to now
            self.rollout_metrics.engine_profile(self.engine.profile_snapshot())
            stats = self.engine.stats
            self.rollout_metrics.engine_prefill(stats["prefill_forward_tokens_total"], stats["prompt_cache_hits_total"],
                                                stats["context_cache_hits_total"])
        body, content_type = exposition(self.registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    # -- app ------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application (engine started on startup, stopped on cleanup)."""
        # bodies are read by BodyReader within their own limits; this only bounds aiohttp's own readers
        limit = max(r.limit for r in (self.body_reader, self.weights_body_reader) if r is not None) if self.body_reader else 1 << 20
        app = web.Application(middlewares=[self.auth_middleware], client_max_size=limit)
        r = app.router
        r.add_route("POST", "/generate", self.handle_generate)
        r.add_route("PUT", "/generate", self.handle_generate)
        r.add_post("/abort_request", self.handle_abort)
        r.add_post("/pause_generation", self.handle_pause)
        r.add_post("/continue_generation", self.handle_continue)
        r.add_post("/update_weights_from_disk", self.handle_update_from_disk)
        r.add_post("/update_weights_from_tensor", self.handle_update_from_tensor)
        r.add_post("/init_weights_update_group", self.handle_init_group)
        r.add_post("/update_weights_from_distributed", self.handle_update_from_distributed)
        r.add_post("/destroy_weights_update_group", self.handle_destroy_group)
        r.add_post("/update_weight_version", self.handle_update_weight_version)
        r.add_post("/load_lora_adapter", self.handle_load_lora_adapter)
        r.add_post("/unload_lora_adapter", self.handle_unload_lora_adapter)
        for path, h in (("/get_model_info", self.handle_model_info), ("/model_info", self.handle_model_info),
                        ("/get_server_info", self.handle_server_info), ("/server_info", self.handle_server_info),
                        ("/get_weight_version", self.handle_weight_version), ("/health", self.handle_health),
                        ("/health_generate", self.handle_health_generate), ("/v1/loads", self.handle_loads),
                        ("/get_load", self.handle_loads), ("/v1/models", self.handle_models), ("/metrics", self.handle_metrics)):
            r.add_get(path, h)
        r.add_route("GET", "/flush_cache", self.handle_flush_cache)
        r.add_route("POST", "/flush_cache", self.handle_flush_cache)
        app.on_startup.append(self.on_startup)
        app.on_cleanup.append(self.on_cleanup)
        return app


def build_app(opts: ServerOptions, model: Any = None, tokenizer: Any = None) -> tuple[web.Application, RolloutHTTPServer]:
    """Create the server (loading the model now, so readiness means servable) and its app."""
    server = RolloutHTTPServer(opts, model, tokenizer)
    server.load()
    return server.app(), server


def parse_args(argv: list[str] | None = None) -> ServerOptions:
    """SGLang-style flags (both ``--flag-name`` and ``--flag_name`` spellings): :func:`rollout_server.server_options.parse_args`."""
    return _parse_args(argv, description=__doc__.split("\n\n")[0])


def _output_bytes(samples: list[EngineSample]) -> int:
    """A rough size of the samples' output objects (bytes), to decide where to build them."""
    return sum(24 * s.published[0] * ((2 + s.top_logprobs_num) if s.return_logprob else 1) for s in samples)


def _client_gone(request: web.Request) -> bool:
    """The client closed its connection (however the disconnect surfaced)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout_server.server``: load the model, serve until SIGINT/SIGTERM."""
    opts = parse_args(argv)
    from asyncrl.models import resolve_model_path

    opts.model_path = str(resolve_model_path(opts.model_path))
    app, server = build_app(opts)
    print(f"asyncrl embedded engine serving {opts.model_path} on http://{opts.host}:{opts.port}", flush=True)
    # aiohttp's keep-alive timer also runs from the connection's start until a request head is complete,
    # so it is the header read timeout too (a client trickling headers is cut off)
    web.run_app(app, host=opts.host, port=opts.port, print=None, access_log=None, handle_signals=True,
                shutdown_timeout=5.0, keepalive_timeout=opts.limits.header_timeout_seconds, **SERVER_KWARGS)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
