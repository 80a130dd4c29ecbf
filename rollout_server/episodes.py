"""Running multi-turn episodes in the rollout worker: replay the record, then continue live.

One claimed work item of a run with ``agent.workflow`` set is one **episode** (docs/agents.md).
:class:`EpisodeRunner` runs the user's workflow against an
:class:`asyncrl.agents.model.EpisodeModel` whose live calls (:class:`_LiveCalls`) stream
into the buffer exactly as a single-turn sample does (chunks of ``buffer.flush_tokens`` with
behaviour logprobs and per-token versions), plus two episode-only writes:

* the end of a model call is an append with finish ``turn`` (the segment closes, the sample stays
  RUNNING under its lease);
* an observation is an append with finish ``obs`` (its own segment; logprob 0; not counted in
  the budget or in staleness).

Interruptions park the episode like any sample: the per-version budget ``max_budget`` runs out
(``budget``), a weight update aborts the stream, the worker drains (``abort``), or the server
dies (its lease expires). The next claim, on any server, replays: :class:`RecordedHistory` is
rebuilt from the sample's segments and the workflow is run again from the start with
calls answered from it. No recorded model token is regenerated: an interrupted call continues
from its recorded tokens. A workflow whose replay differs from the record restarts the episode
(``restarted_samples:nondeterministic``). When the workflow returns, the episode ends
(``stop``: COMPLETE) and is scored with the workflow's reward, its precomputed advantages (if
every step set one) and its info (termination, turns, tool calls, replayed calls). A COMPLETE
episode whose worker died before scoring it is scored by replaying it entirely (no live call).
Tool calls are not recorded in the buffer: a replay on the worker that made them answers them from
its in-memory memo (:attr:`EpisodeModel.tool_memo`, the last :data:`TOOL_MEMO_EPISODES` episodes);
a replay elsewhere runs them again (tools must be deterministic and idempotent).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import logging
import time
from typing import Any

from asyncrl.agents.chat import ChatFormat
from asyncrl.agents.loader import LoadedWorkflow
from asyncrl.agents.model import EpisodeModel
from asyncrl.agents.workflow import (
    Episode,
    EpisodeInterrupt,
    EpisodeTask,
    EpisodeTimeout,
    NonDeterministicWorkflow,
    RecordedHistory,
    TokenLimit,
)
from asyncrl.core.types import SampleStatus, WorkItem, WorkKind
from buffers.budget import VersionBudget
from buffers.errors import VersionAhead
from rollout_server.client import EngineError, EngineUnavailable
from rollout_server.worker_options import WorkerError

__all__ = ["EpisodeRunner", "episode_seed"]

log = logging.getLogger(__name__)


def episode_seed(run_seed: int, sample_id: str) -> int:
    """A seed fixed per (run seed, sample id): the same on every replay of the episode (63 bits)."""
    h = hashlib.sha256(f"{run_seed}:{sample_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


class _Parked(EpisodeInterrupt):
    """The episode was parked (budget, abort, drain); ``status`` is the sample's new status."""

    def __init__(self, status: SampleStatus | None, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


#: Episodes whose tool results a worker keeps for their replays (least recently used dropped first).
TOOL_MEMO_EPISODES = 4096

#: Scoring requests (OPSD's prompt logprobs) aborted by a weight update are sent again up to this many times.
SCORE_ABORT_RETRIES = 8


class _Abandon(EpisodeInterrupt):
    """A buffer or engine error that ends this worker's hold on the item; ``cause`` is re-raised."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _LiveCalls:
    """Live model calls and observations of one claimed episode (see the module docstring)."""

    def __init__(self, worker: Any, item: WorkItem) -> None:
        self.w = worker
        self.item = item
        self.length = item.length_tokens
        self.last_output: tuple[list[int], list[float], list[int]] | None = None
        # the per-version budget, counted as the buffer counts it (buffers/budget.py)
        self.budget = VersionBudget.from_claim(item)
        self.live_calls = 0
        #: True once a call's end made the sample COMPLETE (it reached max_response_len)
        self.completed = False
        self._traj = 0  # the trajectory being written (tags every append, docs/agents.md)
        # tokens of the current call already flushed to the buffer (returned with the call's output)
        self._stream_ids: list[int] = []
        self._stream_lps: list[float] = []
        self._stream_vers: list[int] = []

    async def _park(self, reason: str, why: str, ids=(), lps=(), vers=()) -> None:
        try:
            status = await self.w.buffer.end_segment(self.item, reason, ids, lps, vers, trajectory=self._traj)
        except VersionAhead:
            await self.w.buffer.end_segment(self.item, "abort")
            self.w._resync = True
            status = None
        except Exception as exc:  # LeaseLost, UnknownItem, Redis down: the item is not ours any more
            raise _Abandon(exc) from exc
        self.w._count_tokens(len(ids))
        if reason == "budget":
            self.w.stats.parked_budget += 1
        else:
            self.w.stats.parked_abort += 1
        self.w._note_parked("budget" if reason == "budget" else ("shutdown" if self.w._draining else "weight_update"))
        raise _Parked(status, why)

    async def generate(self, context_ids: list[int], max_new_tokens: int,
                       trajectory: int = 0) -> tuple[list[int], list[float], list[int], str]:
        w, item = self.w, self.item
        self._traj = int(trajectory)
        if w._draining:
            await self._park("abort", "drain")
        room = w.settings.max_response_len - self.length
        if room <= 0:
            raise TokenLimit(f"sample {item.sample_id}: {self.length} tokens = max_response_len")
        budget = self.budget.left(w.settings.max_budget)
        if budget <= 0:
            await self._park("budget", "budget")
        n = min(int(max_new_tokens), room, budget)
        binding = "call" if n == max_new_tokens else ("room" if n == room else "budget")
        self._stream_ids, self._stream_lps, self._stream_vers = [], [], []
        params = dict(w.sampling_params(item))
        params["max_new_tokens"] = int(n)
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        flush = w.settings.flush_tokens
        engine_finish = None
        rid = w._next_rid(item)
        t0 = time.monotonic()
        self.live_calls += 1
        try:
            lora, tag = w._adapter_request()  # by_name: the adapter of the worker's version (worker_weights.py)
            stream = w.client.generate_stream(context_ids, params, rid=rid, return_logprob=True, **lora)
            async with contextlib.aclosing(stream):
                async for d in stream:
                    vers += w._token_versions(d, tag)
                    ids += d.token_ids
                    lps += d.logprobs
                    if d.finish_reason is not None:
                        engine_finish = d.finish_reason.get("type")
                        break
                    if len(ids) >= flush:
                        await w.buffer.append(item, ids, lps, vers, trajectory=self._traj)
                        self._done(ids, lps, vers)
                        ids, lps, vers = [], [], []
        except VersionAhead:
            w.stats.version_ahead += 1
            await self._park("abort", "version_ahead")
        except EngineUnavailable as exc:
            log.warning("engine stream broke in episode %s: %s", item.sample_id, exc)
            w._engine_lost = True
            await self._park("abort", "engine_lost", ids, lps, vers)
        except EngineError as exc:
            w.stats.engine_errors += 1
            if exc.status >= 500:
                await self._park("abort", f"engine error {exc.status}", ids, lps, vers)
            with contextlib.suppress(Exception):
                await w.buffer.end_segment(item, "abort", ids, lps, vers)
            raise _Abandon(WorkerError(f"the engine at {w.client.url} rejected a call of episode {item.sample_id} "
                                       f"({len(context_ids)} context tokens): {exc.message}")) from exc
        except EpisodeInterrupt:
            raise
        except Exception as exc:  # LeaseLost, UnknownItem, Redis errors
            raise _Abandon(exc) from exc
        all_ids = self._stream_ids + ids
        all_lps = self._stream_lps + lps
        all_vers = self._stream_vers + vers
        self._stream_ids, self._stream_lps, self._stream_vers = [], [], []
        w._record_request(engine_finish or "abort", time.monotonic() - t0, len(all_ids), len(context_ids))
        if engine_finish not in ("stop", "length"):
            await self._park("abort", "aborted", ids, lps, vers)
        if engine_finish == "length" and binding == "budget":
            await self._park("budget", "budget", ids, lps, vers)
        try:
            status = await w.buffer.end_segment(item, "turn", ids, lps, vers, trajectory=self._traj)
        except VersionAhead:
            w.stats.version_ahead += 1
            await self._park("abort", "version_ahead")
        except Exception as exc:
            raise _Abandon(exc) from exc
        self.length = item.length_tokens
        self.budget.count(vers)
        w._count_tokens(len(ids))
        w.stats.segments += 1
        if status == SampleStatus.COMPLETE:  # the conversation reached max_response_len in this call
            self.completed = True
            self.last_output = (all_ids, all_lps, all_vers)
            raise TokenLimit(f"sample {item.sample_id}: reached max_response_len in call {self.live_calls}")
        return all_ids, all_lps, all_vers, ("length" if engine_finish == "length" else "stop")

    def _done(self, ids: list[int], lps: list[float], vers: list[int]) -> None:
        self._stream_ids = self._stream_ids + ids
        self._stream_lps = self._stream_lps + lps
        self._stream_vers = self._stream_vers + vers
        self.budget.count(vers)
        self.w._count_tokens(len(ids))

    async def observe(self, ids: list[int], version: int, trajectory: int = 0, kind: str = "obs") -> None:
        w, item = self.w, self.item
        self._traj = int(trajectory)
        if w._draining:
            await self._park("abort", "drain")
        if self.length + len(ids) > w.settings.max_response_len:
            raise TokenLimit(f"sample {item.sample_id}: an observation of {len(ids)} tokens does not fit "
                             f"({self.length} of max_response_len {w.settings.max_response_len} used)")
        try:
            self.length = await w.buffer.append_observation(item, ids, max(0, int(version)), trajectory=self._traj,
                                                            kind=kind)
        except Exception as exc:
            raise _Abandon(exc) from exc


class EpisodeRunner:
    """Runs one claimed episode in a :class:`rollout_server.worker.RolloutWorker`.

    Args:
        worker: the rollout worker (buffer, engine client, tokenizer, sampling, metrics).
        workflow: the :class:`asyncrl.agents.loader.LoadedWorkflow` (run function, env factory).
        agent: the ``agent`` config section.
        seed: the run's seed (episode seeds derive from it and the sample id).
    """

    def __init__(self, worker: Any, workflow: LoadedWorkflow, agent: Any, seed: int = 0) -> None:
        self.w = worker
        self.workflow = workflow
        self.agent = agent
        self.seed = int(seed)
        self.chat = ChatFormat(worker.tokenizer)
        self.teacher = None
        #: tool results per episode on this worker (sample id -> EpisodeModel.tool_memo), the
        #: most recently used :data:`TOOL_MEMO_EPISODES` kept: a replay here does not run its tools again
        self.tool_memos: collections.OrderedDict[str, dict] = collections.OrderedDict()
        if getattr(agent, "opsd_teacher_url", None):
            from rollout_server.client import EngineClient

            self.teacher = EngineClient(agent.opsd_teacher_url, api_key=getattr(worker.client, "api_key", None))

    async def _token_logprobs(self, context_ids: list[int], target_ids: list[int], client: Any = None,
                              live: _LiveCalls | None = None) -> list[float]:
        """Logprobs of ``target_ids`` after ``context_ids`` from the engine's prompt logprobs (shape (T,)).

        ``/generate`` with ``max_new_tokens: 0``, ``return_logprob`` and ``logprob_start_len =
        len(context) - 1`` (SGLang pads the first returned position with None).

        A request aborted by a weight update's pause (``rollout.pause_mode: abort``) is sent again
        (up to :data:`SCORE_ABORT_RETRIES` times, backing off); one aborted by a drain, or too
        often, parks the episode (``live``): its calls are recorded, so the next claim replays
        them and scores again without generating a token.

        Raises:
            WorkerError: the engine refused or returned malformed logprobs (wrapped so the episode
                is abandoned, not failed).
        """
        client = client or self.w.client
        if not context_ids or not target_ids:
            raise ValueError("scoring needs a non-empty context and target")
        for attempt in range(SCORE_ABORT_RETRIES + 1):
            try:
                lora = self.w._adapter_request()[0] if client is self.w.client else {}  # the policy's adapter
                out = await client.generate(list(context_ids) + list(target_ids),
                                            {"max_new_tokens": 0, "temperature": float(self.w.opts.temperature)},
                                            rid=self.w._next_rid_name("score"), return_logprob=True,
                                            logprob_start_len=len(context_ids) - 1, **lora)
                finish = ((out.get("meta_info") or {}).get("finish_reason") or {}).get("type")
            except (EngineError, EngineUnavailable, AttributeError) as exc:
                raise _Abandon(WorkerError(f"scoring tokens on {client.url} failed: {exc}")) from exc
            if finish != "abort":
                break
            # a weight update's pause (rollout.pause_mode: abort) or a drain aborted the request
            # before its prefill: score again once the engine runs (the episode itself is complete)
            if self.w._draining or attempt == SCORE_ABORT_RETRIES:
                if live is not None:
                    await live._park("abort", "aborted")  # raises _Parked
                raise _Abandon(WorkerError(f"scoring tokens on {client.url} was aborted {attempt + 1} times"))
            await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
        try:
            vals = [float(r[0]) for r in out["meta_info"]["input_token_logprobs"][1:]]
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise _Abandon(WorkerError(f"scoring tokens on {client.url} failed: {exc}")) from exc
        if len(vals) != len(target_ids):
            raise _Abandon(WorkerError(f"the engine at {client.url} returned {len(vals)} prompt logprobs for "
                                       f"{len(target_ids)} tokens"))
        return vals

    async def run(self, item: WorkItem) -> SampleStatus | None:
        """Run (or replay, then continue) the episode of ``item``; returns the sample's status.

        Raises:
            LeaseLost / UnknownItem / Redis errors: the item is not this worker's any more.
            WorkerError: the engine rejected a call (the run is misconfigured).
        """
        w = self.w
        if item.kind == WorkKind.GENERATE and w.version is not None and item.lineage == w.lineage \
                and item.clock_version > w.version and w.opts.transport != "nccl":
            await w._catch_up()
        lps, vers, segs, finish = await w.buffer.episode_record(item.sample_id)
        if len(lps) != len(item.response_ids):
            raise WorkerError(f"episode {item.sample_id}: the record changed under the lease "
                              f"({len(lps)} logprobs for {len(item.response_ids)} tokens)")
        history = RecordedHistory.from_record(item.response_ids, lps, vers, segs)
        if history.events and w.metrics is not None:
            w.metrics.resumed()
        live = _LiveCalls(w, item) if item.kind == WorkKind.GENERATE else None
        task = EpisodeTask(dict(item.metadata), list(item.prompt_ids),
                           w.tokenizer.decode(item.prompt_ids, skip_special_tokens=False),
                           episode_seed(self.seed, item.sample_id), item.sample_id)
        model = EpisodeModel(task, w.tokenizer, self.chat, history, live,
                             max_tokens=self.agent.max_tokens_per_turn, max_turns=self.agent.max_turns,
                             tool_timeout=self.agent.tool_timeout_seconds,
                             episode_timeout=self.agent.episode_timeout_seconds,
                             ended_at_token_limit=(finish == "length"))
        model.tool_memo = self._tool_memo(item.sample_id, fresh=not history.events)
        model.scorer = functools.partial(self._token_logprobs, live=live)
        model.opsd_coef = self.agent.opsd_coef
        model.opsd_hint = getattr(self.agent, "opsd_hint", None)
        model.temperature = float(w.opts.temperature)
        if self.teacher is not None:
            model.teacher_scorer = functools.partial(self._token_logprobs, client=self.teacher, live=live)
        env = self.workflow.make_env(task) if self.workflow.make_env is not None else None
        error: str | None = None
        try:
            episode = await self.workflow.run(task, model, env)
            if not isinstance(episode, Episode):
                raise TypeError(f"the workflow returned {type(episode).__name__}, not asyncrl.agents.Episode")
        except _Parked as p:
            self._count_episode_metrics(None, model, parked=p.why)
            return p.status
        except _Abandon as a:
            raise a.cause from None
        except NonDeterministicWorkflow as exc:
            return await self._restart(item, model, exc)
        except TokenLimit:
            episode = Episode(0.0, "token_limit")
        except EpisodeTimeout:
            episode = Episode(0.0, "timeout")
        except EpisodeInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's workflow failed: a FAILED sample
            log.warning("workflow of episode %s raised: %r", item.sample_id, exc)
            error = f"WorkflowError: {type(exc).__name__}: {exc}"
            episode = Episode(0.0, "error")
        if not model.replay_exhausted:
            return await self._restart(item, model, NonDeterministicWorkflow(
                f"episode {item.sample_id}: the workflow returned with recorded events left"))
        # end the episode unless its last call already completed it at max_response_len; a token limit
        # met by an observation that did not fit (or at the start of a call) leaves it running
        if item.kind == WorkKind.GENERATE and live is not None and not live.completed:
            status = await w.buffer.end_segment(item, "stop", trajectory=0)
            if status != SampleStatus.COMPLETE:
                raise WorkerError(f"episode {item.sample_id}: ending it left status {status}")
        kind, advantages = "none", None
        if error is None:
            try:
                kind, advantages = model.token_advantages()
            except ValueError as exc:
                error = f"WorkflowError: {exc}"
        try:
            info = model.info(episode)
        except ValueError as exc:
            error = error or f"WorkflowError: {exc}"
            info = model.info(Episode(episode.reward, episode.termination, episode.metrics))
        self._count_episode_metrics(episode, model)
        self.tool_memos.pop(item.sample_id, None)  # ended: never replayed again
        if error is not None:
            await w.buffer.score(item, error=error, info=info)
            w.stats.reward_errors += 1
            if w.metrics is not None:
                w.metrics.scored(0.0, "error")
        else:
            await w.buffer.score(item, reward=float(episode.reward), advantages=advantages,
                                 info={**info, "advantages": kind})
            if w.metrics is not None:
                w.metrics.scored(float(episode.reward), "correct" if episode.reward > 0 else "incorrect")
        w.stats.scored += 1
        w.stats.completed += 1
        return SampleStatus.SCORED if error is None else SampleStatus.FAILED

    def _tool_memo(self, sample_id: str, fresh: bool) -> dict:
        """The episode's tool memo on this worker; a new one when the episode starts from its prompt."""
        memo = self.tool_memos.pop(sample_id, None)
        self.tool_memos[sample_id] = memo = {} if memo is None or fresh else memo
        while len(self.tool_memos) > TOOL_MEMO_EPISODES:
            self.tool_memos.popitem(last=False)
        return memo

    async def _restart(self, item: WorkItem, model: EpisodeModel, exc: BaseException) -> SampleStatus:
        log.warning("%s; restarting the episode from its prompt", exc)
        self.tool_memos.pop(item.sample_id, None)  # it starts again from its prompt
        await self.w.buffer.restart_episode(item)
        if self.w.metrics is not None:
            self.w.metrics.episode_restarted("nondeterministic")
        return SampleStatus.PENDING

    def _count_episode_metrics(self, episode: Episode | None, model: EpisodeModel, parked: str | None = None) -> None:
        m = self.w.metrics
        if m is None:
            return
        m.replayed_calls(model.replayed_calls)
        if episode is not None:
            m.episode_finished(episode.termination, model.turns, model.tool_calls)
