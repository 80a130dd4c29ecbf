"""The embedded engine's prompt cache (recently prefilled prompts) and context cache (finished calls).

One job: not prefill the same prompt twice under the same weights. The rollout worker sends
each of a group's ``n`` samples as its own request and claims them as slots free up, so the
``n`` requests of a prompt reach the engine over several iterations, not in one prefill batch
(where :mod:`rollout_server.engine_prefill` already shares one forward row). A prefilled prompt's
per-layer keys/values ``(kv_heads, n, head_dim)`` and its last logits ``(V,)`` are kept, keyed by
its token ids and the request's LoRA adapter, least recently used first out, up to
``max_tokens`` prompt tokens in all; every applied weight update and ``/flush_cache`` empties it
(SGLang's radix cache, reduced to whole prompts: docs/rollout.md, "Rollout profile").

:class:`EnginePromptCache` is a mixin of :class:`rollout_server.engine.Engine`: its
``_prefill_forward`` runs the prefill's forward pass over the prompts not in the cache and
assembles the rest from it. A batch that asks for prompt logprobs bypasses the cache (they need
every position's logits).

The **context cache** (a second :class:`PromptCache`, no logits) keeps the keys/values of
finished samples' contexts, their prompt and output but the last token, keyed the same way. A
multi-call episode's next call sends the earlier call's context, its output and an observation as
one prompt; a prompt the prompt cache does not hold is looked up by its longest shared prefix
(:meth:`PromptCache.longest_prefix`, at least :data:`MIN_PREFIX_TOKENS` tokens and
:data:`MIN_PREFIX_SHARE` of the entry), and only the tokens after it run through the model
(``_forward_suffix``). ``/flush_cache`` and every weight update sent with ``flush_cache`` true
(SGLang's default) empty it, and a row prefilled before such an update is never kept, so what it
serves is then what a recomputation gives. An update sent with ``flush_cache`` false keeps it: a
later prompt extends the old weights' keys/values, as a request running across an in-place update
does (``rollout.flush_cache_on_update``; SGLang's radix cache, for whole earlier contexts:
docs/rollout.md, "No radix tree").
"""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any, Sequence

__all__ = ["EnginePromptCache", "PromptCache", "MIN_PREFIX_TOKENS", "MIN_PREFIX_SHARE"]

#: fewest leading tokens a prompt must share with a context cache entry to be served from it
MIN_PREFIX_TOKENS = 16
#: smallest share of a context cache entry's own tokens that the shared prefix must cover
MIN_PREFIX_SHARE = 0.75


