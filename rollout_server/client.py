"""The one async HTTP client asyncrl uses for every rollout engine (SGLang or the embedded one).

It speaks SGLang's native API (https://docs.sglang.io/basic_usage/native_api.html; the subset
asyncrl uses is in docs/rollout.md): ``/generate`` (plain or streamed),
``/abort_request``, ``/pause_generation`` / ``/continue_generation``, the weight-update
endpoints, ``/load_lora_adapter`` / ``/unload_lora_adapter``, info, loads and health.

Streaming: SGLang sends cumulative chunks by default and deltas with
``--incremental-streaming-output`` (2025 builds with ``--stream-output`` send delta ids but
cumulative logprobs). :meth:`EngineClient.generate_stream` normalises all of them to
:class:`StreamDelta` objects holding only the *new* tokens, deciding per chunk and per field:
a list whose length equals ``meta_info.completion_tokens`` is cumulative, anything else is a
delta. :meth:`EngineClient.incremental_streaming` also reports the server's flag from
``/get_server_info``.

Every new token carries the weight version that produced it: from the per-token
``meta_info.weight_versions`` spans when the engine sends them (the embedded engine; SGLang
v-new), else ``meta_info.weight_version`` of the chunk.

Errors: :class:`EngineError` (HTTP status and the server's message) for 4xx/5xx answers;
:class:`EngineUnavailable` when the server cannot be reached.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp

__all__ = ["EngineClient", "EngineError", "EngineUnavailable", "StreamDelta", "GenerateResult"]


class EngineError(RuntimeError):
    """The engine answered with an error status; ``status`` and the server's ``message``."""

    def __init__(self, status: int, message: str, url: str = ""):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status, self.message, self.url = status, message, url


class EngineUnavailable(ConnectionError):
    """The engine could not be reached (refused, reset, timed out)."""


@dataclass
class StreamDelta:
    """New tokens of one streamed chunk (normalised across cumulative and incremental servers).

    ``token_ids``/``logprobs``/``versions`` have one entry per new token; ``finish_reason`` is
    SGLang's dict on the last chunk and None before; ``meta`` is the raw ``meta_info``.
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[str]
    text: str
    finish_reason: dict | None
    meta: dict
    index: int = 0


@dataclass
class GenerateResult:
    """A whole (or aborted) generation: what a sample's segment needs."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    text: str = ""
    finish_reason: dict | None = None
    meta: dict = field(default_factory=dict)

    @property
    def finish_type(self) -> str | None:
        """``stop`` / ``length`` / ``abort`` (or None if the stream broke before the end)."""
        return (self.finish_reason or {}).get("type")


def _versions_for(meta: dict, start: int, count: int) -> list[str]:
    """Weight version of output tokens ``[start, start + count)`` from a chunk's meta_info."""
    spans = meta.get("weight_versions")
    default = str(meta.get("weight_version", "default"))
    if not spans:
        return [default] * count
    out = []
    for i in range(start, start + count):
        v = default
        for sp in spans:
            if sp["start"] <= i < sp["end"]:
                v = str(sp["version"])
                break
        out.append(v)
    return out


