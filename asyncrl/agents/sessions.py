"""OpenAI-compatible sessions: an existing agent program's chat calls as one episode's model calls.

Many agents are programs that call an OpenAI-compatible chat API. The built-in workflow
``openai_harness`` (:mod:`asyncrl.agents.harness`) runs such a program (the *harness*) per
episode and gives it a **session** on a small HTTP app inside the rollout worker process
(:class:`SessionServer`, one per process and event loop, on a free loopback port, started on the
first episode). The session key is the bearer token (``OPENAI_API_KEY``); it selects the
episode, an unknown key is 401. Endpoints (docs/agents.md, "Existing agents"):

* ``POST /v1/chat/completions`` (non-streaming): one model call of the episode's
  :class:`asyncrl.agents.model.EpisodeModel`. The first call's messages must render (chat
  template, ``add_generation_prompt``) to exactly the episode's prompt ids; a trailing
  ``assistant`` message is a prefill (appended to the rendered prompt as text, the convention
  of ``continue_final_message``). Later calls must repeat the conversation so far, every
  assistant message being ``prefill + content`` of the reply asyncrl gave, and add at least one
  new non-assistant message: the new messages are an observation, tokenised once with the chat
  template's delimiters (:meth:`asyncrl.agents.chat.ChatFormat.messages_observation_ids`) after
  the exact ids of the previous output, never a re-tokenisation of history (rllm PR #272).
  A call whose history differs from the record (the harness edited, dropped or added an
  assistant message) starts a new trajectory of the episode (``session-k``, see
  :meth:`asyncrl.agents.model.EpisodeModel.trajectory`) whose prompt is that call's messages
  tokenised once; the conversation continues there, and the episode counts it
  (``sessions_history_mismatch``). Nothing recorded is rewritten.
* ``POST /v1/episode/reward``: ``{"reward": float, "metrics": {name: float}}``, once; the session
  then takes no more calls.
* ``GET /v1/models``: the one model served (the policy).

Every request body is checked by one pydantic schema per endpoint with bounded sizes; one
session's failure never touches another's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import secrets
import time
import weakref
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from asyncrl.agents.chat import ChatFormat, ChatFormatError, off_loop
from asyncrl.core.net import SERVER_KWARGS, content_encoding_refusal, header_bytes
from asyncrl.agents.model import MAX_TRAJECTORIES, EpisodeModel
from asyncrl.agents.workflow import EpisodeTimeout, TokenLimit

__all__ = ["ChatMessage", "ChatRequest", "RewardRequest", "Session", "SessionError", "SessionServer",
           "prompt_messages", "render_messages_ids", "MAX_BODY_BYTES"]

#: Largest request body (bytes) the session app reads.
MAX_BODY_BYTES = 4 * 1024 * 1024


class ChatMessage(BaseModel):
    """One chat message: a role and a text content (at most 200,000 characters)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: str = Field(pattern=r"^[a-z_]{1,32}$")
    content: str = Field(max_length=200_000)


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions``: the subset of OpenAI's request that an RL rollout can honour.

    ``model`` and ``temperature`` must be the run's or absent (the behaviour policy is the run's);
    ``max_tokens`` / ``max_completion_tokens`` bound this call's output (default
    ``agent.max_tokens_per_turn``); ``stop`` must be absent or empty (the run's ``rollout.stop``
    applies); ``n`` must be 1 and ``stream`` false. Strict types, like the rollout server's
    schemas: ``"10"`` is not a number; an integer is accepted where a float is expected.
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = Field(None, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=1)
    stream: Literal[False] | None = None
    user: str | None = Field(None, max_length=256)

    @field_validator("stop")
    @classmethod
    def _no_stop(cls, v: Any) -> Any:
        if v:
            raise ValueError("per-call stop strings are not supported: the run's rollout.stop applies to every call")
        return v


class RewardRequest(BaseModel):
    """``POST /v1/episode/reward``: the episode's scalar reward and up to 16 named metrics (finite
    numbers; strict: ``"1"`` is not a number)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    reward: float
    metrics: dict[str, float] = Field(default_factory=dict, max_length=16)

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("the reward must be a finite number")
        return v

    @field_validator("metrics")
    @classmethod
    def _names(cls, v: dict[str, float]) -> dict[str, float]:
        for k, x in v.items():
            if not (1 <= len(k) <= 64) or not k.replace("_", "").isalnum():
                raise ValueError(f"metric name {k[:70]!r} must be 1-64 letters, digits or '_'")
            if not math.isfinite(x):
                raise ValueError(f"metric {k!r} must be a finite number")
        return v


class SessionError(Exception):
    """A refused session request: HTTP ``status``, an OpenAI-style error ``code`` and a message saying what to fix."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def render_messages_ids(tokenizer: Any, messages: list[tuple[str, str]], prefill: str = "") -> list[int]:
    """The prompt ids of ``messages`` as asyncrl renders prompts (asyncrl.tasks.tasks.render_prompt).

    Chat template with ``add_generation_prompt=True``, then ``prefill`` as text, tokenised once
    without adding special tokens. Returns (P,) ids.
    """
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text + prefill, add_special_tokens=False)["input_ids"])


