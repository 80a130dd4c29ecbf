"""One sample's side of an SSE ``/generate`` stream: what it has sent, and its next chunk.

The HTTP layer (rollout_server/server.py) asks each :class:`SampleStream` whether a chunk is due
(chunk spacing, issue #18 and #31 item 1) and builds the due chunks, off the event loop when big.
Incremental streams send the tokens since the last chunk; cumulative streams (SGLang's default)
resend every token, each serialised once (:class:`rollout_server.requests.CumulativeArrays`).
"""

from __future__ import annotations

from typing import Any

from rollout_server.engine_sample import EngineSample
from rollout_server.requests import CumulativeArrays, IncrementalDetokenizer, decode_output, dumps, response_object

__all__ = ["CUMULATIVE_GROWTH", "SampleStream"]

#: a cumulative stream's next chunk waits until its output grew by 1/this (rounded up): the chunks
#: before the last grow geometrically by at least ``1 + 1/this``, so they add up to at most ``this + 1``
#: times the longest of them, which can be one token short of the final response; with the final
#: chunk a stream sends at most about ``this + 2`` times its final response, whatever its length
#: (issue #31 item 1)
CUMULATIVE_GROWTH = 8


class SampleStream:
    """The stream state of one sample: tokens and text sent, its detokenizer, its cached arrays.

    Args:
        sample: the engine sample.
        tokenizer: the server's tokenizer (None: no ``text`` in chunks).
        incremental: incremental chunks (else cumulative).
        multi: the request has several samples (chunks carry ``index``).
    """

    def __init__(self, sample: EngineSample, tokenizer: Any, incremental: bool, multi: bool):
        self.sample, self.tokenizer, self.incremental, self.multi = sample, tokenizer, incremental, multi
        self.sent = 0  # tokens carried by earlier chunks
        self.text_sent = ""
        self.done = False
        self.detok = IncrementalDetokenizer(tokenizer, sample.params) if tokenizer is not None else None
        self.arrays = None if incremental else CumulativeArrays()

    def due(self, stream_interval: int, cumulative_entries: int) -> tuple[int, dict | None] | None:
        """The snapshot ``(n, finish)`` to send now, or None while the chunk spacing says wait.

        A cumulative chunk resends everything, so they are spaced by what they carry: at least
        ``sent × (1 + top_logprobs_num) / cumulative_entries`` and ``sent / CUMULATIVE_GROWTH`` new tokens,
        both rounded up (rounded down, ``sent // 8`` let chunks of 8–15 tokens grow by one token each,
        less than the 1/8 the bound on a stream's bytes assumes).
        """
        if self.done:
            return None
        s = self.sample
        n, fin = s.published
        gap = s.params.stream_interval or stream_interval
        if not self.incremental:
            per_token = 1 + (s.top_logprobs_num if s.return_logprob else 0)
            gap = max(gap, -(-self.sent * per_token // cumulative_entries), -(-self.sent // CUMULATIVE_GROWTH))
        if fin is None and (n == 0 or n - self.sent < gap):
            return None
        return n, fin

    def chunk(self, n: int, fin: dict | None, version: str) -> bytes:
        """The SSE bytes of this sample's chunk at ``(n, fin)``; ``version``: the engine's weight version now."""
        s = self.sample
        text_now = ""
        if self.tokenizer is not None:
            ids = s.output_ids[:n]
            text_now = decode_output(self.tokenizer, s, ids, fin) if fin is not None else self.detok.feed(ids)
        start, text_prev = self.sent, self.text_sent
        self.sent, self.text_sent = n, text_now
        if fin is not None:
            self.done = True
            if fin.get("status_code") in (500, 503):  # engine failure: SGLang streams an error object
                return b"data: " + dumps({"error": {"message": fin.get("message", "engine error")}}).encode() + b"\n\n"
        extra = {"index": s.index} if self.multi else None
        with_text = self.tokenizer is not None
        if self.arrays is not None:  # cumulative: every token so far, each serialised once
            text = self.arrays.chunk(s, (n, fin), with_text=with_text, current_version=version,
                                     text_now=text_now, extra=extra)
        else:  # incremental: the tokens since the last chunk
            out = response_object(s, (n, fin), start, final=fin is not None, incremental=True, with_text=with_text,
                                  current_version=version, text_prev=text_prev, text_now=text_now)
            text = dumps({**out, **extra} if extra else out)
        return b"data: " + text.encode() + b"\n\n"
