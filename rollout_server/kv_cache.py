"""The engine's KV cache: batch slots, in-place key/value buffers, row placement and compaction.

One job: own the memory a decode step reads and writes. :class:`KVCacheSlots` is a mixin of
:class:`rollout_server.engine.Engine` (the scheduler decides which rows run; this decides where
they live); its state is touched by the engine thread only.

KV cache layout (why it is simple): one left-padded buffer per layer, ``(slots, kv_heads,
columns, head_dim)``. Every live row ends at the same column ``length``; a row's real tokens
occupy ``[start, length)`` and a boolean mask ``(slots, columns)`` hides the padding. One
decode step feeds one token per slot, writes its keys/values into column ``length`` of the
buffer in place (no per-step concatenation), and passes HF a ready 4-D mask and per-row
position ids. A request that arrives while a batch runs is prefilled on its own (all newly
arrived prompts together, left-padded), then copied right-aligned into free slots, and joins
the very next decode step. The ``n`` samples of a prompt share a single prefill: the prompt is
prefilled once and its keys/values are copied into ``n`` slots. Finished rows are left as dead
slots (reused by the next arrival) and compacted away when they exceed a quarter of the batch;
padding columns no live row needs are trimmed the same way. Padding columns hold zeros, never
stale or uninitialised memory: masked columns still take part in the attention arithmetic, and
one NaN/inf there made a whole row's logits NaN (the multinomial "inf, nan or element < 0"
failures). A decode step may run only a prefix of the slots (fair steps,
:mod:`rollout_server.engine_fair`): the rows it leaves out get a masked, zeroed *hole* at its
column, the slots are permuted into serving order when needed (:meth:`KVCacheSlots._arrange`),
and holes are squeezed out of the rows when they would double the buffer's width
(:meth:`KVCacheSlots._squeeze_holes`; keys carry their rotary position from when they were
written, so moving a column changes nothing but where it lives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_server.engine_sample import EngineSample

__all__ = ["KVCacheSlots"]


@dataclass(eq=False)
class _Row:
    sample: EngineSample
    start: int  # first real column of this row in the batch buffer
    holes: int = 0  # masked columns inside [start, length): decode steps this row skipped (engine_fair.py)
    epoch: int = 0  # the engine's weights_epoch when the row was prefilled (its keys/values' weights)


class _BufferLayer:
    """HF cache layer writing new keys/values in place into the engine's batch buffer.

    Duck-types transformers' ``DynamicLayer`` for the calls the decoder layers make.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    is_initialized = True

    def __init__(self, engine: "KVCacheSlots", idx: int):
        self.engine, self.idx = engine, idx

    def update(self, key_states, value_states, *args, **kwargs):
        e = self.engine
        B, col = key_states.shape[0], e._length
        K, V = e._K[self.idx], e._V[self.idx]
        K[:B, :, col : col + 1] = key_states
        V[:B, :, col : col + 1] = value_states
        return K[:B, :, : col + 1], V[:B, :, : col + 1]

    def get_seq_length(self) -> int:
        return self.engine._length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.engine._length + query_length, 0

    def get_max_length(self) -> int:
        return -1


