"""Resource limits of the embedded server: body sizes, read timeouts, queue, per-request output.

One job: bound what one client can make the server hold or compute (issue #18 items 2, 3 and
5), so that no request can stall the event loop or grow the process without bound.
:class:`ServerLimits` holds the limits (``python -m rollout_server.server`` flags of the same
names; the ``rollout.engine_*`` config fields of docs/configuration.md, passed on by
:func:`limit_flags`); :func:`read_limited` reads a request body within its size and time bounds.
docs/rollout.md ("Limits") explains each limit and its default.

Statuses: a body over its limit is a 413, a body that does not arrive in time a 408, a full
queue a 503 with ``Retry-After`` (SGLang answers an overloaded queue with a 503 too); every
answer says which limit was hit and which flag or config field raises it.
"""

from __future__ import annotations

import asyncio
import argparse
import functools
from concurrent.futures import Executor
from dataclasses import dataclass, fields
from typing import Any, Callable

from rollout_server.sampling import RequestError

__all__ = [
    "BYTES_PER_PROMPT_TOKEN",
    "BODY_SLACK_BYTES",
    "RETRY_AFTER_SECONDS",
    "BodyError",
    "BodyReader",
    "INLINE_PARSE_BYTES",
    "ServerLimits",
    "add_limit_arguments",
    "limit_flags",
    "limits_from_config",
    "read_limited",
]

#: JSON bytes one prompt token may take in a body (``"2147483647, "``: 10 digits, a comma, a space)
BYTES_PER_PROMPT_TOKEN = 12
#: room for everything in a body besides its prompts (sampling params, stop strings, rids)
BODY_SLACK_BYTES = 1 << 20
#: ``Retry-After`` of a 503 for a full queue, seconds (decode steps free rows every few milliseconds)
RETRY_AFTER_SECONDS = 1
#: bodies up to this size are parsed on the event loop (microseconds); larger ones on the parse thread
INLINE_PARSE_BYTES = 64 << 10
#: bytes of a base64 safetensors payload per model parameter at most (float64: 8 bytes, x 4/3)
_WEIGHT_PAYLOAD_BYTES_PER_PARAM = 11


