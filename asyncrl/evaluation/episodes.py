"""Held-out evaluation of a workflow's episodes (``asyncrl eval`` with ``agent.workflow`` set).

Each held-out problem runs one episode of the configured workflow against the rollout engine's
continuous-batching :class:`rollout_server.engine.Engine` in this process (no buffer: calls are
live, never recorded), with the same chat template, prefill, observation tokenisation, token
limit (``rollout.max_response_len`` for the whole conversation) and turn limit as training.
Sampled calls use one seeded generator per (problem, call), so results do not depend on which
episodes share an engine step.

Reported per temperature (an :class:`asyncrl.evaluation.evaluate.EvalResult`, so ``asyncrl train``'s
periodic evaluation reads it unchanged): ``accuracy`` is the success rate — the share of
episodes whose workflow reports ``metrics["correct"] == 1`` (the built-ins do), else reward > 0
— with its 95% Wilson interval; ``format_compliance`` is the share that ended with the
environment's verdict (termination ``env_done``); ``episodes`` adds mean turns, tool calls and
reward, first-call accuracy (when the workflow reports ``turn_correct``) and the termination
counts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

from asyncrl.agents.chat import ChatFormat
from asyncrl.agents.loader import load_workflow
from asyncrl.agents.model import EpisodeModel
from asyncrl.agents.workflow import Episode, EpisodeTask, EpisodeTimeout, RecordedHistory, TokenLimit

__all__ = ["evaluate_episodes"]


class _EngineBridge:
    """Async calls into the in-process engine thread."""

    def __init__(self, engine_factory: Any) -> None:
        self.loop = asyncio.get_running_loop()
        self.futures: dict[str, tuple[asyncio.Future, Any]] = {}
        self.lock = threading.Lock()
        self.engine = engine_factory(self._on_update)

    def _on_update(self, samples: list[Any]) -> None:
        for s in samples:
            if s.published[1] is None:
                continue
            with self.lock:
                entry = self.futures.pop(s.rid, None)
            if entry is not None:
                fut, _ = entry
                self.loop.call_soon_threadsafe(lambda f=fut, x=s: f.done() or f.set_result(x))

    async def generate(self, rid: str, context: list[int], params: Any) -> Any:
        from rollout_server.engine_sample import EngineGroup, EngineSample

        sample = EngineSample(rid=rid, prompt_ids=list(context), params=params)
        fut = self.loop.create_future()
        with self.lock:
            self.futures[rid] = (fut, sample)
        self.engine.submit([EngineGroup(list(context), [sample])])
        while True:
            done, _ = await asyncio.wait({fut}, timeout=1.0)
            if done:
                return fut.result()
            if not self.engine.alive:
                raise RuntimeError(f"the engine thread stopped ({self.engine.error!r})")


class _EvalCalls:
    """:class:`asyncrl.agents.workflow.LiveCalls` of one evaluation episode (nothing recorded)."""

    def __init__(self, bridge: _EngineBridge, index: int, max_len: int, temperature: float, stop_ids: list[int],
                 seed: int) -> None:
        self.bridge, self.index, self.max_len = bridge, index, max_len
        self.temperature, self.stop_ids, self.seed = temperature, stop_ids, seed
        self.length = 0
        self.calls = 0
        self.last_output = None
        self.generated = 0

    async def generate(self, context_ids: list[int], max_new_tokens: int, trajectory: int = 0):
        from rollout_server.sampling import SamplingParams

        room = self.max_len - self.length
        if room <= 0:
            raise TokenLimit("evaluation episode at the token limit")
        n = min(int(max_new_tokens), room)
        seed = None
        if self.temperature > 0:
            seed = (self.seed * 1_000_003 + self.index) * 1009 + self.calls
        self.calls += 1
        params = SamplingParams(max_new_tokens=n, temperature=float(self.temperature), top_p=1.0, top_k=-1,
                                stop_token_ids=list(self.stop_ids), sampling_seed=seed)
        s = await self.bridge.generate(f"ep-{self.index}-{self.calls}", context_ids, params)
        reason = (s.finish_reason or {}).get("type")
        if reason not in ("stop", "length"):
            raise RuntimeError(f"generation failed in episode {self.index}: {s.finish_reason}")
        ids = list(s.output_ids)
        lps = [float(x) for x in (getattr(s, "output_logprobs", None) or [0.0] * len(ids))][:len(ids)]
        lps += [0.0] * (len(ids) - len(lps))
        self.length += len(ids)
        self.generated += len(ids)
        if reason == "length" and n == room and n < max_new_tokens:
            self.last_output = (ids, lps, [0] * len(ids))
            raise TokenLimit("evaluation episode reached the token limit")
        return ids, lps, [0] * len(ids), reason

    async def observe(self, ids: list[int], version: int, trajectory: int = 0, kind: str = "obs") -> None:
        if self.length + len(ids) > self.max_len:
            raise TokenLimit("an observation does not fit under the token limit")
        self.length += len(ids)


def evaluate_episodes(model: Any, tokenizer: Any, problems: list[Any], cfg: Any, *, temperature: float, seed: int,
                      batch_size: int, model_name: str) -> Any:
    """Run one episode per problem and summarise (see the module docstring).

    Args:
        model: the causal LM (fp32, eval mode).
        tokenizer: its tokenizer (with a chat template).
        problems: :class:`asyncrl.tasks.base.Problem` list (held-out).
        cfg: the :class:`asyncrl.core.config.AsyncRLConfig` (``agent``, ``data``, ``rollout``).
        temperature: 0 for greedy.
        seed: base of the per-(problem, call) sampling seeds and of the episode seeds.
        batch_size: episodes in flight (rows the engine decodes together).
        model_name: recorded in the result.

    Returns:
        an :class:`asyncrl.evaluation.evaluate.EvalResult` with ``episodes`` filled.

    Raises:
        asyncrl.agents.WorkflowError: the workflow cannot be loaded.
        asyncrl.evaluation.evaluate.EvalError: the engine failed.
    """
    return asyncio.run(_evaluate(model, tokenizer, problems, cfg, temperature, seed, batch_size, model_name))


async def _evaluate(model, tokenizer, problems, cfg, temperature, seed, batch_size, model_name):
    from asyncrl.evaluation.evaluate import EvalError, EvalResult, _stop_token_ids, wilson_interval
    from asyncrl.tasks.tasks import render_prompt, render_response_prefix
    from rollout_server.engine import Engine

    agent = cfg.agent
    if agent.env_server.enabled:
        # held-out accuracy does not depend on the tool's latency, and during a run the controller
        # pauses every role (the environment server too) while it evaluates: the tool runs in-process
        agent = agent.model_copy(update={"env_server": agent.env_server.model_copy(update={"enabled": False})})
    workflow = load_workflow(agent)
    chat = ChatFormat(tokenizer)
    stop_ids = _stop_token_ids(model, tokenizer)
    max_len = cfg.rollout.max_response_len
    prompts = []  # (metadata as training sees it, prompt ids): the feeder's rendering (asyncrl.tasks.tasks.TrainPromptStream)
    for p in problems:
        prefix = render_response_prefix(cfg.data.response_prefix, p.metadata)
        meta = {**p.metadata, **({"response_prefix": prefix} if prefix else {})}
        prompts.append((meta, render_prompt(tokenizer, p.text, cfg.data.system_prompt, prefix, cfg.data.few_shot)[1]))
    context_len = max(len(ids) for _, ids in prompts) + max_len + 1

    def factory(on_update):
        return Engine(model, tokenizer, context_len=context_len, max_batch_size=batch_size, seed=seed,
                      on_update=on_update)

    t0 = time.monotonic()
    bridge = _EngineBridge(factory)
    bridge.engine.start()
    gate = asyncio.Semaphore(batch_size)
    results: list[tuple[Episode, EpisodeModel, int]] = []

    async def one(i: int) -> None:
        async with gate:
            meta, ids = prompts[i]
            task = EpisodeTask(dict(meta), list(ids), "", seed * 1_000_003 + i, f"heldout-{i}")
            calls = _EvalCalls(bridge, i, max_len, temperature, stop_ids, seed)
            m = EpisodeModel(task, tokenizer, chat, RecordedHistory([]), calls, max_tokens=agent.max_tokens_per_turn,
                             max_turns=agent.max_turns, tool_timeout=agent.tool_timeout_seconds,
                             episode_timeout=agent.episode_timeout_seconds)
            m.temperature = float(temperature)
            env = workflow.make_env(task) if workflow.make_env is not None else None
            try:
                ep = await workflow.run(task, m, env)
            except TokenLimit:
                ep = Episode(0.0, "token_limit")
            except EpisodeTimeout:
                ep = Episode(0.0, "timeout")
            except RuntimeError as exc:
                if "engine" in str(exc) or "generation failed" in str(exc):
                    raise EvalError(str(exc)) from exc
                ep = Episode(0.0, "error")
            except Exception:  # noqa: BLE001 - a workflow failure counts as an unsuccessful episode
                ep = Episode(0.0, "error")
            results.append((ep, m, calls.generated))

    try:
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        bridge.engine.stop()
    n = len(results)

    def success(ep: Episode) -> bool:
        return ep.metrics.get("correct", 1.0 if ep.reward > 0 else 0.0) == 1.0

    correct = sum(success(ep) for ep, _, _ in results)
    done = sum(ep.termination == "env_done" for ep, _, _ in results)
    lo, hi = wilson_interval(correct, n)
    flo, fhi = wilson_interval(done, n)
    first = [ep.metrics.get("turn_correct") == 1.0 for ep, _, _ in results]
    episodes = {
        "turns_mean": sum(m.turns for _, m, _ in results) / max(1, n),
        "tool_calls_mean": sum(m.tool_calls for _, m, _ in results) / max(1, n),
        "tool_failures_mean": sum(m.tool_failures for _, m, _ in results) / max(1, n),
        "reward_mean": sum(ep.reward for ep, _, _ in results) / max(1, n),
        "first_turn_accuracy": sum(first) / max(1, n),
        "terminations": dict(Counter(ep.termination for ep, _, _ in results)),
        "workflow": workflow.name,
    }
    return EvalResult(
        task=str(cfg.data.task), model=model_name, mode="greedy" if temperature == 0 else "sampled",
        temperature=float(temperature), n=n, correct=correct, accuracy=correct / max(1, n), accuracy_ci_low=lo,
        accuracy_ci_high=hi, format_compliance=done / max(1, n), format_ci_low=flo, format_ci_high=fhi,
        mean_response_tokens=sum(g for _, _, g in results) / max(1, n), truncated=sum(
            ep.termination == "token_limit" for ep, _, _ in results), max_new_tokens=max_len, seed=seed,
        seconds=time.monotonic() - t0, backend="engine", episodes=episodes, batch_size=batch_size,
    )