class EngineClient:
    """Async client for one engine URL.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:30000``.
        api_key: bearer token for the engine's ``--api-key`` (None: no header).
        timeout_seconds: total timeout of non-generation calls (generation calls have none:
            long rollouts are normal; use :meth:`abort` to stop them).
    """

    def __init__(self, url: str, api_key: str | None = None, timeout_seconds: float = 60.0):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_seconds = timeout_seconds
        self._session: aiohttp.ClientSession | None = None
        self._incremental: bool | None = None

    # -- plumbing ---------------------------------------------------------------------------------

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_seconds),
            )
        return self._session

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _request(self, method: str, path: str, body: Any = None, timeout: float | None = -1.0) -> tuple[int, Any]:
        t = self.timeout_seconds if timeout == -1.0 else timeout
        try:
            async with self._http().request(
                method, self.url + path, json=body, timeout=aiohttp.ClientTimeout(total=t)
            ) as r:
                raw = await r.read()
                status = r.status
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise EngineUnavailable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        try:
            data = json.loads(raw) if raw.strip() else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = raw.decode("utf-8", "replace")
        return status, data

    async def _call(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200,), timeout: float | None = -1.0) -> Any:
        status, data = await self._request(method, path, body, timeout)
        if status not in ok:
            raise EngineError(status, _message(data), self.url + path)
        return data

    # -- info / health ----------------------------------------------------------------------------

    async def health(self) -> bool:
        """True when ``/health`` answers 200."""
        try:
            status, _ = await self._request("GET", "/health", timeout=5.0)
        except EngineUnavailable:
            return False
        return status == 200

    async def wait_ready(self, timeout_seconds: float = 300.0, poll_seconds: float = 0.5, process: Any = None) -> dict:
        """Wait until the server answers ``/health`` and ``/get_model_info`` (SGLang's own ready check).

        Args:
            process: optional ``subprocess.Popen``/``asyncio.subprocess.Process`` of the server;
                if it exits first, fail at once instead of waiting out the timeout.

        Returns:
            the ``/get_model_info`` answer.

        Raises:
            EngineUnavailable: not ready within ``timeout_seconds``, or the process exited.
        """
        deadline = time.monotonic() + timeout_seconds
        last = "no answer"
        while time.monotonic() < deadline:
            code = getattr(process, "returncode", None) if process is not None else None
            if process is not None and hasattr(process, "poll"):
                code = process.poll()
            if code is not None:
                raise EngineUnavailable(f"{self.url}: the server process exited with code {code} before it was ready")
            try:
                if await self.health():
                    return await self.model_info()
            except (EngineUnavailable, EngineError) as exc:
                last = str(exc)
            await asyncio.sleep(poll_seconds)
        raise EngineUnavailable(f"{self.url} not ready after {timeout_seconds:.0f} s ({last})")

    async def model_info(self) -> dict:
        """``GET /get_model_info``."""
        return await self._call("GET", "/get_model_info")

    async def server_info(self) -> dict:
        """``GET /get_server_info`` (also refreshes the streaming-mode flag)."""
        info = await self._call("GET", "/get_server_info")
        self._incremental = bool(info.get("incremental_streaming_output") or info.get("stream_output"))
        return info

    async def incremental_streaming(self) -> bool:
        """Whether the server streams deltas (from ``/get_server_info``, cached)."""
        if self._incremental is None:
            await self.server_info()
        return bool(self._incremental)

    async def weight_version(self) -> str:
        """The loaded weights' version string (``/get_model_info``'s ``weight_version``)."""
        return str((await self.model_info())["weight_version"])

    async def loads(self) -> dict:
        """``GET /v1/loads?include=core``'s first entry (``num_running_reqs``, ``num_waiting_reqs``, ...)."""
        data = await self._call("GET", "/v1/loads?include=core")
        return data["loads"][0]

    async def flush_cache(self) -> bool:
        """``/flush_cache``: True if flushed, False if requests were running."""
        status, _ = await self._request("POST", "/flush_cache")
        return status == 200

    # -- generation -------------------------------------------------------------------------------

    def _payload(self, input_ids, sampling_params, rid, return_logprob, stream, extra) -> dict:
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params or {},
                                "return_logprob": return_logprob, "stream": stream}
        if rid is not None:
            body["rid"] = rid
        body.update(extra)
        return body

    async def generate(self, input_ids: list[int] | list[list[int]], sampling_params: dict | list[dict] | None = None,
                       rid: str | list[str] | None = None, return_logprob: bool = True, **extra: Any) -> Any:
        """Non-streaming ``/generate``; returns SGLang's dict (list for a batch or ``n > 1``).

        Raises:
            EngineError: 4xx/5xx (e.g. a bad request: the server's message).
        """
        body = self._payload(input_ids, sampling_params, rid, return_logprob, False, extra)
        return await self._call("POST", "/generate", body, timeout=None)

    async def generate_stream(self, input_ids: list[int], sampling_params: dict | None = None, rid: str | None = None,
                              return_logprob: bool = True, **extra: Any) -> AsyncIterator[StreamDelta]:
        """Streaming ``/generate`` of one prompt; yields :class:`StreamDelta` with only new tokens.

        Closing the iterator early closes the connection, which aborts the request on the
        server (SGLang and the embedded engine both do this).

        Raises:
            EngineError: the server rejected the request or sent an error chunk.
            EngineUnavailable: the connection failed or broke mid-stream.
        """
        body = self._payload(input_ids, sampling_params, rid, return_logprob, True, extra)
        seen: dict[int, int] = {}
        text_seen: dict[int, str] = {}
        try:
            async with self._http().post(self.url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=None)) as r:
                if r.status != 200:
                    raw = await r.read()
                    try:
                        data = json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        data = raw.decode("utf-8", "replace")
                    raise EngineError(r.status, _message(data), self.url + "/generate")
                buf = b""
                async for piece in r.content.iter_any():
                    buf += piece
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data:"):
                                continue
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                return
                            chunk = json.loads(payload)
                            if "error" in chunk and "meta_info" not in chunk:
                                raise EngineError(500, _message(chunk), self.url + "/generate")
                            yield _delta(chunk, seen, text_seen)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as exc:
            raise EngineUnavailable(f"{self.url}/generate stream broke: {type(exc).__name__}: {exc}") from exc

    async def generate_collect(self, input_ids: list[int], sampling_params: dict | None = None, rid: str | None = None,
                               return_logprob: bool = True, **extra: Any) -> GenerateResult:
        """Stream one generation and gather it into a :class:`GenerateResult`."""
        res = GenerateResult()
        async for d in self.generate_stream(input_ids, sampling_params, rid, return_logprob, **extra):
            res.token_ids += d.token_ids
            res.logprobs += d.logprobs
            res.versions += d.versions
            res.text += d.text
            res.meta = d.meta
            if d.finish_reason is not None:
                res.finish_reason = d.finish_reason
        return res

    # -- control ----------------------------------------------------------------------------------

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """``/abort_request``: abort requests whose rid starts with ``rid``, or all."""
        await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> dict:
        """``/pause_generation`` with ``mode`` abort / retract / in_place."""
        return await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> dict:
        """``/continue_generation``."""
        return await self._call("POST", "/continue_generation", {})

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       abort_all_requests: bool = False, timeout: float | None = 600.0,
                                       flush_cache: bool = True) -> dict:
        """``/update_weights_from_disk``; raises :class:`EngineError` when ``success`` is false.

        ``flush_cache=False`` (sent only then: SGLang releases before the field took it as
        default) keeps the engine's cached keys/values of the old weights for prefixes of later
        requests, as ``pause_mode: in_place`` keeps those of running requests.
        """
        body = {"model_path": str(model_path), "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if not flush_cache:
            body["flush_cache"] = False
        return await self._weights_call("/update_weights_from_disk", body, timeout)

    async def update_weights_from_tensor(self, named_tensors: dict[str, Any], weight_version: str | None = None,
                                         abort_all_requests: bool = False, timeout: float | None = 600.0,
                                         flush_cache: bool = True) -> dict:
        """``/update_weights_from_tensor`` with a base64 safetensors payload (embedded engine only);
        ``flush_cache`` as for :meth:`update_weights_from_disk`."""
        from asyncrl.core.weights import encode_safetensors_payload

        body = {"serialized_named_tensors": [encode_safetensors_payload(named_tensors)],
                "load_format": "safetensors", "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if not flush_cache:
            body["flush_cache"] = False
        return await self._weights_call("/update_weights_from_tensor", body, timeout)

    async def update_weight_version(self, version: str, abort_all_requests: bool = False) -> dict:
        """``/update_weight_version``: relabel the loaded weights (no load); raises :class:`EngineError` on failure."""
        body = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        return await self._weights_call("/update_weight_version", body, self.timeout_seconds)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: float | None = 600.0) -> dict:
        """``/load_lora_adapter``: register the PEFT adapter in directory ``lora_path`` as ``lora_name``.

        Returns SGLang's answer (``loaded_adapters``: name -> path of every registered adapter).

        Raises:
            EngineError: ``success`` false (unreadable adapter, name taken, LoRA not enabled, ...).
        """
        body = {"lora_name": str(lora_name), "lora_path": str(lora_path)}
        return await self._weights_call("/load_lora_adapter", body, timeout)

    async def unload_lora_adapter(self, lora_name: str, timeout: float | None = 600.0) -> dict:
        """``/unload_lora_adapter``: forget ``lora_name`` (SGLang waits for the requests running under it).

        Raises:
            EngineError: ``success`` false (no adapter of that name is loaded).
        """
        return await self._weights_call("/unload_lora_adapter", {"lora_name": str(lora_name)}, timeout)

    async def _weights_call(self, path: str, body: dict, timeout: float | None) -> dict:
        status, data = await self._request("POST", path, body, timeout)
        if status != 200 or not isinstance(data, dict) or not data.get("success", False):
            raise EngineError(status, _message(data), self.url + path)
        return data


def _message(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
        if "message" in data:
            return str(data["message"])
        if data.get("error_message"):  # SGLang's LoRAUpdateOutput
            return str(data["error_message"])
    return str(data)


def _delta(chunk: dict, seen: dict[int, int], text_seen: dict[int, str]) -> StreamDelta:
    """New tokens of one chunk; ``seen[index]`` counts tokens already delivered for that index."""
    idx = int(chunk.get("index", 0))
    meta = chunk.get("meta_info", {})
    done = seen.get(idx, 0)
    total = int(meta.get("completion_tokens", done))
    ids = chunk.get("output_ids") or []
    new_ids = ids[done:] if len(ids) == total else ids
    lps_raw = meta.get("output_token_logprobs")
    if lps_raw is None:
        new_lps: list[float] = []
    else:
        new_raw = lps_raw[done:] if len(lps_raw) == total else lps_raw
        new_lps = [float(x[0]) if x[0] is not None else float("nan") for x in new_raw]
    text = chunk.get("text") or ""
    prev = text_seen.get(idx, "")
    if len(ids) == total and text.startswith(prev):
        new_text = text[len(prev):]
        text_seen[idx] = text
    else:
        new_text = text
        text_seen[idx] = prev + text
    seen[idx] = done + len(new_ids)
    return StreamDelta(
        token_ids=list(new_ids), logprobs=new_lps, versions=_versions_for(meta, done, len(new_ids)), text=new_text,
        finish_reason=meta.get("finish_reason"), meta=meta, index=idx,
    )
