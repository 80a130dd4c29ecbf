"""The environment server: tools behind HTTP, with a deadline per call and a documented latency.

Endpoints (aiohttp; schemas in :mod:`asyncrl.env_server.schemas`):

* ``POST /tools/calculate`` — body ``{"expression": str, "call_id": str, "deadline_ms": int,
  "replay": bool}``; answer :class:`~asyncrl.env_server.schemas.ToolResponse` (200) whose
  ``outcome`` is ``ok`` (``result``: the integer as text), ``tool_error`` (``error``: why the
  calculator refused the expression) or ``deadline``. 400 names the field to fix (schema), 413
  a body over the limit, 415 a compressed body, 401 a missing or wrong bearer token when one is
  required, 503 while draining.
* ``GET /health`` — 200 :class:`~asyncrl.env_server.schemas.HealthResponse` while serving, 503
  while starting or draining.
* ``GET /metrics`` — Prometheus text format (:class:`asyncrl.metrics.EnvServerMetrics`).

**One call.** The call's deadline is ``min(deadline_ms, agent.env_server.deadline_seconds)``
from the moment its request was read. It waits for one of ``max_concurrent_calls`` slots (the
sandbox pool; the wait counts toward the deadline), runs the tool in a thread, and completes
when its drawn latency (:class:`~asyncrl.env_server.latency.LatencyModel`, a function of the
call id) has passed since it got its slot — the latency is the sandbox's service time, the
tool's own time included. A call whose slot, tool or latency would end past the deadline
answers ``outcome: deadline`` at the deadline: the server never holds a call longer. A tool
that raises answers ``tool_error`` after its latency, as a sandbox reports a failing command.

**Drain** (SIGTERM, :meth:`EnvServer.drain`): new calls get 503 and ``/health`` turns 503;
calls in flight finish (each within its deadline), then the process exits, within
``agent.env_server.drain_timeout_seconds``.

**Crash.** The server keeps no state between calls: a ``kill -9`` loses only the calls in
flight, whose connections the kernel resets; the rollout workers retry them on the restarted
server (:class:`asyncrl.env_server.client.EnvServerClient`), and the episodes go on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web
from pydantic import BaseModel, SecretStr, ValidationError

from asyncrl.core.net import content_encoding_refusal, key_matches, presented_key
from asyncrl.env_server.latency import LatencyModel
from asyncrl.env_server.schemas import (
    MAX_RESULT_CHARS,
    ErrorResponse,
    HealthResponse,
    ToolResponse,
    calculate_request_model,
)
from asyncrl.env_server.tools import TOOLS

__all__ = ["EnvServerOptions", "EnvServer"]

log = logging.getLogger(__name__)

_OPEN_PATHS = ("/health", "/metrics")


@dataclass
class EnvServerOptions:
    """Settings of one environment server (from ``agent.env_server``, :meth:`from_config`).

    Attributes:
        host, port: where to listen (port 0: a free port).
        deadline_seconds: the longest any call may take (requests may ask for less).
        max_concurrent_calls: calls running at once; later ones queue within their deadline.
        max_expression_chars: the ``calculate`` schema's bound.
        drain_timeout_seconds: longest drain on SIGTERM.
        api_key: bearer token required on the tool endpoints (None: open).
        latency: the drawn service time of a call.
    """

    host: str = "127.0.0.1"
    port: int = 30600
    deadline_seconds: float = 10.0
    max_concurrent_calls: int = 64
    max_expression_chars: int = 200
    drain_timeout_seconds: float = 30.0
    api_key: SecretStr | None = None
    latency: LatencyModel = field(default_factory=LatencyModel)

    @classmethod
    def from_config(cls, cfg: Any) -> "EnvServerOptions":
        """From the whole config (``agent.env_server`` and, when required, ``security.api_key``)."""
        from asyncrl.core.secret_values import reveal

        es = cfg.agent.env_server
        key = reveal(cfg.security.api_key) if es.api_key_required else None
        return cls(host=es.host, port=es.port, deadline_seconds=es.deadline_seconds,
                   max_concurrent_calls=es.max_concurrent_calls, max_expression_chars=es.max_expression_chars,
                   drain_timeout_seconds=es.drain_timeout_seconds, api_key=SecretStr(key) if key else None,
                   latency=LatencyModel.from_config(es.latency))


class EnvServer:
    """The HTTP layer and the call runner of one environment server (module docstring).

    Args:
        opts: :class:`EnvServerOptions`.
        metrics: optional :class:`asyncrl.metrics.EnvServerMetrics`; ``registry`` its registry
            (``/metrics`` is served only with one).
        tools: tool name -> function (default :data:`asyncrl.env_server.tools.TOOLS`).
    """

    def __init__(self, opts: EnvServerOptions, metrics: Any = None, registry: Any = None,
                 tools: dict[str, Callable[..., object]] | None = None) -> None:
        self.opts = opts
        self.metrics, self.registry = metrics, registry
        self.tools = dict(TOOLS if tools is None else tools)
        self.calculate_schema = calculate_request_model(opts.max_expression_chars)
        self.draining = False
        self.ready = False
        self.in_flight = 0
        self.answered = 0  # calls answered with a ToolResponse
        self._idle = asyncio.Event()
        self._idle.set()
        self._slots: asyncio.Semaphore | None = None
        #: the largest request body accepted (413 beyond): 16 KiB + 8 bytes per expression character
        self.body_limit = 16384 + 8 * opts.max_expression_chars  # room for \uXXXX escapes
        self._pool = ThreadPoolExecutor(max(1, min(8, opts.max_concurrent_calls)), thread_name_prefix="asyncrl-env-tool")
        if metrics is not None:
            metrics.deadline_seconds.set(opts.deadline_seconds)

    # -- HTTP plumbing --------------------------------------------------------------------------

    @staticmethod
    def _error(message: str, status: int) -> web.Response:
        body = ErrorResponse(error={"message": message[:MAX_RESULT_CHARS]})
        return web.json_response(body.model_dump(), status=status)

    def _count(self, tool: str, outcome: str, **kw: Any) -> None:
        if self.metrics is not None:
            self.metrics.call_done(tool, outcome, **kw)

    @web.middleware
    async def guard_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """415 for a compressed body, then ``Authorization: Bearer <key>`` (or ``x-api-key``) on
        every path but ``/health`` and ``/metrics`` when a key is required."""
        if request.path in _OPEN_PATHS:
            return await handler(request)
        tool = request.path.rpartition("/")[2] if request.path.startswith("/tools/") else ""
        refusal = content_encoding_refusal(request.headers)
        if refusal is not None:
            if tool in self.tools:
                self._count(tool, "bad_request")
            return self._error(refusal, 415)
        key = self.opts.api_key
        if key is not None:
            _, given = presented_key(request.headers)
            if not key_matches(given, key.get_secret_value()):
                if tool in self.tools:
                    self._count(tool, "unauthorized")
                return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        return await handler(request)

    async def _read_model(self, request: web.Request, schema: type[BaseModel], tool: str) -> BaseModel | web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self._count(tool, "bad_request")
            return self._error(f"request body too large: at most {self.body_limit} bytes "
                               "(agent.env_server.max_expression_chars bounds the expression)", 413)
        try:
            return schema.model_validate_json(body)
        except ValidationError as exc:
            self._count(tool, "bad_request")
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            fields = ", ".join(f"{name}" for name in schema.model_fields)
            return self._error(f"invalid /tools/{tool} request: {where}: {first['msg']} (expected a JSON object with "
                               f"{fields}; the expression at most {self.opts.max_expression_chars} characters)", 400)

    # -- calls ----------------------------------------------------------------------------------

    async def handle_calculate(self, request: web.Request) -> web.Response:
        """``POST /tools/calculate`` (module docstring)."""
        return await self._handle(request, "calculate", self.calculate_schema, lambda req: (req.expression,))

    async def _handle(self, request: web.Request, tool: str, schema: type[BaseModel],
                      args_of: Callable[[Any], tuple]) -> web.Response:
        t0 = time.monotonic()
        if self.draining or self._slots is None:
            self._count(tool, "draining")
            return self._error("the environment server is draining (shutting down); retry shortly", 503)
        req = await self._read_model(request, schema, tool)
        if isinstance(req, web.Response):
            return req
        deadline = min(req.deadline_ms / 1000.0, self.opts.deadline_seconds)
        self.in_flight += 1
        self._idle.clear()
        if self.metrics is not None:
            self.metrics.in_flight.set(self.in_flight)
        try:
            answer = await self._call(tool, args_of(req), req.call_id, deadline, t0)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
            if self.metrics is not None:
                self.metrics.in_flight.set(self.in_flight)
        self.answered += 1
        self._count(tool, answer.outcome, duration_seconds=answer.elapsed_seconds,
                    latency_seconds=answer.latency_seconds, replay=bool(req.replay))
        return web.json_response(answer.model_dump())

    async def _call(self, tool: str, args: tuple, call_id: str, deadline: float, t0: float) -> ToolResponse:
        """Run one call within ``deadline`` seconds of ``t0`` (monotonic); never raises."""
        latency = self.opts.latency.sample(call_id)
        deadline_at = t0 + deadline

        def answer(outcome: str, result: str | None = None, error: str | None = None) -> ToolResponse:
            return ToolResponse(outcome=outcome, result=None if result is None else result[:MAX_RESULT_CHARS],
                                error=None if error is None else error[:MAX_RESULT_CHARS], call_id=call_id,
                                latency_seconds=latency, elapsed_seconds=max(0.0, time.monotonic() - t0))

        def past_deadline() -> ToolResponse:
            return answer("deadline", error=f"the call ran past its deadline of {deadline:g} s")

        assert self._slots is not None
        try:
            await asyncio.wait_for(self._slots.acquire(), max(0.0, deadline_at - time.monotonic()))
        except asyncio.TimeoutError:
            return past_deadline()
        try:
            started = time.monotonic()
            loop = asyncio.get_running_loop()
            fn = self.tools[tool]
            try:
                value = await asyncio.wait_for(loop.run_in_executor(self._pool, lambda: fn(*args)),
                                               max(0.0, deadline_at - time.monotonic()))
                outcome, result, error = "ok", str(value), None
            except asyncio.TimeoutError:
                return past_deadline()
            except Exception as exc:  # noqa: BLE001 - the tool refused its input: an answer, not a crash
                outcome, result, error = "tool_error", None, f"{type(exc).__name__}: {exc}"
            done_at = started + latency
            if done_at > deadline_at:
                await asyncio.sleep(max(0.0, deadline_at - time.monotonic()))
                return past_deadline()
            await asyncio.sleep(max(0.0, done_at - time.monotonic()))
            return answer(outcome, result, error)
        finally:
            self._slots.release()

    async def handle_health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 while serving, 503 while starting or draining."""
        status = "draining" if self.draining else ("ok" if self.ready else "starting")
        body = HealthResponse(status=status, tools=sorted(self.tools), in_flight=self.in_flight,
                              latency=self.opts.latency.describe())
        return web.json_response(body.model_dump(), status=200 if status == "ok" else 503)

    def app(self) -> web.Application:
        """The aiohttp application (bodies up to 16 KiB + 8 bytes per expression character)."""
        from asyncrl.metrics import metrics_app_handler

        app = web.Application(middlewares=[self.guard_middleware], client_max_size=self.body_limit)
        app.router.add_post("/tools/calculate", self.handle_calculate)
        app.router.add_get("/health", self.handle_health)
        if self.registry is not None:
            app.router.add_get("/metrics", metrics_app_handler(self.registry))

        async def on_startup(_: web.Application) -> None:
            self._slots = asyncio.Semaphore(self.opts.max_concurrent_calls)
            self.ready = True

        async def on_cleanup(_: web.Application) -> None:
            self._pool.shutdown(wait=False, cancel_futures=True)

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app

    async def drain(self) -> bool:
        """Refuse new calls (503) and wait until the calls in flight are answered.

        Returns False when ``drain_timeout_seconds`` passed with calls still in flight (the
        caller stops anyway; the workers retry those calls on the next server).
        """
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), self.opts.drain_timeout_seconds)
        except asyncio.TimeoutError:
            return False
        await asyncio.sleep(0.05)  # let the handlers write the last answers
        return True