class BodyError(RequestError):
    """A body refused before it is parsed: too large (413) or too slow to arrive (408)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass
class ServerLimits:
    """The limits of one embedded server (defaults = the ``rollout.engine_*`` config defaults).

    Attributes:
        max_request_bytes: most bytes of a body other than a weight update; None derives it from
            the context length: ``1 MiB + 12 bytes x context_len x max_prompts_per_request``.
        max_weights_request_bytes: most bytes of a weight-update body; None derives it from the
            model: ``1 MiB + 11 bytes x parameters`` (a base64 float64 payload of every tensor).
        max_prompts_per_request: most prompts in one ``/generate`` batch.
        max_queued_requests: most samples waiting beyond the ``max_running_requests`` being
            decoded; a request that would exceed it gets a 503 with ``Retry-After`` (SGLang's
            ``--max-queued-requests``).
        max_top_logprobs_num: largest ``top_logprobs_num`` (OpenAI's ``top_logprobs`` caps at 20).
        cumulative_stream_entries: a cumulative stream sends its next chunk once the new tokens
            reach ``max(stream_interval, ceil(sent x (1 + top_logprobs_num) / this))``, so each
            chunk costs at most about this many entries per new token and a stream of N tokens
            costs O(N x this) instead of O(N^2 x top_logprobs_num).
        max_request_cost: most output entries one ``/generate`` request may produce: samples x
            ``max_new_tokens`` x logprob width (``2 + top_logprobs_num`` with ``return_logprob``,
            else 1); a request over it is a 400 naming the limit (issue #31 item 1).
        fair_reserve_rows: rows that requests of more samples than this never take together
            (None: ``max_running_requests // 8``): a small request always finds a row soon, so a
            big one delays it by a bounded factor (docs/security.md, "Fairness").
        fair_slowdown: F: while requests of at most ``fair_reserve_rows`` samples run, a decode
            step costs at most F times their step alone in the engine's cost model, the big
            requests' rows sharing the rest (rollout_server/engine_fair.py); a huge value turns
            the throttling off.
        header_timeout_seconds: a connection must deliver a complete request head within this
            (also the idle keep-alive timeout; aiohttp's ``keepalive_timeout``).
        body_timeout_seconds: a request body must arrive completely within this.
        weight_group_timeout_seconds: bound of joining a weight-update group (rendezvous with an
            unreachable master) and of each broadcast received through it.
    """

    max_request_bytes: int | None = None
    max_weights_request_bytes: int | None = None
    max_prompts_per_request: int = 128
    max_queued_requests: int = 2048
    max_top_logprobs_num: int = 20
    cumulative_stream_entries: int = 4096
    max_request_cost: int = 1 << 20
    fair_reserve_rows: int | None = None
    fair_slowdown: float = 2.0
    header_timeout_seconds: float = 20.0
    body_timeout_seconds: float = 60.0
    weight_group_timeout_seconds: float = 60.0

    def request_bytes(self, context_len: int) -> int:
        """The body limit of ``/generate`` and the control endpoints, bytes."""
        if self.max_request_bytes is not None:
            return int(self.max_request_bytes)
        return BODY_SLACK_BYTES + BYTES_PER_PROMPT_TOKEN * int(context_len) * int(self.max_prompts_per_request)

    def weights_request_bytes(self, num_params: int) -> int:
        """The body limit of the weight-update endpoints, bytes (never below :meth:`request_bytes`'s slack)."""
        if self.max_weights_request_bytes is not None:
            return int(self.max_weights_request_bytes)
        return BODY_SLACK_BYTES + _WEIGHT_PAYLOAD_BYTES_PER_PARAM * int(num_params)


_FLAG_TYPES: dict[str, Callable[[str], Any]] = {
    "max_request_bytes": int, "max_weights_request_bytes": int, "max_prompts_per_request": int,
    "max_queued_requests": int, "max_top_logprobs_num": int, "cumulative_stream_entries": int,
    "max_request_cost": int, "fair_reserve_rows": int, "fair_slowdown": float,
    "header_timeout_seconds": float, "body_timeout_seconds": float, "weight_group_timeout_seconds": float,
}
#: lower bounds of the flags (the config fields carry the same ones)
_FLAG_MIN: dict[str, float] = {
    "max_request_bytes": 1024, "max_weights_request_bytes": 1024, "max_prompts_per_request": 1,
    "max_queued_requests": 0, "max_top_logprobs_num": 0, "cumulative_stream_entries": 64,
    "max_request_cost": 1, "fair_reserve_rows": 0, "fair_slowdown": 1.0,
    "header_timeout_seconds": 0.1, "body_timeout_seconds": 0.1, "weight_group_timeout_seconds": 0.1,
}


def add_limit_arguments(add: Callable[..., None]) -> None:
    """Add ``--<limit>`` (both spellings) for every :class:`ServerLimits` field via ``add(name, **kw)``."""
    defaults = ServerLimits()
    for f in fields(ServerLimits):
        conv, low = _FLAG_TYPES[f.name], _FLAG_MIN[f.name]

        def parse(text: str, conv=conv, low=low, name=f.name):
            try:
                v = conv(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"--{name} takes a number, got {text!r}") from None
            if not v >= low:
                raise argparse.ArgumentTypeError(f"--{name} must be at least {low}, got {text}")
            return v

        add(f.name.replace("_", "-"), type=parse, default=getattr(defaults, f.name),
            help=f"(default {getattr(defaults, f.name)}; docs/rollout.md#limits)")


def limits_from_args(a: argparse.Namespace) -> ServerLimits:
    """The :class:`ServerLimits` of parsed flags."""
    return ServerLimits(**{f.name: getattr(a, f.name) for f in fields(ServerLimits)})


def limits_from_config(rollout_cfg: Any) -> ServerLimits:
    """The :class:`ServerLimits` of the ``rollout.engine_*`` limit fields of a
    :class:`asyncrl.core.config.RolloutConfig` (an in-process server; :func:`limit_flags` for a launched one)."""
    defaults = ServerLimits()
    return ServerLimits(**{f.name: (v if (v := getattr(rollout_cfg, "engine_" + f.name, None)) is not None
                                    else getattr(defaults, f.name)) for f in fields(ServerLimits)})


def limit_flags(rollout_cfg: Any) -> list[str]:
    """Server flags for the ``rollout.engine_*`` limit fields of a :class:`asyncrl.core.config.RolloutConfig`."""
    out: list[str] = []
    for f in fields(ServerLimits):
        v = getattr(rollout_cfg, "engine_" + f.name, None)
        if v is not None:
            out += [f"--{f.name.replace('_', '-')}", str(v)]
    return out


async def read_limited(request: Any, limit: int, timeout_seconds: float, *, flag: str = "max-request-bytes") -> bytes:
    """The body of an aiohttp ``request``: at most ``limit`` bytes, within ``timeout_seconds``.

    A declared ``Content-Length`` over the limit is refused before a byte is read; a chunked
    body is read until it passes the limit.

    Raises:
        BodyError: 413 (too large; the message names the limit and ``--<flag>``) or 408 (too slow).
    """
    declared = request.content_length
    too_large = (f"the request body is larger than {limit} bytes (the server's --{flag}, "
                 f"rollout.engine_{flag.replace('-', '_')}); send less per request")
    if declared is not None and declared > limit:
        raise BodyError(too_large + f" (Content-Length {declared})", 413)

    async def read() -> bytes:
        chunks, size = [], 0
        while True:
            chunk = await request.content.read(1 << 16)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > limit:
                raise BodyError(too_large, 413)
            chunks.append(chunk)

    task = asyncio.ensure_future(read())
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_seconds)
    finally:
        if not task.done():
            task.cancel()
    if not done:
        raise BodyError(f"the request body did not arrive within {timeout_seconds:g} s (the server's "
                        "--body-timeout-seconds, rollout.engine_body_timeout_seconds)", 408)
    return task.result()


@dataclass
class BodyReader:
    """Reads bodies within one size limit and time bound, and parses big ones off the event loop.

    Attributes:
        limit: most bytes of a body (413 beyond).
        timeout_seconds: the body must arrive within this (408 otherwise).
        flag: the server flag that sets ``limit`` (named in the 413's message).
        executor: where bodies over :data:`INLINE_PARSE_BYTES` and tokenization run (one thread
            keeps the tokenizer single-threaded); None: inline.
    """

    limit: int
    timeout_seconds: float
    flag: str = "max-request-bytes"
    executor: Executor | None = None

    async def read(self, request: Any) -> bytes:
        """The raw body (:func:`read_limited`)."""
        return await read_limited(request, self.limit, self.timeout_seconds, flag=self.flag)

    async def run(self, size: int, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``: inline for work on at most :data:`INLINE_PARSE_BYTES` of input, else on the executor."""
        if self.executor is None or size <= INLINE_PARSE_BYTES:
            return fn(*args, **kw)
        return await self.off_loop(fn, *args, **kw)

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` on the executor (inline when there is none)."""
        if self.executor is None:
            return fn(*args, **kw)
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args, **kw))
