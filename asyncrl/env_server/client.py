"""The rollout worker's side of the environment server: :class:`EnvServerClient`.

One ``POST /tools/<name>`` per tool call, on a pooled ``aiohttp`` session of the worker's event
loop (a call waits without holding a thread). What the workflow sees, by what happened:

| what happened | the workflow's ``model.tool(...)`` gets |
|---|---|
| the server answered ``ok`` | ``(True, result)`` |
| the server answered ``tool_error`` (the tool refused the input), or refused the request (400, 413, 415) | ``(False, "error: ...")`` — an observation |
| the server answered ``deadline``, or no answer came within the deadline + 2 s while the connection stayed open | ``(False, "error: the tool took longer than D s")`` — an observation; the episode continues |
| the server could not be reached (refused, or no connection within 5 s), reset or closed the connection (it died: ``kill -9``), or answered 503 (draining) or another 5xx | the call is **sent again** with backoff (0.1 s doubling to 2 s) until it is answered; the episode waits (its lease is renewed by the worker's heartbeat) and sees nothing of the outage |
| that lasted longer than ``agent.env_server.outage_seconds``, or the server refused the key (401) or has no such tool (404) | :class:`~asyncrl.env_server.errors.EnvServerUnavailable` is raised: the workflow fails and its sample is FAILED (``WorkflowError: EnvServerUnavailable: ...``, counted ``failed_samples:workflow_error``) |

So a ``kill -9`` of the server changes no episode: a call in flight is sent again, with the
same ``call_id``, to the server the supervisor restarts; its latency is drawn from the same
``(seed, call_id)`` and its result is the same (tools are pure functions of their input).
Each outage is one WARNING line when it starts and one line when the server is back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import aiohttp
from pydantic import SecretStr, ValidationError

from asyncrl.env_server.errors import EnvServerUnavailable, ToolCallError
from asyncrl.env_server.schemas import ToolResponse

__all__ = ["EnvServerClient", "deadline_observation", "GRACE_SECONDS"]

log = logging.getLogger(__name__)

#: The worker waits this long past a call's deadline for the server's answer before it decides
#: the deadline passed (the server answers at its deadline; this covers the network and the loop).
GRACE_SECONDS = 2.0
#: A connection not established within this many seconds counts as the server being unreachable.
CONNECT_SECONDS = 5.0
#: Backoff between attempts while the server is unreachable: first and largest delay, seconds.
BACKOFF_SECONDS = (0.1, 2.0)


def deadline_observation(deadline_seconds: float) -> str:
    """The observation of a call past its deadline (the in-process tool's text: docs/agents.md)."""
    return f"error: the tool took longer than {deadline_seconds:g} s"


class EnvServerClient:
    """Calls tools on an environment server (module docstring); one per event loop.

    Args:
        url: the server, ``http://host:port``.
        deadline_seconds: each call's deadline (``agent.env_server.deadline_seconds``).
        outage_seconds: how long one call waits out an unreachable or draining server.
        api_key: bearer token, or None; never logged or put in errors.

    Usage::

        client = EnvServerClient("http://127.0.0.1:30600", deadline_seconds=10)
        value = await client.calculate("12*13", call_id="g0/1:0")   # "156"
        await client.aclose()
    """

    def __init__(self, url: str, deadline_seconds: float = 10.0, outage_seconds: float = 300.0,
                 api_key: SecretStr | str | None = None) -> None:
        if deadline_seconds <= 0 or outage_seconds <= 0:
            raise ValueError("deadline_seconds and outage_seconds must be > 0")
        self.url = url.rstrip("/")
        self.deadline_seconds = float(deadline_seconds)
        self.outage_seconds = float(outage_seconds)
        key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._session: aiohttp.ClientSession | None = None
        self._outage_since: float | None = None
        #: counts: calls, answered (``ok``), tool_errors, deadlines, retries, outages
        self.stats = {"calls": 0, "ok": 0, "tool_errors": 0, "deadlines": 0, "retries": 0, "outages": 0}

    @classmethod
    def from_config(cls, env_server: Any, api_key: SecretStr | str | None = None) -> "EnvServerClient":
        """From the ``agent.env_server`` config section; ``api_key`` is sent when ``api_key_required``."""
        return cls(env_server.server_url, env_server.deadline_seconds, env_server.outage_seconds,
                   api_key if env_server.api_key_required else None)

    @property
    def in_outage(self) -> bool:
        """True from a call's first failure to reach the server until a call is answered again."""
        return self._outage_since is not None

    @property
    def max_call_seconds(self) -> float:
        """The longest one call can take: its outage budget, its deadline and the grace, plus one backoff."""
        return self.outage_seconds + self.deadline_seconds + GRACE_SECONDS + BACKOFF_SECONDS[1]

    async def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers, connector=aiohttp.TCPConnector(limit=256))
        return self._session

    async def calculate(self, expression: str, call_id: str, replay: bool = False) -> str:
        """The calculator's result for ``expression`` (``POST /tools/calculate``).

        Args:
            expression: integer arithmetic (``+ - * // %``), at most the server's
                ``max_expression_chars``.
            call_id: stable across replays of the same call (seeds its latency).
            replay: the episode is being replayed (counted by the server).

        Returns:
            the integer as text.

        Raises:
            ToolCallError: the calculator refused the expression, or the deadline passed
                (``.observation`` is the text for the model).
            EnvServerUnavailable: unreachable past ``outage_seconds``, or a refused key.
        """
        return await self.call("calculate", {"expression": expression}, call_id, replay)

    async def call(self, tool: str, args: dict[str, Any], call_id: str, replay: bool = False) -> str:
        """One call of ``tool`` with ``args`` (the endpoint's fields); see :meth:`calculate`."""
        self.stats["calls"] += 1
        body = {**args, "call_id": call_id, "deadline_ms": max(1, int(math.ceil(self.deadline_seconds * 1000))),
                "replay": bool(replay)}
        first_failure: float | None = None
        delay = BACKOFF_SECONDS[0]
        # connecting is bounded apart: a server that cannot be reached is an outage, not a slow tool
        timeout = aiohttp.ClientTimeout(total=self.deadline_seconds + GRACE_SECONDS, sock_connect=CONNECT_SECONDS)
        while True:
            try:
                session = await self._get_session()
                async with session.post(f"{self.url}/tools/{tool}", json=body, timeout=timeout) as resp:
                    status, text = resp.status, await resp.text()
            except aiohttp.ConnectionTimeoutError as exc:
                why = f"no connection within {CONNECT_SECONDS:g} s ({type(exc).__name__})"
            except asyncio.TimeoutError:
                self._back()
                self.stats["deadlines"] += 1
                raise ToolCallError(deadline_observation(self.deadline_seconds), "deadline") from None
            except aiohttp.ClientError as exc:  # refused, reset, closed mid-answer: the server is down
                why = f"{type(exc).__name__}: {exc}"
            else:
                if status == 200:
                    self._back()
                    return self._answer(text)
                if status < 500:
                    self._back()
                    self._refused(status, text, tool)
                why = f"HTTP {status}: {_message(text)}"
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            self._down(why)
            if now - first_failure >= self.outage_seconds:
                raise EnvServerUnavailable(
                    f"the environment server at {self.url} did not answer /tools/{tool} for {now - first_failure:.0f} s "
                    f"(agent.env_server.outage_seconds={self.outage_seconds:g}); last error: {why}")
            self.stats["retries"] += 1
            await asyncio.sleep(delay)
            delay = min(BACKOFF_SECONDS[1], delay * 2)

    def _answer(self, text: str) -> str:
        try:
            answer = ToolResponse.model_validate_json(text)
        except ValidationError as exc:
            raise EnvServerUnavailable(f"the environment server at {self.url} sent a malformed answer: {exc.errors()[0]['msg']}") from None
        if answer.outcome == "ok":
            self.stats["ok"] += 1
            return answer.result or ""
        if answer.outcome == "deadline":
            self.stats["deadlines"] += 1
            raise ToolCallError(deadline_observation(self.deadline_seconds), "deadline")
        self.stats["tool_errors"] += 1
        raise ToolCallError(f"error: {answer.error or 'the tool failed'}", "tool_error")

    def _refused(self, status: int, text: str, tool: str) -> None:
        msg = _message(text)
        if status in (400, 413, 415):  # the environment refused what the model wrote: an observation
            self.stats["tool_errors"] += 1
            raise ToolCallError(f"error: the environment refused the call: {msg}", "tool_error")
        what = "refused the key (set security.api_key as the server has it)" if status == 401 else \
            f"answered HTTP {status} to /tools/{tool}: {msg}"
        raise EnvServerUnavailable(f"the environment server at {self.url} {what}")

    def _down(self, why: str) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self.stats["outages"] += 1
            log.warning("the environment server at %s is unavailable (%s); tool calls are sent again with backoff for up "
                        "to agent.env_server.outage_seconds=%g s each", self.url, why, self.outage_seconds)

    def _back(self) -> None:
        if self._outage_since is not None:
            log.warning("the environment server at %s answers again after %.1f s", self.url,
                        time.monotonic() - self._outage_since)
            self._outage_since = None

    async def health(self) -> bool:
        """True when ``/health`` answers 200 (serving, not draining)."""
        try:
            session = await self._get_session()
            async with session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def wait_ready(self, timeout_seconds: float = 600.0, poll_seconds: float = 0.5) -> None:
        """Wait until :meth:`health` is True.

        Raises:
            EnvServerUnavailable: not ready within ``timeout_seconds``.
        """
        deadline = time.monotonic() + timeout_seconds
        while not await self.health():
            if time.monotonic() >= deadline:
                raise EnvServerUnavailable(f"the environment server at {self.url} was not ready within "
                                           f"{timeout_seconds:g} s (is `asyncrl env-server` running, and "
                                           "agent.env_server.url/port right?)")
            await asyncio.sleep(poll_seconds)

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def _message(text: str) -> str:
    """The ``error.message`` of an error answer, else the start of its text."""
    import json

    try:
        err = json.loads(text).get("error")
        return str(err.get("message") if isinstance(err, dict) else err)[:300]
    except (ValueError, AttributeError):
        return text[:200]