class PromptCache:
    """LRU map from ``(adapter, token ids)`` to ``(per-layer (keys, values), last logits)``.

    Args:
        max_tokens: most prompt tokens held in all (0: the cache holds nothing).

    Raises:
        ValueError: ``max_tokens`` is negative.
    """

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"prompt cache size must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.tokens = 0
        self._entries: collections.OrderedDict[tuple, tuple[list, Any]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> tuple[list, Any] | None:
        """The entry of ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple, kv: list, logits: Any) -> None:
        """Keep ``key``'s keys/values and last logits, evicting the least recently used beyond ``max_tokens``."""
        n = len(key[1])
        if n > self.max_tokens or key in self._entries:
            return
        self._entries[key] = (kv, logits)
        self.tokens += n
        while self.tokens > self.max_tokens:
            old, _ = self._entries.popitem(last=False)
            self.tokens -= len(old[1])

    def clear(self) -> None:
        """Forget every entry (the weights changed, or ``/flush_cache``)."""
        self._entries.clear()
        self.tokens = 0

    def longest_prefix(self, adapter: Any, ids: Sequence[int]) -> tuple[int, tuple[list, Any]] | None:
        """The entry of ``adapter`` that shares the longest prefix with ``ids``, and that length.

        An entry counts only when the shared prefix covers at least :data:`MIN_PREFIX_TOKENS`
        tokens and :data:`MIN_PREFIX_SHARE` of the entry's own tokens (a later model call of an
        episode extends the earlier call's context whole; two prompts that share only a chat
        template's system prompt do not qualify). The prefix is capped at ``len(ids) - 1`` so
        that at least one token is left to compute the next token's logits from.

        Returns:
            ``(prefix length, (per-layer (keys, values), logits or None))``, or None; the entry
            becomes the most recently used.
        """
        best, best_len = None, 0
        limit = len(ids) - 1
        for key in self._entries:
            if key[0] is not adapter:
                continue
            k = key[1]
            n = min(len(k), limit)
            i = 0
            while i < n and k[i] == ids[i]:
                i += 1
            if i > best_len and i >= MIN_PREFIX_TOKENS and i >= MIN_PREFIX_SHARE * len(k):
                best, best_len = key, i
        if best is None:
            return None
        self._entries.move_to_end(best)
        return best_len, self._entries[best]


class EnginePromptCache:
    """The prefill's forward pass with the prompt cache (mixin of :class:`rollout_server.engine.Engine`).

    Expects ``torch``, ``model``, ``device``, ``stats``, ``prompt_cache`` (a :class:`PromptCache` or
    None) and ``_forward_with_adapters`` on the engine.
    """

    def _prefill_forward(self, unique: list[Any], L: int, want_prompt_lp: bool) -> tuple[Any, Any]:
        """Keys/values and logits of the distinct prompts ``unique`` (one admission item each).

        Returns:
            ``(cache, logits)``: ``cache.layers[l].keys`` / ``.values`` ``(U, kv_heads, L, head_dim)``
            with each prompt right-aligned (left padding), and ``logits`` ``(U, L, V)`` when
            ``want_prompt_lp`` else ``(U, 1, V)``, fp32.
        """
        torch = self.torch
        pc = self.prompt_cache if not want_prompt_lp else None
        keys = [(it.samples[0].adapter if it.samples else None, tuple(it.ids)) for it in unique]
        hits = [pc.get(k) if pc is not None else None for k in keys]
        cc = self.context_cache if not want_prompt_lp else None
        if cc is not None and len(cc):
            # a later model call of an episode: its context extends a finished call's, whose
            # keys/values are kept; only the new tokens run through the model
            for i, h in enumerate(hits):
                if h is None:
                    found = cc.longest_prefix(keys[i][0], unique[i].ids)
                    if found is not None:
                        hits[i] = self._forward_suffix(unique[i], *found)
                        self.stats["context_cache_hits_total"] += 1
                        if pc is not None and bool(torch.isfinite(hits[i][1]).all()):
                            pc.put(keys[i], *hits[i])  # the call's other samples are served whole
        fresh = [i for i, h in enumerate(hits) if h is None]
        cache = logits = None
        if fresh:
            cache, logits = self._forward_prompts([unique[i] for i in fresh], want_prompt_lp)
            Lf = max(len(unique[i].ids) for i in fresh)
            self.stats["prefill_forward_tokens_total"] += sum(len(unique[i].ids) for i in fresh)
            if pc is not None:
                for r, i in enumerate(fresh):
                    n = len(unique[i].ids)
                    last = logits[r, -1]
                    if bool(torch.isfinite(last).all()):  # a failing prompt is never served from the cache
                        kv = [(layer.keys[r, :, Lf - n :].clone(), layer.values[r, :, Lf - n :].clone())
                              for layer in cache.layers]
                        pc.put(keys[i], kv, last.clone())
        n_hits = len(unique) - len(fresh)
        self.stats["prompt_cache_hits_total"] += n_hits
        if not n_hits:
            return cache, logits
        dev = self.device
        if not fresh and all(h[0][0][0].shape[1] == L for h in hits):  # all cached, same length: no assembly
            def stack(ts: list) -> Any:  # one prompt (the usual case): a view, no copy
                return ts[0].unsqueeze(0) if len(ts) == 1 else torch.stack(ts)

            return (SimpleNamespace(layers=[SimpleNamespace(keys=stack([h[0][layer][0] for h in hits]),
                                                            values=stack([h[0][layer][1] for h in hits]))
                                            for layer in range(len(hits[0][0]))]),
                    stack([h[1] for h in hits])[:, None, :])
        first_kv, first_logits = next(h for h in hits if h is not None)
        out_layers = []
        fresh_idx = torch.tensor(fresh, dtype=torch.long, device=dev)
        for layer in range(len(first_kv)):
            k0 = first_kv[layer][0]
            k = torch.zeros((len(unique), k0.shape[0], L, k0.shape[2]), dtype=k0.dtype, device=dev)
            v = torch.zeros_like(k)
            if fresh:
                src = cache.layers[layer]
                Lf = src.keys.shape[2]
                k[fresh_idx, :, L - Lf :] = src.keys
                v[fresh_idx, :, L - Lf :] = src.values
            for i, h in enumerate(hits):
                if h is not None:
                    hk, hv = h[0][layer]
                    k[i, :, L - hk.shape[1] :] = hk
                    v[i, :, L - hv.shape[1] :] = hv
            out_layers.append(SimpleNamespace(keys=k, values=v))
        all_logits = torch.empty((len(unique), 1, first_logits.shape[0]), dtype=torch.float32, device=dev)
        if fresh:
            all_logits[fresh_idx] = logits[:, -1:, :]
        for i, h in enumerate(hits):
            if h is not None:
                all_logits[i, 0] = h[1]
        return SimpleNamespace(layers=out_layers), all_logits

    def _forward_suffix(self, item: Any, prefix_len: int, entry: tuple[list, Any]) -> tuple[list, Any]:
        """Keys/values and last logits of ``item``'s prompt from a context cache entry whose first
        ``prefix_len`` positions it shares: one forward pass over the rest of the prompt.

        Returns:
            ``(per-layer (keys, values) (kv_heads, n, head_dim), last logits (V,) fp32)`` for the
            item's ``n`` prompt tokens, as a prompt cache entry.
        """
        torch = self.torch
        from transformers import DynamicCache

        dev = self.device
        P, n = prefix_len, len(item.ids)
        cache = DynamicCache(config=self.model.config)
        for layer, (k, v) in enumerate(entry[0]):
            cache.update(k[None, :, :P], v[None, :, :P], layer)  # copies: the entry stays as it is
        S = n - P
        ids = torch.tensor([item.ids[P:]], dtype=torch.long, device=dev)
        pos = torch.arange(P, n, dtype=torch.long, device=dev)[None]
        mask4 = torch.ones(S, n, dtype=torch.bool, device=dev).tril(diagonal=P)[None, None]
        out = self._forward_with_adapters(
            [item.samples[0].adapter if item.samples else None],
            input_ids=ids, attention_mask=mask4, position_ids=pos, past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        )
        self.stats["prefill_forward_tokens_total"] += S
        for s in item.samples:  # SGLang's meta_info.cached_tokens: the prompt tokens not computed again
            s.cached_tokens = max(s.cached_tokens, P)
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers], out.logits[0, -1].float()

    def _remember_context(self, s: Any, slot: int) -> None:
        """Keep a finished sample's keys/values (its prompt and output but the last token, whose
        keys/values were never computed) in the context cache, for a later call that extends it.

        A row is kept unless an update that flushed the caches (SGLang's ``flush_cache``, the
        default) was applied after its prefill: then its keys/values are of weights the caller
        asked to forget (the cache was emptied at that update, and a row that ran across it, as
        ``pause_mode: in_place`` allows, holds keys and values of two versions). After updates
        sent with ``flush_cache: false`` (asyncrl's worker with ``pause_mode: in_place``) a row
        is kept with keys/values of the old weights, like the rows that ran across them.
        """
        cc = self.context_cache
        if cc is None or len(s.output_ids) < 2:
            return
        row = self._rows[slot]
        if row is None or row.epoch < self.kv_flush_epoch:
            return
        torch = self.torch
        ids = tuple(s.prompt_ids) + tuple(s.output_ids[:-1])
        if len(ids) > cc.max_tokens:
            return
        cols = torch.nonzero(self._mask[slot, : self._length]).flatten()
        if cols.numel() != len(ids):  # not the layout this expects: keep nothing rather than a wrong entry
            return
        kv = [(self._K[layer][slot][:, cols], self._V[layer][slot][:, cols]) for layer in range(self.num_layers)]
        cc.put((s.adapter, ids), kv, None)

    def _forward_prompts(self, items: list[Any], want_prompt_lp: bool) -> tuple[Any, Any]:
        """One left-padded forward pass over ``items``' prompts: ``(DynamicCache, fp32 logits)``."""
        torch = self.torch
        dev = self.device
        P, L = len(items), max(len(it.ids) for it in items)
        # built on the host (P small writes), moved to the engine's device once
        ids = torch.zeros(P, L, dtype=torch.long)
        pad_mask = torch.zeros(P, L, dtype=torch.bool)
        pos = torch.zeros(P, L, dtype=torch.long)
        for i, it in enumerate(items):
            n = len(it.ids)
            ids[i, L - n :] = torch.tensor(it.ids, dtype=torch.long)
            pad_mask[i, L - n :] = True
            pos[i, L - n :] = torch.arange(n)
        ids, pad_mask, pos = ids.to(dev), pad_mask.to(dev), pos.to(dev)
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
        mask4 = (causal[None] & pad_mask[:, None, :]) | torch.eye(L, dtype=torch.bool, device=dev)[None]
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self._forward_with_adapters(  # the samples of an item share one request, so one adapter
            [it.samples[0].adapter if it.samples else None for it in items],
            input_ids=ids,
            attention_mask=mask4[:, None],
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if want_prompt_lp else 1,
        )
        return cache, out.logits.float()