def prompt_messages(tokenizer: Any, prompt_ids: list[int]) -> list[dict[str, str]]:
    """The chat messages whose rendering is ``prompt_ids`` (given to a harness as its first request).

    The decoded prompt is matched against the chat template's rendering of ``[system, user]`` and
    of ``[user]`` with marker contents; what follows the generation prompt is an assistant
    prefill, returned as a trailing ``assistant`` message. No content may hold a special or
    added token of the tokenizer (that would be a template's delimiter: a prompt of more turns).
    The result is checked by rendering it again (:func:`render_messages_ids`).

    Raises:
        ValueError: no such split reproduces the prompt ids (e.g. a prompt of several user turns).
    """
    import re

    text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    specials = [str(t) for t in getattr(tokenizer, "all_special_tokens", [])]
    specials += [str(t) for t in getattr(tokenizer, "get_added_vocab", dict)().keys()]
    for roles in (("system", "user"), ("user",)):
        marks = [f"\u2063M{i}\u2063" for i in range(len(roles))]
        try:
            tmpl = tokenizer.apply_chat_template([{"role": r, "content": m} for r, m in zip(roles, marks)],
                                                 tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template without system messages
            continue
        pieces, rest = [], tmpl
        for m in marks:
            if m not in rest:
                break
            a, rest = rest.split(m, 1)
            pieces.append(a)
        else:
            pattern = "".join(re.escape(p) + "(.*?)" for p in pieces) + re.escape(rest) + r"(.*)\Z"
            got = re.match(pattern, text, re.S)
            if got is None:
                continue
            *contents, prefill = got.groups()
            if any(t and t in x for t in specials for x in got.groups()):
                continue  # template tokens inside a message: more turns than this split
            msgs = list(zip(roles, contents))
            if render_messages_ids(tokenizer, msgs, prefill) == list(prompt_ids):
                out = [{"role": r, "content": c} for r, c in msgs]
                return out + ([{"role": "assistant", "content": prefill}] if prefill else [])
    raise ValueError("the episode's prompt is not a chat-templated [system,] user prompt with an optional prefill; "
                     "openai_harness cannot give it to a harness as messages")


def _first_difference(a: list[Any], b: list[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


class Session:
    """One episode's conversation as the harness sees it (see the module docstring).

    Args:
        model: the episode's :class:`EpisodeModel` (records live calls, replays recorded ones).
        chat: the tokenizer's :class:`ChatFormat`.
        model_name: the served model id (``GET /v1/models``); a request's ``model`` must be it or absent.
        temperature: the run's sampling temperature; a request's ``temperature`` must be it or absent.

    Attributes:
        reward, metrics: what the harness posted (None before).
        failure: the exception a model call raised (an interrupt, the token limit, the episode
            timeout, an engine error); the workflow re-raises it.
        done: set once the reward is posted or a call failed.
        history_mismatches, calls, turn_limited: counts for the episode's metrics (mismatches =
            trajectories started because the history sent differed from the record).
    """

    def __init__(self, model: EpisodeModel, chat: ChatFormat, model_name: str, temperature: float | None) -> None:
        self.model = model
        self.current = model  # the trajectory the conversation continues (a new one after a history mismatch)
        self.chat = chat
        self.model_name = model_name
        self.temperature = temperature
        self.history: list[tuple[str, str]] | None = None
        self.reward: float | None = None
        self.metrics: dict[str, float] = {}
        self.failure: BaseException | None = None
        self.done = asyncio.Event()
        self.history_mismatches = 0
        self.calls = 0
        self.turn_limited = False
        self._lock = asyncio.Lock()

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        self.done.set()

    def _check_request(self, req: ChatRequest) -> int | None:
        if req.model not in (None, self.model_name):
            raise SessionError(400, "model_not_found", f"model {req.model[:80]!r} is not served here: use "
                                                       f"{self.model_name!r} or leave it out")
        if req.temperature is not None and (self.temperature is None or abs(req.temperature - self.temperature) > 1e-6):
            raise SessionError(400, "invalid_temperature", f"temperature {req.temperature} differs from the run's "
                                                           f"rollout.temperature {self.temperature}: leave it out")
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise SessionError(400, "invalid_max_tokens", "max_tokens and max_completion_tokens differ: give one")
        return req.max_completion_tokens or req.max_tokens

    async def complete(self, req: ChatRequest) -> dict[str, Any]:
        """Answer one chat completion (calls are served one at a time per session).

        Returns:
            the OpenAI ``chat.completion`` object.

        Raises:
            SessionError: the request is refused (nothing of it applied), or a model call failed
                (``failure`` then holds the cause and the episode ends).
        """
        async with self._lock:
            if self.done.is_set():
                raise SessionError(400, "session_closed", "this episode's session is closed (its reward was posted "
                                                          "or the episode ended): make no more calls")
            limit = self._check_request(req)
            msgs = [(m.role, m.content) for m in req.messages]
            prefill = msgs.pop()[1] if msgs[-1][0] == "assistant" else ""
            if not msgs:
                raise SessionError(400, "invalid_messages", "the messages hold only an assistant prefill")
            m = self.current
            obs_ids: list[int] = []
            new_prompt: list[int] | None = None
            try:
                if self.history is None:  # tokenised off the event loop, message text as text (never a control token)
                    ids = await off_loop(self.chat.render_ids, msgs, prefill)
                    if ids != list(m.task.prompt_ids):
                        at = _first_difference(ids, list(m.task.prompt_ids))
                        raise SessionError(400, "prompt_mismatch", (
                            f"the first request's messages render to {len(ids)} tokens that differ from the episode's "
                            f"prompt of {len(m.task.prompt_ids)} tokens at token {at}: send exactly the 'messages' of "
                            "ASYNCRL_TASK (a trailing assistant message is the prefill)"))
                else:
                    n = len(self.history)
                    if msgs[:n] != self.history or any(r == "assistant" for r, _ in msgs[n:]):
                        # the harness rewrote the conversation: its messages are a new trajectory's prompt
                        new_prompt = await off_loop(self.chat.render_ids, msgs, prefill)
                    elif len(msgs) == n:
                        raise SessionError(400, "no_new_message", "a call must add at least one message after the "
                                                                  "last assistant reply")
                    else:
                        last = m.steps[-1].output.token_ids if m.steps else ()
                        obs_ids = await off_loop(self.chat.messages_observation_ids, msgs[n:], prefill, after_ids=last)
            except ChatFormatError as exc:
                raise SessionError(400, "invalid_messages", str(exc)) from None
            if new_prompt is not None and len(self.model.trajectories) >= MAX_TRAJECTORIES:
                raise SessionError(400, "too_many_trajectories", (
                    f"the conversation sent differs from the recorded one and the episode already has "
                    f"{MAX_TRAJECTORIES} trajectories: resend the recorded conversation, or post the reward"))
            if new_prompt is None and m.turns_left == 0:
                self.turn_limited = True
                raise SessionError(400, "turn_limit", f"the episode allows agent.max_turns={m.max_turns} model calls "
                                                      "per trajectory; post the reward")
            try:
                if new_prompt is not None:
                    m = await self.model.trajectory(f"session-{self.history_mismatches + 1}", prompt_ids=new_prompt)
                    self.history_mismatches += 1
                    self.current = m
                if obs_ids:
                    await m.observe_ids(obs_ids)
                out = await m.generate(limit)
            except asyncio.CancelledError:  # the app is shutting down mid-call: the episode cannot go on
                self._fail(RuntimeError("a model call of the session was cancelled (the session app stopped)"))
                raise
            except BaseException as exc:  # an interrupt, the token limit or timeout, an engine error: the episode ends
                self._fail(exc)
                raise SessionError(400 if isinstance(exc, (TokenLimit, EpisodeTimeout)) else 503,
                                   "episode_ended", f"the episode ended during this call ({type(exc).__name__})") \
                    from None
            self.history = msgs + [("assistant", prefill + out.text)]
            self.calls += 1
            n_prompt = len(m.context_ids) - len(out.token_ids)
            return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
                    "model": self.model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                                 "finish_reason": out.finish_reason, "logprobs": None}],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(out.token_ids),
                              "total_tokens": n_prompt + len(out.token_ids)}}

    def post_reward(self, req: RewardRequest) -> None:
        """Record the episode's reward (once); the session then takes no more calls.

        Raises:
            SessionError: a reward was already posted, or the episode already ended.
        """
        if self.reward is not None:
            raise SessionError(400, "reward_posted", "this episode's reward was already posted")
        if self.done.is_set():
            raise SessionError(400, "session_closed", "this episode already ended")
        self.reward, self.metrics = float(req.reward), dict(req.metrics)
        self.done.set()


