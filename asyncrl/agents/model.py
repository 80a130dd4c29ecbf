"""The workflow's handle to the policy: :class:`EpisodeModel` (docs/agents.md).

One handle per trajectory of an episode; the first is given to the workflow, further ones come
from :meth:`EpisodeModel.trajectory` (e.g. a judge next to a solver). All the trajectories of an
episode share one record in the buffer (segments tagged with the trajectory index), one replay
state and one lock: the calls of an episode are made one at a time, in the order the workflow
makes them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from asyncrl.agents.chat import ChatFormat, off_loop
from asyncrl.agents.workflow import (
    Episode,
    EpisodeTask,
    EpisodeTimeout,
    LiveCalls,
    ModelOutput,
    NonDeterministicWorkflow,
    RecordedHistory,
    Step,
    TokenLimit,
)

__all__ = ["EpisodeModel", "MAX_TRAJECTORIES", "Workflow"]

#: Trajectories per episode (the buffer tags segments with 4 bits).
MAX_TRAJECTORIES = 16


@dataclass
class _Shared:
    """What the trajectories of one episode share."""

    live: LiveCalls | None
    histories: dict[int, RecordedHistory]
    names: list[str] = field(default_factory=lambda: ["main"])
    handles: list["EpisodeModel"] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    length: int = 0  # the record's length so far (all trajectories)
    tool_calls: int = 0
    tool_failures: int = 0
    replayed_calls: int = 0
    #: tool results of this episode already obtained on this worker, by (trajectory, tool call index,
    #: tool, arguments): a replay answers them from here instead of running the tool again (None: off)
    tool_memo: dict | None = None
    memo_tool_calls: int = 0
    at_token_limit: bool = False
    t0: float = field(default_factory=time.monotonic)


class EpisodeModel:
    """A workflow's handle to the policy for one trajectory (see :mod:`asyncrl.agents.workflow`).

    Args:
        task: the :class:`EpisodeTask` (its prompt ids open the main trajectory's context).
        tokenizer: decodes outputs; :class:`ChatFormat` tokenises observations.
        history: the recorded events to replay first (empty for a new episode; all trajectories).
        live: runs calls live once the history is exhausted; None in a pure replay (scoring a
            complete episode): a call past the record then raises :class:`NonDeterministicWorkflow`,
            or :class:`TokenLimit` when the record ended at the token limit.
        max_tokens: default ``max_tokens`` of a call (``agent.max_tokens_per_turn``).
        max_turns: model calls allowed per trajectory (``agent.max_turns``); ``turns_left`` tells
            the workflow how many remain, and one more call raises RuntimeError.
        tool_timeout: seconds a :meth:`tool` call may take.
        episode_timeout: seconds of live time before the next call raises :class:`EpisodeTimeout`.
        ended_at_token_limit: the record ended at the token limit (for a pure replay).
    """

    def __init__(self, task: EpisodeTask, tokenizer: Any, chat: ChatFormat, history: RecordedHistory,
                 live: LiveCalls | None, *, max_tokens: int, max_turns: int, tool_timeout: float = 10.0,
                 episode_timeout: float = 600.0, ended_at_token_limit: bool = False,
                 _shared: _Shared | None = None, _index: int = 0, _prompt_ids: Sequence[int] | None = None) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_tokens = int(max_tokens)
        self.max_turns = int(max_turns)
        self.tool_timeout = float(tool_timeout)
        self.episode_timeout = float(episode_timeout)
        self.ended_at_token_limit = ended_at_token_limit
        if _shared is None:
            _shared = _Shared(live, history.by_trajectory())
        self._shared = _shared
        self.index = _index
        self.name = _shared.names[_index]
        self.prompt_ids = list(task.prompt_ids if _prompt_ids is None else _prompt_ids)
        self.history = _shared.histories.get(_index) or RecordedHistory([])
        _shared.handles.append(self)
        self.steps: list[Step] = []
        self.response_ids: list[int] = []
        #: ``await scorer(context_ids, target_ids) -> logprobs of target_ids`` from the engine's prompt
        #: logprobs (set by the rollout worker; used by :func:`asyncrl.agents.opsd.opsd`); None in ``asyncrl eval``
        self.scorer: Callable[[list[int], list[int]], Awaitable[list[float]]] | None = None
        #: the same for the OPSD teacher when it is another model (``agent.opsd_teacher_url``); None: ``scorer``
        self.teacher_scorer: Callable[[list[int], list[int]], Awaitable[list[float]]] | None = None
        #: OPSD's log-ratio weight from the config (``agent.opsd_coef``); None: the decorator's own
        self.opsd_coef: float | None = None
        #: where OPSD puts the privileged context (``agent.opsd_hint``: system | user); None: the decorator's own
        self.opsd_hint: str | None = None
        #: the sampling temperature of live calls (set by the rollout worker and ``asyncrl eval``; None: unknown)
        first = _shared.handles[0]
        self.temperature: float | None = first.temperature if first is not self else None

    # ------------------------------------------------------------------ shared state
    @property
    def live(self) -> LiveCalls | None:
        return self._shared.live

    @property
    def tool_calls(self) -> int:
        """Tool calls of the episode (all trajectories)."""
        return self._shared.tool_calls

    @property
    def tool_failures(self) -> int:
        return self._shared.tool_failures

    @property
    def replayed_calls(self) -> int:
        """Model calls answered from the record (all trajectories)."""
        return self._shared.replayed_calls

    @property
    def at_token_limit(self) -> bool:
        return self._shared.at_token_limit

    @at_token_limit.setter
    def at_token_limit(self, value: bool) -> None:
        self._shared.at_token_limit = value

    @property
    def trajectories(self) -> list["EpisodeModel"]:
        """Every trajectory handle of the episode, the main one first."""
        return list(self._shared.handles)

    @property
    def all_steps(self) -> list[Step]:
        """The model calls of every trajectory."""
        return [st for h in self._shared.handles for st in h.steps]

    @property
    def replay_exhausted(self) -> bool:
        """True when every trajectory consumed its recorded events."""
        return all(h.exhausted for h in self._shared.histories.values())

    @property
    def record_length(self) -> int:
        """Tokens in the episode's record so far (all trajectories)."""
        return self._shared.length

    # ------------------------------------------------------------------ reading
    @property
    def context_ids(self) -> list[int]:
        """(P + R,) this trajectory's prompt followed by its output and observation ids so far."""
        return self.prompt_ids + self.response_ids

    @property
    def turns(self) -> int:
        """Model calls of this trajectory so far (replayed ones included)."""
        return len(self.steps)

    @property
    def turns_left(self) -> int:
        """Model calls left under ``agent.max_turns`` on this trajectory."""
        return max(0, self.max_turns - len(self.steps))

    @property
    def last_version(self) -> int:
        """Policy version of the episode's last model token (0 before the first call)."""
        best = (-1, 0)
        for st in self.all_steps:
            if st.output.versions:
                best = max(best, (st.offset + len(st.output.token_ids), st.output.versions[-1]))
        return best[1]

    # ------------------------------------------------------------------ trajectories
    async def trajectory(self, name: str, messages: list[dict] | None = None,
                         prompt_ids: Sequence[int] | None = None) -> "EpisodeModel":
        """Open a further trajectory of the episode with its own prompt (e.g. a judge).

        Exactly one of ``messages`` (rendered with the chat template and the generation prompt,
        tokenised once) or ``prompt_ids``. Its calls are recorded and replayed like the main
        trajectory's; it is trained as its own sample, grouped with the same trajectory of the
        other episodes of the prompt group, with ``Episode.trajectory_rewards[name]`` (default
        the episode's reward).

        Raises:
            ValueError: a name used twice, more than 16 trajectories, or not exactly one prompt.
            NonDeterministicWorkflow: the record opened another trajectory here.
            TokenLimit: its prompt does not fit under ``max_response_len``.
        """
        sh = self._shared
        if name in sh.names:
            raise ValueError(f"trajectory {name!r} already exists in this episode")
        if len(sh.names) >= MAX_TRAJECTORIES:
            raise ValueError(f"an episode has at most {MAX_TRAJECTORIES} trajectories")
        if (messages is None) == (prompt_ids is None):
            raise ValueError("give exactly one of messages= or prompt_ids=")
        if messages is not None:  # contents as text, never control tokens; off the event loop
            ids = await off_loop(self.chat.render_ids, [(m["role"], m["content"]) for m in messages])
        else:
            ids = [int(x) for x in prompt_ids]  # type: ignore[union-attr]
        if not ids:
            raise ValueError("a trajectory's prompt needs at least one token")
        index = len(sh.names)
        async with sh.lock:
            hist = sh.histories.get(index)
            ev = hist.peek() if hist is not None else None
            if ev is not None:
                if ev.kind != "ctx" or ev.token_ids != ids:
                    raise NonDeterministicWorkflow(
                        f"trajectory {index} ({name!r}) of sample {self.task.sample_id}: the record opens it with "
                        f"other prompt ids")
                hist.take()
                sh.length = max(sh.length, ev.start + len(ids))
            else:
                self._live_or_fail(f"trajectory {name!r}")
                self._check_live_time()
                try:
                    await sh.live.observe(ids, self.last_version, index, "ctx")  # type: ignore[union-attr]
                except TokenLimit:
                    sh.at_token_limit = True
                    raise
                sh.length = sh.live.length  # type: ignore[union-attr]
            sh.names.append(name)
        return EpisodeModel(self.task, self.tokenizer, self.chat, RecordedHistory([]), sh.live,
                            max_tokens=self.max_tokens, max_turns=self.max_turns, tool_timeout=self.tool_timeout,
                            episode_timeout=self.episode_timeout, ended_at_token_limit=self.ended_at_token_limit,
                            _shared=sh, _index=index, _prompt_ids=ids)

    # ------------------------------------------------------------------ calls
    def _check_live_time(self) -> None:
        if time.monotonic() - self._shared.t0 > self.episode_timeout:
            raise EpisodeTimeout(f"episode of sample {self.task.sample_id} ran past {self.episode_timeout:.0f} s")

    def _live_or_fail(self, what: str) -> None:
        if self._shared.live is None:
            if self.ended_at_token_limit:
                self._shared.at_token_limit = True
                raise TokenLimit(f"sample {self.task.sample_id}: the recorded episode ended at the token limit")
            raise NonDeterministicWorkflow(f"{what} of sample {self.task.sample_id}: not in the complete record")

    async def generate(self, max_tokens: int | None = None) -> ModelOutput:
        """Continue this trajectory with one model call.

        Args:
            max_tokens: this call's output limit (default ``agent.max_tokens_per_turn``).

        Returns:
            the call's :class:`ModelOutput` (also appended to ``steps``).

        Raises:
            TokenLimit: the record is at ``max_response_len`` (or reached it in this call: the
                output is still recorded in ``steps`` before the next call raises).
            RuntimeError: more than ``agent.max_turns`` calls on this trajectory.
            EpisodeTimeout: past ``agent.episode_timeout_seconds``.
            NonDeterministicWorkflow: the record holds something else here.
        """
        limit = int(max_tokens or self.max_tokens)
        if limit < 1:
            raise ValueError(f"max_tokens must be >= 1, got {limit}")
        sh = self._shared
        async with sh.lock:
            if sh.at_token_limit:
                raise TokenLimit(f"sample {self.task.sample_id}: the conversation is at the token limit")
            if len(self.steps) >= self.max_turns:
                raise RuntimeError(f"the workflow made more than agent.max_turns={self.max_turns} model calls on "
                                   f"trajectory {self.name!r}; check model.turns_left before calling")
            start = len(self.response_ids)
            ev = self.history.peek()
            ids: list[int] = []
            lps: list[float] = []
            vers: list[int] = []
            replayed = False
            finish = "stop"
            offset = sh.length
            if ev is not None:
                if ev.kind != "model":
                    raise NonDeterministicWorkflow(
                        f"call {len(self.steps)} of trajectory {self.name!r} of sample {self.task.sample_id}: the "
                        "record holds an observation here, the workflow asked the model")
                self.history.take()
                ids, lps, vers = list(ev.token_ids), list(ev.logprobs), list(ev.versions)
                offset = ev.start
                sh.length = max(sh.length, ev.start + len(ids))
                if len(ids) > limit:
                    raise NonDeterministicWorkflow(
                        f"call {len(self.steps)} of sample {self.task.sample_id}: recorded {len(ids)} tokens, more "
                        f"than this call's max_tokens {limit}")
                if ev.complete:
                    replayed = True
                    finish = "length" if (len(ids) >= limit and not self._ends_turn(ids)) else "stop"
                    sh.replayed_calls += 1
            if not replayed:
                if sh.live is None:
                    if self.ended_at_token_limit and ev is None:
                        sh.at_token_limit = True
                        raise TokenLimit(f"sample {self.task.sample_id}: the recorded episode ended at the token limit")
                    raise NonDeterministicWorkflow(
                        f"call {len(self.steps)} of sample {self.task.sample_id}: the complete record has no such call")
                self._check_live_time()
                context = self.context_ids + ids
                try:
                    nids, nlps, nvers, finish = await sh.live.generate(context, limit - len(ids), self.index)
                except TokenLimit:
                    out = getattr(sh.live, "last_output", None)
                    if out is not None:
                        ids, lps, vers = ids + out[0], lps + out[1], vers + out[2]
                        self._record(start, offset, ids, lps, vers, "length", False)
                    sh.length = sh.live.length
                    sh.at_token_limit = True
                    raise
                ids, lps, vers = ids + nids, lps + nlps, vers + nvers
                sh.length = sh.live.length
            return self._record(start, offset, ids, lps, vers, finish, replayed)

    def _ends_turn(self, ids: Sequence[int]) -> bool:
        return bool(ids) and int(ids[-1]) in self.chat.end_of_turn_ids

    def _record(self, start: int, offset: int, ids: list[int], lps: list[float], vers: list[int], finish: str,
                replayed: bool) -> ModelOutput:
        out = ModelOutput(self.tokenizer.decode(ids, skip_special_tokens=True), ids, lps, vers, finish, replayed)
        self.steps.append(Step(len(self.steps), start, out, offset=offset))
        self.response_ids += ids
        return out

    async def observe(self, content: str, role: str = "user", prefill: str = "") -> list[int]:
        """Add an environment message to this trajectory (tokenised once with the template's delimiters).

        Args:
            content: the message text.
            role: its chat role (``user``, ``tool``, ...).
            prefill: text opening the next assistant turn (not trained).

        Returns:
            the observation's token ids.

        Raises:
            TokenLimit: the observation does not fit under ``max_response_len`` (not appended).
            NonDeterministicWorkflow: the record holds other ids (or a model call) here.
            ChatFormatError: the message is over :data:`~asyncrl.agents.chat.MAX_OBSERVATION_CHARS`
                characters, or holds text the tokenizer cannot encode without a control token.

        ``content`` and ``prefill`` are encoded as text: a forged ``<|im_end|>`` in them never
        becomes a control token (only the template's delimiters are). Tokenised off the event loop.
        """
        last = self.steps[-1].output.token_ids if self.steps else ()
        ids = await off_loop(self.chat.observation_ids, content, role, prefill, after_ids=last)
        await self.observe_ids(ids)
        return ids

    async def observe_ids(self, ids: Sequence[int]) -> None:
        """Add environment tokens given as ids (the workflow tokenised them itself).

        Raises: as :meth:`observe`; ValueError for an empty observation.
        """
        ids = [int(x) for x in ids]
        if not ids:
            raise ValueError("an observation needs at least one token")
        sh = self._shared
        async with sh.lock:
            if sh.at_token_limit:
                raise TokenLimit(f"sample {self.task.sample_id}: the conversation is at the token limit")
            ev = self.history.peek()
            if ev is not None:
                if ev.kind != "obs" or ev.token_ids != ids:
                    what = "a model call" if ev.kind != "obs" else f"other observation ids ({len(ev.token_ids)} tokens)"
                    raise NonDeterministicWorkflow(
                        f"observation after call {len(self.steps) - 1} of trajectory {self.name!r} of sample "
                        f"{self.task.sample_id}: the record holds {what}, the workflow produced {len(ids)} tokens")
                self.history.take()
                sh.length = max(sh.length, ev.start + len(ids))
            else:
                self._live_or_fail(f"observation after call {len(self.steps) - 1}")
                self._check_live_time()
                try:
                    await sh.live.observe(ids, self.last_version, self.index)  # type: ignore[union-attr]
                except TokenLimit:
                    sh.at_token_limit = True
                    raise
                sh.length = sh.live.length  # type: ignore[union-attr]
            if self.steps:
                self.steps[-1].observation_ids += ids
            self.response_ids += ids

    async def tool(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> tuple[bool, str]:
        """Run a tool with a timeout; count it.

        Args:
            fn: a plain function (run in a worker thread) or an ``async def`` (awaited on the
                event loop, e.g. :meth:`asyncrl.env_server.EnvServerClient.calculate`: a remote
                call waits without holding a thread).
            args: its arguments.
            timeout: seconds (default ``agent.tool_timeout_seconds``).

        Returns:
            ``(ok, text)``: the tool's result as text, or ``(False, "error: ...")`` when it raised
            or ran past ``timeout``; a :class:`~asyncrl.env_server.errors.ToolCallError` gives its
            own ``observation`` (e.g. the environment server's deadline). A failing tool is an
            observation for the model, never a crash of the episode. A call this worker already
            made for the episode is answered from :attr:`tool_memo` (when set) without running.

        Raises:
            EnvServerUnavailable: the environment server stayed unreachable past its outage
                budget (an infrastructure failure is not shown to the model: the workflow fails).
        """
        sh = self._shared
        key = None
        if sh.tool_memo is not None:
            key = (self.index, sh.tool_calls, getattr(fn, "__qualname__", type(fn).__name__), repr(args)[:1024])
        sh.tool_calls += 1
        if key is not None and key in sh.tool_memo:  # a replay of a call this worker already made
            sh.memo_tool_calls += 1
            ok, text = sh.tool_memo[key]
            sh.tool_failures += not ok
            return ok, text
        ok, text = await self._run_tool(fn, args, timeout)
        sh.tool_failures += not ok
        if key is not None:
            sh.tool_memo[key] = (ok, text)
        return ok, text

    async def _run_tool(self, fn: Callable[..., Any], args: tuple, timeout: float | None) -> tuple[bool, str]:
        from asyncrl.env_server.errors import EnvServerUnavailable, ToolCallError

        loop = asyncio.get_running_loop()
        limit = float(timeout if timeout is not None else self.tool_timeout)
        try:
            if asyncio.iscoroutinefunction(fn):
                result = await asyncio.wait_for(fn(*args), limit)
            else:
                result = await asyncio.wait_for(loop.run_in_executor(None, lambda: fn(*args)), limit)
            return True, str(result)
        except asyncio.TimeoutError:
            return False, f"error: the tool took longer than {limit:g} s"
        except ToolCallError as exc:
            return False, exc.observation
        except EnvServerUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - a tool failure is an observation
            return False, f"error: {type(exc).__name__}: {exc}"

    @property
    def tool_memo(self) -> dict | None:
        """The episode's tool results on this worker (set by the rollout worker; None: every call runs).

        With a memo, a tool call the episode already made here (same trajectory, same position
        among the episode's tool calls, same tool and arguments) is answered from it: a replay
        after a budget park or a weight update does not run the tool again, as durable execution
        (Temporal) does not re-run a recorded activity. A replay on another worker runs it again.
        """
        return self._shared.tool_memo

    @tool_memo.setter
    def tool_memo(self, memo: dict | None) -> None:
        self._shared.tool_memo = memo

    @property
    def memo_tool_calls(self) -> int:
        """Tool calls of the episode answered from the memo (all trajectories)."""
        return self._shared.memo_tool_calls

    @property
    def replaying(self) -> bool:
        """True while this trajectory still has recorded events to replay (its calls are answered from the record)."""
        return not self.history.exhausted

    # ------------------------------------------------------------------ results
    def info(self, episode: Episode) -> dict[str, Any]:
        """The JSON info the buffer keeps with the episode (termination, counts, trajectories)."""
        sh = self._shared
        unknown = sorted(set(episode.trajectory_rewards) - set(sh.names))
        if unknown:
            raise ValueError(f"Episode.trajectory_rewards names trajectories that were not opened: {unknown}")
        out: dict[str, Any] = {"termination": episode.termination, "turns": len(self.all_steps),
                               "tool_calls": sh.tool_calls, "tool_failures": sh.tool_failures,
                               "replayed_calls": sh.replayed_calls, "memo_tool_calls": sh.memo_tool_calls,
                               **{f"m_{k}": float(v) for k, v in sorted(episode.metrics.items())[:16]}}
        if len(sh.names) > 1:
            out["trajectories"] = list(sh.names)
            out["trajectory_rewards"] = [float(episode.trajectory_rewards.get(n, episode.reward)) for n in sh.names]
        return out

    def token_advantages(self) -> tuple[str, list[float] | None]:
        """Per-record-token advantages from the steps' ``advantages`` (observations and prompts get 0).

        Returns:
            ``("none", None)`` when no step sets any, ``("some", None)`` when only some do (the
            group then falls back to the estimator, with a warning in the trainer), else
            ``("all", values)`` with one value per token of the record (all trajectories).

        Raises:
            ValueError: a step's per-token list whose length differs from its output (names the step).
        """
        steps = self.all_steps
        set_ = [st.advantages is not None for st in steps]
        if not any(set_):
            return "none", None
        if not all(set_):
            return "some", None
        out = [0.0] * self._shared.length
        for st in steps:
            n = len(st.output.token_ids)
            a = st.advantages
            if isinstance(a, (int, float)):
                vals = [float(a)] * n
            else:
                vals = [float(x) for x in a]  # type: ignore[union-attr]
                if len(vals) != n:
                    raise ValueError(f"step {st.index} of sample {self.task.sample_id}: {len(vals)} advantages for "
                                     f"{n} output tokens (give one number, or one per output token)")
            out[st.offset:st.offset + n] = vals
        return "all", out


#: A workflow: ``async (task, model, env) -> Episode`` (docs/agents.md). Declared here, beside the
#: handle it receives, so :mod:`asyncrl.agents.workflow` (the types) never imports this module.
Workflow = Callable[[EpisodeTask, EpisodeModel, Any], Awaitable[Episode]]
