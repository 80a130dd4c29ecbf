"""Admission and prefill of the embedded engine (a mixin of :class:`rollout_server.engine.Engine`).

Waiting prompts are admitted while rows and the prefill token budget allow; admitted prompts
are prefilled together (left-padded, one forward pass), the ``n`` samples of a prompt share
that prefill, and each sample's first token is sampled from its prompt's last logits. A batched
prefill that raises is redone prompt by prompt, so a request whose own data makes the engine
raise fails alone (docs/rollout.md, "Request validation and isolation").

The mixin uses the engine's state (``_waiting``, ``_rows``, ``_pending_updates``,
``max_batch_size``, ``max_prefill_tokens``, ``model``, ``torch``, ``stats``) and its other
mixins' helpers (``_place_rows``, ``_append_tokens``, ``_sample``, ``_finish``,
``_fail_requests``, ``_fail_nonfinite``, ``_nonfinite_rows``, ``_prompt_logprobs``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_server.engine_sample import EngineSample

__all__ = ["EnginePrefill"]

log = logging.getLogger("rollout_server.engine")


class EnginePrefill:
    """Admission control and batched prefill (see the module docstring)."""

    def _admit(self) -> list[EngineSample]:
        """Move waiting items into free rows, fairly (see ``reserve_rows`` of the engine).

        While rows decode and ``scheduler_delay_factor`` is set, nothing is admitted until the
        oldest waiting item has waited that many times the last admission's prefill.

        Big requests' samples hold at most ``max_request_rows`` rows together and are admitted in
        arrival order; a small request passes a big one that waits, but never into the rows that
        the oldest waiting big one needs, so neither kind starves the other.
        """
        if not self._waiting or self._pending_updates:
            return []
        running = [r.sample for r in self._rows if r is not None]
        if running and self.scheduler_delay_factor > 0.0:
            # vLLM's scheduler delay: let arrivals gather while the running rows decode, so that
            # one prefill forward pass (which costs about a decode step on a CPU) serves several
            waited = time.monotonic() - min(it.queued_at for it in self._waiting)
            if waited < self.scheduler_delay_factor * self._last_prefill_seconds:
                return []
        free = self.max_batch_size - len(running)
        big_room = self.max_request_rows - sum(1 for s in running if s.big)
        items: list[Any] = []
        kept: list[Any] = []
        budget = self.max_prefill_tokens
        held_for_big = 0  # rows small items leave free for the oldest big item that could not start
        big_blocked = False
        for item in self._waiting:
            need = sum(1 for s in item.samples if s.params.max_new_tokens > 0)
            fits = (not items or len(item.ids) <= budget) and free > 0
            if item.big:
                # need > max_request_rows only reaches here from the engine's own API (HTTP refuses it):
                # it runs alone among big requests rather than never
                room = big_room if need <= self.max_request_rows else (free if big_room == self.max_request_rows else 0)
                fits = fits and not big_blocked and need <= free and need <= room
                if not fits and not big_blocked:
                    big_blocked = True
                    held_for_big = max(0, min(need, big_room))
            else:
                fits = fits and need <= free - held_for_big
            if not fits:
                kept.append(item)
                continue
            items.append(item)
            free -= need
            budget -= len(item.ids)
            if item.big:
                big_room -= need
        if not items:
            return []
        self._waiting.clear()
        self._waiting.extend(kept)
        t0 = time.monotonic()
        self.stats["prefill_batches_total"] += 1
        try:
            return self._prefill(items)
        finally:
            self._last_prefill_seconds = time.monotonic() - t0

    def _prefill(self, items: list[Any]) -> list[EngineSample]:
        """Prefill ``items`` together, sample each sample's first token and place the rows.

        Nothing in the batch changes before placement, so when the prefill or the first sampling
        raises, the items are prefilled again one by one and an item that raises on its own fails
        alone (500 naming the request); the others are placed as usual.
        """
        try:
            done = self._prefill_compute(items)
        except Exception as exc:  # one request's input that slipped past validation must not fail the others
            if len(items) > 1:
                log.warning("a batched prefill of %d prompts failed (%s: %s); prefilling them one by one",
                            len(items), type(exc).__name__, exc)
                updated: list[EngineSample] = []
                for it in items:
                    if all(s.finished for s in it.samples):
                        continue
                    for s in it.samples:
                        s.generator = None  # re-seeded: the failed attempt may have drawn from it
                    updated += self._prefill([it])
                return updated
            item = items[0]
            return self._fail_requests([s for s in item.samples if not s.finished], exc,
                                       f"the prefill of its {len(item.ids)} prompt tokens")
        updated, cache, L, placements, samples, tokens, lps, tops, row_of = done
        if not samples:
            return updated
        # place KV right-aligned into free slots (item i's keys/values are row row_of[i] of the prefill)
        slots = self._place_rows(cache, [(len(items[i].ids), row_of[i], go) for i, go in placements], L, tokens)
        updated += self._append_tokens(samples, tokens, lps, tops, slots)
        return updated

    def _prefill_compute(self, items: list[Any]) -> tuple:
        """The part of :meth:`_prefill` that leaves the batch untouched: the forward pass, prompt
        logprobs, the first token of each sample. Per-sample failures (non-finite logits, a seed
        the generator refuses, an error in sampling) end those samples alone."""
        torch = self.torch
        L = max(len(it.ids) for it in items)
        dev = self.device
        # Items with the same token ids (and adapter) share one row of the forward pass: the
        # rollout worker sends each of a prompt's n samples as its own request, so a prefill
        # batch often holds the same prompt n times. Everything after the forward pass still
        # sees one row per item (same order, same values), so sampling is unchanged.
        rows: dict[tuple, int] = {}
        row_of = [rows.setdefault((tuple(it.ids), id(it.samples[0].adapter) if it.samples else None), len(rows))
                  for it in items]
        unique = list({r: it for r, it in zip(row_of, items)}.values())
        P = len(unique)
        want_prompt_lp = any(s.logprob_start_len >= 0 and s.return_logprob for it in items for s in it.samples)
        # the forward pass over the prompts the prompt cache does not hold (rollout_server/prompt_cache.py)
        cache, logits_all = self._prefill_forward(unique, L, want_prompt_lp)
        if P < len(items):  # one row per item again
            logits_all = logits_all[torch.tensor(row_of, dtype=torch.long, device=dev)]
        last = logits_all[:, -1, :]  # (items, V)
        self.stats["prompt_tokens_total"] += sum(len(it.ids) for it in items)
        updated: list[EngineSample] = []
        # prompt logprobs (only for requests asking logprob_start_len >= 0)
        if want_prompt_lp:
            self._prompt_logprobs(items, logits_all, L)
        # finished-at-prefill samples (max_new_tokens == 0) and rows to place
        placements: list[tuple[int, list[EngineSample]]] = []
        for i, it in enumerate(items):
            go = []
            for s in it.samples:
                if s.finished:
                    continue
                if s.params.max_new_tokens <= len(s.output_ids):
                    self._finish(s, {"type": "length", "length": s.params.max_new_tokens})
                    updated.append(s)
                else:
                    go.append(s)
            if go:
                placements.append((i, go))
        # a prompt whose logits are not finite fails on its own (500), the others are placed
        bad_items = set(self._nonfinite_rows(last[torch.tensor([i for i, _ in placements], dtype=torch.long, device=dev)]))
        if bad_items:
            for k in sorted(bad_items):
                i, go = placements[k]
                updated += self._fail_nonfinite(go, f"the prefill of its {len(items[i].ids)} prompt tokens")
            placements = [pl for k, pl in enumerate(placements) if k not in bad_items]
        # the j-th of n seeded samples uses seed + j (else all n would be equal); a seed the
        # generator refuses fails its request alone
        seed_failed: set[int] = set()
        for _, go in placements:
            for j, s in enumerate(go):
                if s.params.sampling_seed is not None and s.generator is None:
                    try:
                        s.generator = torch.Generator(device=dev).manual_seed(int(s.params.sampling_seed) + j)
                    except Exception as exc:
                        updated += self._fail_requests([s], exc, "seeding its sampling generator")
                        seed_failed.add(id(s))
        if seed_failed:
            placements = [(i, [s for s in go if id(s) not in seed_failed]) for i, go in placements]
            placements = [(i, go) for i, go in placements if go]
        if not placements:
            return updated, cache, L, [], [], [], [], [], row_of
        # sample the first new token of every placed sample from its item's last logits
        row_items = [i for i, go in placements for _ in go]
        samples = [s for _, go in placements for s in go]
        logits = last[torch.tensor(row_items, device=dev)].clone()
        for _, go in placements:
            for j, s in enumerate(go):
                if j > 0 and not s.output_ids:
                    s.cached_tokens = len(s.prompt_ids)  # shared prefill of the n samples
        tokens, lps, tops, failed = self._sample(logits, samples)
        if failed:  # their distributions were invalid or sampling raised: they failed (500); place the others only
            updated += failed
            gone = {id(s) for s in failed}
            placements = [(i, [s for s in go if id(s) not in gone]) for i, go in placements]
            placements = [(i, go) for i, go in placements if go]
            samples = [s for _, go in placements for s in go]
        return updated, cache, L, placements, samples, tokens, lps, tops, row_of