class KVCacheSlots:
    """Batch slots and their KV buffers (mixin of :class:`rollout_server.engine.Engine`).

    Expects ``torch``, ``model``, ``num_layers``, ``kv_heads``, ``head_dim``, ``dtype``, ``device``
    and ``max_batch_size`` on the engine; every buffer is allocated on ``device``.
    """

    def _init_batch(self, model: Any) -> None:
        """Empty batch state and the HF cache whose layers write into it in place."""
        self._K: list[Any] = []
        self._V: list[Any] = []
        self._mask = None  # (slots, columns) bool
        self._pos = None  # (slots,) next position id
        self._next = None  # (slots,) next input token
        self._slots = 0  # allocated slots
        self._cols = 0  # allocated columns
        self._length = 0  # used columns
        self._rows: list[_Row | None] = []  # active width B = len(self._rows)
        from transformers import DynamicCache

        self._cache = DynamicCache(config=model.config)
        self._cache.layers = [_BufferLayer(self, i) for i in range(self.num_layers)]

    def _place_rows(self, cache: Any, placements: list[tuple[int, int, list[EngineSample]]], L: int, tokens: list[int]) -> list[int]:
        """Copy freshly prefilled keys/values right-aligned into free slots; returns the slots, one per sample.

        ``cache`` is the prefill's own cache (rows left-padded to width ``L``); ``placements`` are
        ``(prompt length n, prefill row i, samples continuing from it)``; ``tokens`` are the
        samples' first sampled tokens, their next decode input.
        """
        torch = self.torch
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        new_len = max(self._length, max(n for n, _, _ in placements))
        n_new = sum(len(go) for _, _, go in placements)
        slots = self._claim_slots(n_new, new_len + 1)
        Lc = self._length  # every row ends here now; each prompt length n <= Lc and n <= L
        lens = [n for n, _, go in placements for _ in go]
        dev = self.device
        idx = torch.tensor(slots, dtype=torch.long, device=dev)
        src = torch.tensor([i for _, i, go in placements for _ in go], dtype=torch.long, device=dev)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        # all new rows at once, per layer: the last w columns of their prefill rows go to the last
        # w columns of their slots, the prompt's own n of them kept and the rest zeroed; the
        # padding columns of a reused or fresh slot hold a previous row's keys or uninitialised
        # memory, and masked or not, a non-finite value there turns the row's attention output
        # into NaN (score NaN + mask = NaN, 0 * NaN = NaN), so they are cleared too
        w = min(L, Lc)
        keep = torch.arange(w, device=dev)[None, :] >= (w - lens_t)[:, None]  # (rows, w): a prompt column
        keep4 = keep[:, None, :, None]
        for layer in range(self.num_layers):
            for dst, new in ((self._K[layer], kv[layer][0]), (self._V[layer], kv[layer][1])):
                dst[idx, :, Lc - w : Lc] = torch.where(keep4, new[src, :, L - w :], 0.0)
                if Lc > w:
                    dst[idx, :, : Lc - w] = 0
        self._mask[idx] = False
        self._mask[idx, Lc - w : Lc] = keep
        self._pos[idx] = lens_t
        k = 0
        for n, _, go in placements:
            for j, s in enumerate(go):
                self._rows[slots[k + j]] = _Row(s, Lc - n, epoch=self.weights_epoch)
            k += len(go)
        self._next[idx] = torch.tensor(tokens, dtype=torch.long, device=dev)
        return slots

    def _claim_slots(self, n: int, need_cols: int) -> list[int]:
        """Pick ``n`` slots (dead ones first), growing buffers; make every row end at ``need_cols - 1``."""
        # shift existing rows right if the new rows are longer than the current content
        want_len = need_cols - 1
        if want_len > self._length:
            self._ensure_capacity(self._slots, want_len + 1)
            d = want_len - self._length
            B = len(self._rows)
            if B and self._length:
                for layer in range(self.num_layers):
                    self._K[layer][:B, :, d : d + self._length] = self._K[layer][:B, :, : self._length].clone()
                    self._V[layer][:B, :, d : d + self._length] = self._V[layer][:B, :, : self._length].clone()
                self._mask[:B, d : d + self._length] = self._mask[:B, : self._length].clone()
            if B:
                # the columns exposed on the left are padding of every existing row: they are masked,
                # but attention still multiplies them (0 * NaN = NaN), so they must hold finite values
                for layer in range(self.num_layers):
                    self._K[layer][:B, :, :d] = 0
                    self._V[layer][:B, :, :d] = 0
                self._mask[:B, :d] = False
            for row in self._rows:
                if row is not None:
                    row.start += d
            self._length = want_len
        free = [i for i, r in enumerate(self._rows) if r is None][:n]
        extra = n - len(free)
        if extra > 0:
            B = len(self._rows)
            self._ensure_capacity(B + extra, self._length + 1)
            self._rows.extend([None] * extra)
            free += list(range(B, B + extra))
        return free

    def _ensure_capacity(self, slots: int, cols: int) -> None:
        torch = self.torch
        if slots <= self._slots and cols <= self._cols:
            return
        new_slots = max(slots, min(self.max_batch_size, max(self._slots * 2, 4)))
        new_slots = max(new_slots, slots)
        new_cols = cols if cols <= self._cols else max(cols + 16, self._cols * 2)
        new_cols = max(new_cols, self._cols)
        shape = (new_slots, self.kv_heads, new_cols, self.head_dim)
        B, Lc = len(self._rows), self._length
        newK, newV = [], []
        for layer in range(self.num_layers):
            # zeros, not empty: uninitialised memory can hold NaN/inf bit patterns, and a masked
            # column is still part of the attention arithmetic (see _place_rows)
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self._K and B and Lc:
                k[:B, :, :Lc] = self._K[layer][:B, :, :Lc]
                v[:B, :, :Lc] = self._V[layer][:B, :, :Lc]
            newK.append(k)
            newV.append(v)
        mask = torch.zeros(new_slots, new_cols, dtype=torch.bool, device=self.device)
        pos = torch.zeros(new_slots, dtype=torch.long, device=self.device)
        nxt = torch.zeros(new_slots, dtype=torch.long, device=self.device)
        if self._mask is not None and B:
            mask[:B, :Lc] = self._mask[:B, :Lc]
            pos[:B] = self._pos[:B]
            nxt[:B] = self._next[:B]
        self._K, self._V, self._mask, self._pos, self._next = newK, newV, mask, pos, nxt
        self._slots, self._cols = new_slots, new_cols

    def _release_buffers(self) -> None:
        self._K, self._V = [], []
        self._mask = self._pos = self._next = None
        self._slots = self._cols = self._length = 0
        self._rows = []

    def _arrange(self, order: list[int]) -> None:
        """Permute the slots: slot ``k`` gets the row of slot ``order[k]`` (live rows only; the others are dropped)."""
        torch = self.torch
        idx = torch.tensor(order, dtype=torch.long, device=self.device)
        n, L = len(order), self._length
        for layer in range(self.num_layers):
            self._K[layer][:n, :, :L] = self._K[layer][idx, :, :L]
            self._V[layer][:n, :, :L] = self._V[layer][idx, :, :L]
        self._mask[:n, :L] = self._mask[idx, :L]
        self._pos[:n] = self._pos[idx].clone()
        self._next[:n] = self._next[idx].clone()
        self._rows = [self._rows[i] for i in order]

    def _leave_hole(self, width: int) -> None:
        """The slots from ``width`` on skip the step writing column ``_length``: mask it and zero it there."""
        B, col = len(self._rows), self._length
        if width >= B:
            return
        self._mask[width:B, col] = False
        for layer in range(self.num_layers):
            self._K[layer][width:B, :, col] = 0
            self._V[layer][width:B, :, col] = 0

    def _squeeze_holes(self) -> bool:
        """Move every live row's real columns together, right-aligned, when holes would double the width.

        Returns whether it squeezed. Cost: one gather of the live rows' keys and values.
        """
        torch = self.torch
        live = [(i, r) for i, r in enumerate(self._rows) if r is not None]
        if not live or not any(r.holes for _, r in live):
            return False
        width = self._length - min(r.start for _, r in live)
        need = max(self._length - r.start - r.holes for _, r in live)
        if width < 2 * need + 32:
            return False
        B, L = len(self._rows), self._length
        cols = [torch.nonzero(self._mask[i, :L]).flatten() for i, _ in live]  # each row's real columns
        need = max(int(c.numel()) for c in cols)
        src = torch.zeros(B, need, dtype=torch.long, device=self.device)
        keep = torch.zeros(B, need, dtype=torch.bool, device=self.device)
        for (i, r), c in zip(live, cols):
            n = int(c.numel())
            src[i, need - n :] = c
            keep[i, need - n :] = True
            r.start, r.holes = need - n, 0
        for layer in range(self.num_layers):
            for buf in (self._K[layer], self._V[layer]):
                moved = buf[:B, :, :L].gather(2, src[:, None, :, None].expand(B, buf.shape[1], need, buf.shape[3]))
                buf[:B, :, :need] = moved.masked_fill(~keep[:, None, :, None], 0)
        self._mask[:B, :need] = keep
        self._mask[:B, need:L] = False
        self._length = need
        return True

    def _maybe_compact(self) -> None:
        """Drop dead tail slots; compact when dead slots exceed a quarter; trim unused left columns."""
        torch = self.torch
        while self._rows and self._rows[-1] is None:
            self._rows.pop()
        live = [i for i, r in enumerate(self._rows) if r is not None]
        if not live:
            self._rows = []
            self._length = 0
            return
        B = len(self._rows)
        dead = B - len(live)
        trim = min(self._rows[i].start for i in live)
        do_compact = dead >= 2 and dead * 4 > B
        do_trim = trim >= 32 and trim * 4 >= self._length
        if not (do_compact or do_trim):
            return
        idx = torch.tensor(live, dtype=torch.long, device=self.device)
        t0 = trim if do_trim else 0
        n = len(live)
        for layer in range(self.num_layers):
            self._K[layer][:n, :, : self._length - t0] = self._K[layer][idx, :, t0 : self._length]
            self._V[layer][:n, :, : self._length - t0] = self._V[layer][idx, :, t0 : self._length]
        self._mask[:n, : self._length - t0] = self._mask[idx, t0 : self._length]
        self._pos[:n] = self._pos[idx].clone()
        self._next[:n] = self._next[idx].clone()
        rows = [self._rows[i] for i in live]
        for r in rows:
            r.start -= t0
        self._rows = rows
        self._length -= t0