def _error(status: int, code: str, message: str) -> web.Response:
    kind = "authentication_error" if status == 401 else ("server_error" if status >= 500 else "invalid_request_error")
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ())) or "body"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)


@web.middleware
async def _close_refused(request: web.Request, handler: Any) -> web.StreamResponse:
    """A refusal that left the body unread closes the connection (no lingering read of it)."""
    resp = await handler(request)
    if resp.status >= 400 and request.body_exists and not request.content.is_eof():
        resp.force_close()
    return resp


_servers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task]" = weakref.WeakKeyDictionary()


class SessionServer:
    """The session app of one process and event loop: ``http://127.0.0.1:<port>/v1``.

    Sessions are registered with a fresh random key (``secrets.token_urlsafe(32)``) and looked up
    by its SHA-256, so the key itself is kept only by the harness's environment; it is never
    logged or put in an error.
    """

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    @classmethod
    async def shared(cls) -> "SessionServer":
        """The running loop's server, started on first use (a free loopback port)."""
        loop = asyncio.get_running_loop()
        starting = _servers.get(loop)
        if starting is None:  # the first episode starts it; concurrent ones wait for the same start
            srv = cls()
            starting = _servers[loop] = loop.create_task(srv._started())
        try:
            return await asyncio.shield(starting)
        except Exception:
            if _servers.get(loop) is starting:
                del _servers[loop]  # the next episode tries again
            raise

    async def _started(self) -> "SessionServer":
        await self.start()
        return self

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1`` (``OPENAI_BASE_URL`` of a harness)."""
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_close_refused])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/episode/reward", self._reward)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, **SERVER_KWARGS)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @staticmethod
    def _digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    def register(self, session: Session) -> str:
        """Serve ``session``; returns its fresh key (the harness's ``OPENAI_API_KEY``)."""
        key = secrets.token_urlsafe(32)
        self._sessions[self._digest(key)] = session
        return key

    def unregister(self, key: str) -> None:
        """Stop serving the session of ``key`` (later requests with it are 401)."""
        self._sessions.pop(self._digest(key), None)

    @property
    def active(self) -> int:
        """Sessions served now."""
        return len(self._sessions)

    def _session(self, request: web.Request) -> Session:
        refusal = content_encoding_refusal(request.headers)  # before auth, before the body is read
        if refusal is not None:
            raise SessionError(415, "unsupported_content_encoding", refusal)
        auth = request.headers.get("Authorization", "")
        scheme, _, key = auth.partition(" ")
        if header_bytes(key) is None:
            raise SessionError(400, "invalid_api_key", "the Authorization header holds non-ASCII characters: send "
                                                       "'Bearer <OPENAI_API_KEY>' as asyncrl gave it")
        s = self._sessions.get(self._digest(key.strip())) if scheme.lower() == "bearer" and key.strip() else None
        if s is None:
            raise SessionError(401, "invalid_api_key", "unknown or missing session key: send 'Authorization: Bearer' "
                                                       "with the OPENAI_API_KEY asyncrl gave this episode")
        return s

    @staticmethod
    async def _body(request: web.Request, schema: type[BaseModel]) -> Any:
        try:
            raw = await request.read()
            return schema.model_validate_json(raw)
        except web.HTTPRequestEntityTooLarge:
            raise SessionError(413, "request_too_large", f"the request body is over {MAX_BODY_BYTES} bytes") from None
        except ValidationError as exc:
            raise SessionError(400, "invalid_request", _validation_message(exc)) from None

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            s = self._session(request)
            req = await self._body(request, ChatRequest)
            return web.json_response(await s.complete(req))
        except SessionError as e:
            return _error(e.status, e.code, e.message)

    async def _reward(self, request: web.Request) -> web.Response:
        try:
            s = self._session(request)
            s.post_reward(await self._body(request, RewardRequest))
            return web.json_response({"ok": True})
        except SessionError as e:
            return _error(e.status, e.code, e.message)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            s = self._session(request)
        except SessionError as e:
            return _error(e.status, e.code, e.message)
        return web.json_response({"object": "list", "data": [
            {"id": s.model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}]})


def task_json(task: Any, messages: list[dict[str, str]], max_turns: int, max_tokens: int) -> str:
    """``ASYNCRL_TASK`` of a harness: the task's metadata, the prompt messages and the call limits (JSON)."""
    return json.dumps({"metadata": task.metadata, "messages": messages, "sample_id": task.sample_id,
                       "seed": task.seed, "max_turns": max_turns, "max_tokens_per_turn": max_tokens},
                      default=str)

