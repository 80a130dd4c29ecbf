"""The prompt feeder: streams prompt groups from the task into the replay buffer.

Step 1 of docs/architecture.md#data-flow-of-one-sample.

``asyncrl train`` runs it as its own process (``python -m asyncrl.feeder --config F``, the Redis
URL in ``ASYNCRL_BUFFER__REDIS_URL``). It keeps about R (``rollout.rollout_batch_size``)
groups waiting for admission, so admission control — not the feeder — decides how many groups
are in flight.

No prompt is skipped or repeated across restarts: the dataset cursor lives in Redis, and
:meth:`buffers.ReplayBuffer.feed` appends groups and moves the cursor in one script, only if
the cursor still has the value the feeder read. The prompt at cursor ``c`` is
:meth:`asyncrl.tasks.tasks.TrainPromptStream.get(c) <asyncrl.tasks.tasks.TrainPromptStream.get>`, a pure
function of the config, so a restarted feeder (or one started by ``--resume``) continues with
exactly the next prompt. Group ids are ``p<cursor>``.

A Redis outage (a restart, AOF loading) is waited out with backoff and one WARNING line
(:mod:`asyncrl.core.outage`, ``buffer.outage_seconds``), not a crash: it does not use up the
feeder's restarts.

A prompt too long for ``max_response_len`` in the model's context stops the feeder with an
error naming the prompt and the fix (the run then stops: nothing is half-fed).

With best-of-n each group asks for ``rollout.generation_size`` samples. With the pass-rate
dataset filter (``data.dataset_max_filter_percentage`` > 0, :mod:`asyncrl.feeder.prompt_filter`) the
positions of removed prompts are skipped: one feed call feeds a run of kept prompts and moves
the cursor past the removed ones right after it (counted ``skipped_prompts:pass_rate_filter``),
never across an epoch boundary, where the filter runs first. With selective rollout
(``data.selective_rollout.enabled``, :mod:`asyncrl.feeder.selective_rollout`, GRESO) the positions of
prompts predicted to give zero-variance groups are skipped the same way (counted
``skipped_prompts:zero_variance_predicted``), and each group's metadata carries its train
``problem_index`` and ``problem_key`` (a hash of the problem's text) so that the buffer can update
the problem's history, keyed by ``problem_key``, when the group finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from typing import Any

from asyncrl.core.aio import wait_event

__all__ = ["Feeder", "FeederError", "group_id_for", "main"]


class FeederError(RuntimeError):
    """A prompt that cannot be fed (longer than the context allows)."""


def group_id_for(cursor: int) -> str:
    """The prompt group id of the prompt at dataset position ``cursor``."""
    return f"p{cursor:09d}"


class Feeder:
    """Feeds prompt groups so that about ``target_pending`` wait for admission.

    Args:
        buffer: an open :class:`buffers.ReplayBuffer`.
        stream: the :class:`asyncrl.tasks.tasks.TrainPromptStream` of the run.
        n_samples: samples generated per prompt group (``rollout.generation_size`` with best-of-n, else
            ``rollout.n_samples_per_prompt``: ``BufferSettings.samples_generated``).
        target_pending: groups kept pending (default: R).
        max_prompt_tokens: longest prompt allowed (context − ``max_response_len``); None: no check.
        prompt_filter: an :class:`asyncrl.feeder.prompt_filter.PassRateFilter`, or None (no filter).
        selective: an :class:`asyncrl.feeder.selective_rollout.SelectiveRollout`, or None (no selective rollout).
    """

    def __init__(self, buffer: Any, stream: Any, n_samples: int, target_pending: int,
                 max_prompt_tokens: int | None = None, prompt_filter: Any = None, selective: Any = None) -> None:
        self.buffer = buffer
        self.stream = stream
        self.n_samples = n_samples
        self.target_pending = target_pending
        self.max_prompt_tokens = max_prompt_tokens
        self.prompt_filter = prompt_filter if prompt_filter is not None and prompt_filter.enabled else None
        self.selective = selective if selective is not None and selective.enabled else None
        self.fed_groups = 0
        self.skipped_prompts = 0  # by either rule
        self.predicted_skips = 0  # of those, by the selective-rollout rule

    def groups_at(self, cursor: int, count: int) -> list[Any]:
        """The prompt groups for dataset positions ``cursor .. cursor + count - 1``.

        Raises:
            FeederError: a prompt longer than ``max_prompt_tokens``.
        """
        from asyncrl.core.types import PromptGroup

        groups = []
        for c in range(cursor, cursor + count):
            prompt = self.stream.get(c)
            if self.max_prompt_tokens is not None and len(prompt.prompt_ids) > self.max_prompt_tokens:
                raise FeederError(
                    f"prompt at cursor {c} has {len(prompt.prompt_ids)} tokens; with rollout.max_response_len "
                    f"only {self.max_prompt_tokens} fit the model's context: lower --max_response_len or "
                    f"use shorter prompts"
                )
            meta = dict(prompt.problem.metadata)
            if self.selective is not None:  # score.lua updates this problem's history when the group finishes
                meta["problem_index"] = self.stream.problem_index(c)
                meta["problem_key"] = self.stream.problem_key(c)  # the history's key: the problem, wherever it recurs
            groups.append(PromptGroup(group_id_for(c), list(prompt.prompt_ids), meta, self.n_samples))
        return groups

    async def feed_once(self) -> int:
        """Top the pending queue up to ``target_pending``; returns the groups fed plus the removed
        prompts skipped (0: nothing to do).

        A concurrent feed (another feeder) moves the cursor under us: the attempt is dropped
        (``CursorMismatch``, nothing written) and 0 is returned; the next call re-reads.
        """
        from buffers.errors import CursorMismatch

        missing = self.target_pending - await self.buffer.pending_groups()
        if missing <= 0:
            return 0
        cursor = await self.buffer.dataset_cursor()
        skip, predicted = 0, []
        if self.prompt_filter is None and self.selective is None:
            groups = self.groups_at(cursor, missing)
        else:
            if self.prompt_filter is not None:
                await self.prompt_filter.refresh(cursor)
            kept, skip, predicted = await self._plan(cursor, missing)
            groups = self.groups_at(cursor, kept)
        try:
            if predicted:
                await self.buffer.feed(groups, cursor, skip=skip, predicted=predicted)
            else:
                await self.buffer.feed(groups, cursor, skip=skip)
        except CursorMismatch:
            return 0
        self.fed_groups += len(groups)
        self.skipped_prompts += skip + len(predicted)
        self.predicted_skips += len(predicted)
        return len(groups) + skip + len(predicted)

    async def _plan(self, cursor: int, count: int) -> tuple[int, int, list[tuple[int, str]]]:
        """(prompts kept from ``cursor`` on, prompts the pass-rate filter removed right after them,
        ``(problem, kind)`` of the prompts the selective rule skips among those): at most ``count``
        kept, stopping at the end of the epoch (the filter runs again there). The skipped run after
        the kept prompts may mix both reasons; it ends at the next kept prompt."""
        epoch_end = (cursor // len(self.stream) + 1) * len(self.stream)
        c, kept, skip, predicted = cursor, 0, 0, []
        while c < epoch_end:
            stop = min(epoch_end, c + max(count - kept, 0) + 64)  # one buffer round trip per chunk
            for problem, reason in await self._reasons(c, stop):
                if reason is None:
                    if skip or predicted or kept >= count:
                        return kept, skip, predicted
                    kept += 1
                elif reason == "filter":
                    skip += 1
                else:
                    predicted.append((problem, reason))
                c += 1
        return kept, skip, predicted

    async def _reasons(self, start: int, stop: int) -> list[tuple[int, str | None]]:
        """``(problem, reason)`` for positions ``start .. stop - 1``: ``filter`` (removed by the
        pass-rate filter), ``easy`` / ``hard`` (skipped by the selective rule) or None (fed).
        ``problem`` is the problem's key (``TrainPromptStream.problem_key``), the selective rule's
        history key, when the rule is on, else its index."""
        if self.selective is not None:
            problems = [self.stream.problem_key(c) for c in range(start, stop)]
            decided = await self.selective.decisions(start, problems)
        else:
            problems = [self.stream.problem_index(c) for c in range(start, stop)]
            decided = [None] * len(problems)
        out = []
        for c, problem, d in zip(range(start, stop), problems, decided):
            filtered = self.prompt_filter is not None and self.prompt_filter.skips(c)
            out.append((problem, "filter" if filtered else d))
        return out

    async def run(self, stop: asyncio.Event, poll_seconds: float = 0.1, guard: Any = None) -> None:
        """Feed until ``stop`` is set.

        Args:
            guard: an :class:`asyncrl.core.outage.OutageGuard`: a Redis outage is waited out (one
                WARNING line, backoff) instead of crashing the feeder; None: errors propagate.

        Raises:
            asyncrl.core.outage.DependencyOutage: Redis unreachable past the guard's deadline.
        """
        from asyncrl.core.outage import DependencyOutage

        while not stop.is_set():
            try:  # fed = groups fed + prompts skipped
                fed = await (guard.call(self.feed_once, "feeding prompt groups", give_up=stop.is_set)
                             if guard is not None else self.feed_once())
            except DependencyOutage:
                if stop.is_set():
                    return
                raise
            if not fed:
                await wait_event(stop, poll_seconds)  # not wait_for: see asyncrl.core.aio


async def _run(cfg: Any) -> int:
    from asyncrl.models import load_tokenizer, model_context_len
    from asyncrl.core.outage import DependencyOutage, OutageGuard
    from asyncrl.tasks.tasks import TrainPromptStream
    from buffers import ReplayBuffer

    if not cfg.buffer.redis_url:
        print("asyncrl feeder: buffer.redis_url is not set (asyncrl train passes it; or --redis_url URL)",
              file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tokenizer = load_tokenizer(cfg.model.path)
    context = cfg.model.max_context_len or model_context_len(cfg.model.path)
    stream = TrainPromptStream(cfg.data, tokenizer, seed=cfg.data.seed)
    guard = OutageGuard("feeder", cfg.buffer.outage_seconds)
    try:
        buf = await guard.call(lambda: ReplayBuffer.open_for(cfg, role="feeder"),
                               "opening the run's buffer", give_up=stop.is_set)
    except DependencyOutage as exc:
        if stop.is_set():
            return 0
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    try:
        from asyncrl.feeder.prompt_filter import PassRateFilter

        from asyncrl.feeder.selective_rollout import SelectiveRollout

        prompt_filter = PassRateFilter(buf, stream, cfg.data.dataset_filter_threshold,
                                       cfg.data.dataset_max_filter_percentage)
        selective = SelectiveRollout(buf, stream, cfg.data.selective_rollout)
        feeder = Feeder(buf, stream, buf.settings.samples_generated, cfg.rollout.rollout_batch_size,
                        max_prompt_tokens=context - cfg.rollout.max_response_len, prompt_filter=prompt_filter,
                        selective=selective)
        cursor = await guard.call(buf.dataset_cursor, "reading the dataset cursor", give_up=stop.is_set)
        print(f"asyncrl feeder: feeding run {cfg.run.name!r} from cursor {cursor}", flush=True)
        await feeder.run(stop, guard=guard)
        with contextlib.suppress(Exception):  # the last line is informative only
            print(f"asyncrl feeder: stopped after feeding {feeder.fed_groups} groups and skipping "
                  f"{feeder.skipped_prompts} prompts ({feeder.predicted_skips} predicted zero-variance); cursor "
                  f"{await buf.dataset_cursor()}", flush=True)
    except DependencyOutage as exc:
        if stop.is_set():
            return 0
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    finally:
        await buf.close()
    return 0


def main(argv: list[str]) -> int:
    """``python -m asyncrl.feeder --config F [flags]``: feed until SIGTERM; returns the exit code."""
    from asyncrl.core.config_cli import config_from_argv

    cfg = config_from_argv(argv, "feeder")
    if isinstance(cfg, int):
        return cfg
    from asyncrl.models import ModelError
    from asyncrl.tasks.tasks import TaskError
    from buffers.errors import BufferError

    try:
        return asyncio.run(_run(cfg))
    except TaskError as exc:  # a configuration problem: restarting cannot fix it
        print(f"asyncrl feeder: {exc}", file=sys.stderr)
        return 2
    except FeederError as exc:
        print(f"asyncrl feeder: {exc}", file=sys.stderr)
        return 1
    except (BufferError, ModelError) as exc:
        print(f"asyncrl feeder: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
