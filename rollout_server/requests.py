"""What the embedded server reads and writes: /generate parsing, response objects, JSON bodies, detokenizing.

One job: the shapes of SGLang's native API (the subset in docs/rollout.md, "HTTP API") as the
embedded engine speaks it. :func:`parse_generate` validates a ``/generate`` body (its schema is
:class:`rollout_server.schemas.GenerateBody`) into prompt groups (any problem is a
:class:`RequestError`, a 400 before anything reaches the engine); :func:`read_body` reads any
other endpoint's body through its schema;
:func:`response_object` shapes one output (``_handle_batch_output``'s shape, with ``[logprob,
id, null]`` triples and per-token weight-version spans); :class:`IncrementalDetokenizer`
decodes a growing stream in O(length) total work.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rollout_server.engine import Engine
from rollout_server.engine_sample import EngineGroup, EngineSample
from rollout_server.limits import BodyError, BodyReader
from rollout_server.sampling import RequestError, SamplingParams
from rollout_server.schemas import (
    MAX_LORA_NAME_CHARS,
    GenerateBody,
    SamplingParamsBody,
    parse_body,
    parse_json,
    validate_body,
)

__all__ = [
    "GENERATE_KEYS",
    "GenerateLimits",
    "IncrementalDetokenizer",
    "decode_output",
    "dumps",
    "encode_text",
    "max_token_bytes",
    "error_response",
    "parse_generate",
    "read_body",
    "refused",
    "request_cost",
    "response_object",
    "version_spans",
    "weight_version_of",
]

#: every field SGLang's ``GenerateReqInput`` accepts; others are a 400
GENERATE_KEYS = frozenset(GenerateBody.model_fields)


def error_response(message: str, status: int = 400) -> web.Response:
    """SGLang's error shape: ``{"error": {"message": ...}}``."""
    return web.json_response({"error": {"message": message}}, status=status)


def refused(exc: RequestError) -> web.Response:
    """The error response of a refused request: 400, or the status a :class:`BodyError` carries (413, 408).

    A refused body may be partly unread: the connection is closed after the answer.
    """
    resp = error_response(str(exc), getattr(exc, "status", 400))
    if isinstance(exc, BodyError):
        resp.force_close()
    return resp


def dumps(obj: Any) -> str:
    """Strict JSON; a NaN/inf (e.g. a ``-inf`` top logprob of a token masked by ``min_new_tokens``)
    becomes ``null`` instead of an exception that would break a stream mid-response."""
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite_or_none(obj), separators=(",", ":"), allow_nan=False)


def _finite_or_none(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


async def read_body(request: web.Request, schema: type, reader: BodyReader, *, allow_empty: bool = True,
                    context: dict | None = None, what: str = "") -> Any:
    """The body of ``request`` validated by ``schema`` (a :mod:`rollout_server.schemas` model).

    ``reader`` bounds the body's size and arrival time and parses a big body off the event loop.

    Raises:
        BodyError: the body is too large (413) or too slow (408).
        RequestError: not JSON, not an object, or not valid for ``schema`` (the message names the field).
    """
    raw = await reader.read(request)
    return await reader.run(len(raw), parse_body, schema, raw, allow_empty=allow_empty, context=context, what=what)


@dataclass(frozen=True)
class GenerateLimits:
    """What :func:`parse_generate` bounds besides the schema (docs/rollout.md#limits).

    Attributes:
        max_prompts: most prompts in one batch.
        max_top_logprobs_num: largest ``top_logprobs_num``.
        max_request_cost: most output entries of one request (:func:`request_cost`).
        max_text_bytes: most UTF-8 bytes of one ``text`` prompt: the context length times the
            longest token's bytes (a longer text cannot fit the context, so it is refused
            before it is tokenized); None: no text bound.
    """

    max_prompts: int = 128
    max_top_logprobs_num: int = 20
    max_text_bytes: int | None = None
    max_request_cost: int = 1 << 20


#: an error naming the loaded adapters lists at most this many
MAX_NAMED_ADAPTERS = 16


def _validate_generate(raw: bytes, vocab_size: int, max_top: int) -> GenerateBody:
    return validate_body(GenerateBody, parse_json(raw), what="/generate request",
                         context={"vocab_size": vocab_size, "max_top_logprobs_num": max_top})


async def parse_generate(raw: bytes, eng: Engine, tokenizer: Any, reader: BodyReader,
                         limits: GenerateLimits = GenerateLimits()) -> tuple[list[EngineGroup], list[EngineSample], bool, bool]:
    """Validate a raw /generate body into prompt groups; returns (groups, samples, is_batch, stream).

    The body's shape is :class:`rollout_server.schemas.GenerateBody`; what needs the engine
    (context length, ``n`` against ``max_running_requests``, rids still running) and ``limits``
    are checked here. Sizes are checked before work: a big body is parsed, and every ``text``
    tokenized, on ``reader``'s executor, never on the event loop.

    Raises:
        RequestError: any problem (the message names the field and says what to fix).
    """
    req = await reader.run(len(raw), _validate_generate, raw, eng.vocab_size, limits.max_top_logprobs_num)
    texts, ids, is_batch = req.prompts()
    nb = len(texts if texts is not None else ids)
    if nb > limits.max_prompts:
        raise RequestError(f"the batch has {nb} prompts; at most {limits.max_prompts} per request (the server's "
                           "--max-prompts-per-request, rollout.engine_max_prompts_per_request): split it")
    if texts is not None:
        if tokenizer is None:
            raise RequestError("text input needs a tokenizer; send input_ids")
        for i, t in enumerate(texts):
            size = len(t.encode("utf-8", "surrogatepass"))
            if limits.max_text_bytes is not None and size > limits.max_text_bytes:
                raise RequestError(
                    f"text{f'[{i}]' if is_batch else ''} has {size} bytes: more than the model's context of "
                    f"{eng.context_len} tokens can hold (at most {limits.max_text_bytes} bytes); shorten it")
        prompts = await reader.off_loop(lambda: [encode_text(tokenizer, t) for t in texts])
    else:
        prompts = ids
    nb = len(prompts)
    sp = req.sampling_params
    if isinstance(sp, list):
        if len(sp) != nb:
            raise RequestError(f"sampling_params has {len(sp)} entries for a batch of {nb}")
        params = [x.to_params() for x in sp]
    else:
        params = [(sp if sp is not None else SamplingParamsBody()).to_params()] * nb
    if tokenizer is None and any(p.stop or p.min_new_tokens for p in params):
        raise RequestError("stop strings and min_new_tokens need the tokenizer (server runs --skip-tokenizer-init)")
    rl = req.return_logprob
    rl = rl if isinstance(rl, list) else [rl] * nb
    if len(rl) != nb:
        raise RequestError(f"return_logprob has {len(rl)} entries for a batch of {nb}")
    lsl, tln, stream, rid = req.logprob_start_len, req.top_logprobs_num, req.stream, req.rid
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if len(prompt) >= eng.context_len or len(prompt) + p.max_new_tokens > eng.context_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {eng.context_len} tokens. "
                f"You requested a total of {len(prompt) + p.max_new_tokens} tokens: {len(prompt)} tokens from the "
                f"input and {p.max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
                "the input or the completion."
            )
        if p.n > eng.max_request_rows:
            raise RequestError(f"sampling_params.n={p.n} exceeds {eng.max_request_rows}, the most samples one request "
                               f"may have on this server (max_running_requests {eng.max_batch_size} less the "
                               f"{eng.reserve_rows} rows kept for other requests, --fair-reserve-rows)")
    names = req.lora_names(nb)
    unknown = sorted({n for n in names if n is not None and n not in eng.named_adapters})
    if unknown:  # SGLang's words (its LoRARegistry.acquire), also a 400 there
        loaded = sorted(list(eng.named_adapters))[:MAX_NAMED_ADAPTERS]
        raise RequestError(f"The following requested LoRA adapters are not loaded: {unknown[0][:MAX_LORA_NAME_CHARS]}"
                           f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; loaded adapters: {loaded}"
                           " (/load_lora_adapter registers one)")
    total = sum(p.n for p in params)
    cost = request_cost(params, rl, tln)
    if cost > limits.max_request_cost:
        raise RequestError(
            f"the request costs {cost} output entries (samples x max_new_tokens x logprob width, where the width is "
            f"2 + top_logprobs_num with return_logprob, else 1); at most {limits.max_request_cost} per request (the "
            "server's --max-request-cost): send fewer samples, fewer max_new_tokens or a smaller top_logprobs_num")
    if rid is None:
        base = uuid.uuid4().hex
        rids = [base] if total == 1 else [f"{base}_{i}" for i in range(total)]
    elif isinstance(rid, str):
        rids = [rid] if total == 1 else [f"{rid}_{i}" for i in range(total)]
    else:
        if len(rid) != nb:
            raise RequestError(f"The rid should be a list of length {nb} (batch size), got {len(rid)}")
        rids = [r if params[i].n == 1 else f"{r}_{j}" for i, r in enumerate(rid) for j in range(params[i].n)]
    if len(set(rids)) != len(rids):
        raise RequestError("Duplicate request IDs in one batch")
    dup = [r for r in rids if eng.has_rid(r)]
    if dup:
        raise RequestError(f"Duplicate request ID {dup[0]!r}: a request with this rid is still running")
    groups, samples = [], []
    k = 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        group = []
        for _ in range(p.n):
            s = EngineSample(
                rid=rids[k], prompt_ids=list(prompt), params=p, return_logprob=bool(rl[i]),
                top_logprobs_num=tln if rl[i] else 0, logprob_start_len=lsl, index=k, lora_name=names[i],
            )
            k += 1
            group.append(s)
        groups.append(EngineGroup(list(prompt), group))
        samples += group
    return groups, samples, is_batch or total > 1, stream


def request_cost(params: list[SamplingParams], return_logprob: list[bool], top_logprobs_num: int) -> int:
    """The output entries a request may produce: sum over prompts of ``n x max_new_tokens x width``.

    ``width`` is ``2 + top_logprobs_num`` with ``return_logprob`` (the id, its logprob, the top
    entries), else 1 (the id). Bounded by ``--max-request-cost`` (issue #31 item 1): the response,
    and the work of streaming it, is proportional to this.
    """
    return sum(p.n * p.max_new_tokens * ((2 + top_logprobs_num) if rl else 1) for p, rl in zip(params, return_logprob))


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes one token of ``tokenizer`` stands for (its longest vocabulary entry).

    Byte-level BPE spells each byte as one character of at most 2 UTF-8 bytes, SentencePiece spells
    text as itself (with ``\u2581`` for a space), so a vocabulary entry's own UTF-8 length is never
    below the bytes it decodes to.
    """
    return max((len(k.encode("utf-8", "surrogatepass")) for k in tokenizer.get_vocab()), default=1) or 1


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added beyond the tokenizer's defaults).

    Raises:
        RequestError: no tokenizer (``--skip-tokenizer-init``), or the text encodes to nothing.
    """
    if tokenizer is None:
        raise RequestError("text input needs a tokenizer; send input_ids")
    try:
        ids = tokenizer(text)["input_ids"]
    except Exception as exc:  # e.g. a lone surrogate ("\\ud800") the tokenizer cannot encode
        raise RequestError(f"text could not be tokenized: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not ids:
        raise RequestError("text encodes to no tokens")
    return list(ids)


def response_object(
    s: EngineSample, snap: tuple, start: int, final: bool, incremental: bool, *, with_text: bool,
    current_version: str, text_prev: str = "", text_now: str = "", spliced: bool = False,
) -> dict:
    """One response object (SGLang ``_handle_batch_output`` shape) for tokens ``[start, n)``.

    ``text_now`` is the decoded output so far; in incremental mode ``text`` is its part after
    ``text_prev`` (what earlier chunks carried). ``with_text``: the server has a tokenizer (the
    object carries ``text``); ``current_version``: the engine's weight version now. ``spliced``:
    the per-token arrays (``output_ids``, ``output_token_logprobs``, ``output_top_logprobs``) are
    placeholders that :meth:`CumulativeArrays.chunk` replaces with their cached JSON text.
    """
    n, fin = snap
    ids = _SPLICE["output_ids"] if spliced else s.output_ids[:n]
    meta: dict[str, Any] = {
        "id": s.rid,
        "finish_reason": fin,
        "prompt_tokens": len(s.prompt_ids),
        "weight_version": weight_version_of(s, n, current_version),
        "num_retractions": s.num_retractions,
        "completion_tokens": n,
        "cached_tokens": s.cached_tokens,
        "weight_versions": version_spans(s.version_starts, n),
    }
    if s.adapter is not None:  # asyncrl's: the named adapter that generated these tokens (engine_lora.py)
        meta["lora_path"] = s.adapter.name
    if final:
        meta["e2e_latency"] = (s.finished_time or time.time()) - s.created_time
    if s.return_logprob:
        meta["output_token_logprobs"] = (_SPLICE["output_token_logprobs"] if spliced
                                         else _token_logprobs(s.output_logprobs[start:n], ids[start:]))
        meta["output_token_logprobs_length"] = n - start
        meta["input_token_logprobs"] = (s.input_token_logprobs or []) if (start == 0 or not incremental) else []
        if s.top_logprobs_num:
            meta["output_top_logprobs"] = (_SPLICE["output_top_logprobs"] if spliced
                                           else _top_logprobs(s.output_top_logprobs[start:n]))
    if incremental:
        text = text_now[len(text_prev):] if text_now.startswith(text_prev) else ""
    else:
        text = text_now
    out: dict[str, Any] = {"output_ids": ids if spliced else ids[start:], "meta_info": meta}
    if with_text:
        out = {"text": text, **out}
    return out


def _token_logprobs(lps: list[float], ids: list[int]) -> list[list]:
    """SGLang's ``[logprob, token id, null]`` triples."""
    return [[lp, t, None] for lp, t in zip(lps, ids)]


def _top_logprobs(rows: list) -> list[list[list]]:
    """Per token, its top logprobs as ``[logprob, token id, null]`` triples (a missing row: ``[]``)."""
    return [[[lp, t, None] for lp, t in (row or [])] for row in rows]


#: placeholders for the per-token arrays of a spliced response object (:class:`CumulativeArrays`);
#: the NUL bytes and the per-process nonce keep generated text from ever matching one
_SPLICE_NONCE = uuid.uuid4().hex
_SPLICE = {k: f"\x00asyncrl-splice-{_SPLICE_NONCE}-{k}\x00"
           for k in ("output_ids", "output_token_logprobs", "output_top_logprobs")}
_SPLICE_JSON = {k: json.dumps(v) for k, v in _SPLICE.items()}


class CumulativeArrays:
    """The JSON text, so far, of one sample's per-token arrays in a cumulative stream.

    A cumulative SSE chunk resends the whole output (SGLang's default streaming mode). Built from
    Python objects each time, a maximal request's stream (56 samples x 851 tokens x 20 top
    logprobs) cost 8.5x the CPU of its final response, under the GIL the engine thread needs
    (issue 31 item 1). Here each token is serialised once: :meth:`chunk` serialises the tokens
    added since the last chunk, appends their text to the cache, and splices the cached arrays
    into the chunk's object, so a stream's serialising work is linear in its output and only the
    copying of bytes grows with the number of chunks. The bytes are those of
    ``dumps(response_object(..., incremental=False))``: same keys, order and separators, a
    non-finite logprob as ``null`` (tested against it).

    Memory: about the size of the final response per sample, held until the stream ends.
    """

    __slots__ = ("n", "ids", "lps", "tops")

    def __init__(self) -> None:
        self.n = 0
        self.ids = self.lps = self.tops = ""

    def _extend(self, s: EngineSample, n: int) -> None:
        if n < self.n:  # output never shrinks (append-only); rebuild rather than trust a stale cache
            self.__init__()
        a = self.n
        if n == a:
            return
        new_ids = s.output_ids[a:n]
        self.ids = _append(self.ids, dumps(new_ids))
        if s.return_logprob:
            self.lps = _append(self.lps, dumps(_token_logprobs(s.output_logprobs[a:n], new_ids)))
            if s.top_logprobs_num:
                self.tops = _append(self.tops, dumps(_top_logprobs(s.output_top_logprobs[a:n])))
        self.n = n

    def chunk(self, s: EngineSample, snap: tuple, *, with_text: bool, current_version: str, text_now: str = "",
              extra: dict | None = None) -> str:
        """The JSON of the cumulative response object of ``s`` at ``snap`` = (n, finish), with
        ``extra`` keys (e.g. ``index``) added at its end, as ``dumps`` would write them."""
        n, fin = snap
        self._extend(s, n)
        out = response_object(s, snap, 0, final=fin is not None, incremental=False, with_text=with_text,
                              current_version=current_version, text_now=text_now, spliced=True)
        if extra:
            out.update(extra)
        text = dumps(out)
        # last placeholder first: each search then crosses only the small, unspliced part
        if s.return_logprob:
            if s.top_logprobs_num:
                text = text.replace(_SPLICE_JSON["output_top_logprobs"], "[" + self.tops + "]", 1)
            text = text.replace(_SPLICE_JSON["output_token_logprobs"], "[" + self.lps + "]", 1)
        return text.replace(_SPLICE_JSON["output_ids"], "[" + self.ids + "]", 1)


def _append(prefix: str, array_json: str) -> str:
    """``prefix`` (the inside of a JSON array) extended by the elements of ``array_json`` (a JSON array)."""
    inner = array_json[1:-1]
    if not inner:
        return prefix
    return prefix + "," + inner if prefix else inner

def decode_output(tokenizer: Any, s: EngineSample, ids: list[int], fin: dict | None) -> str:
    """The text of output ``ids``, with a matched stop token or stop string trimmed unless ``no_stop_trim``."""
    p = s.params
    if fin and fin.get("type") == "stop" and isinstance(fin.get("matched"), int) and not p.no_stop_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens,
                             spaces_between_special_tokens=p.spaces_between_special_tokens)
    if fin and fin.get("type") == "stop" and isinstance(fin.get("matched"), str) and not p.no_stop_trim:
        pos = text.find(fin["matched"])
        if pos != -1:
            text = text[:pos]
    return text

def weight_version_of(s: EngineSample, n: int, current_version: str) -> str:
    """The weight version of the last of the first ``n`` output tokens (``current_version`` if none)."""
    spans = s.version_starts
    if n and spans:
        last = [v for v, st in spans if st < n]
        if last:
            return last[-1]
    return current_version


def version_spans(version_starts: list[tuple[str, int]], n: int) -> list[dict]:
    """Half-open output-index spans of each weight version, clipped to ``n`` tokens."""
    out = []
    for i, (v, st) in enumerate(version_starts):
        if st >= n:
            break
        end = version_starts[i + 1][1] if i + 1 < len(version_starts) else n
        out.append({"version": v, "start": st, "end": min(end, n)})
    return out


class IncrementalDetokenizer:
    """Decodes a growing token list in O(length) total work (vLLM/SGLang's offsets scheme).

    Each call decodes only the tokens since the last emitted text plus one window of context,
    and holds back an incomplete UTF-8 sequence (a trailing U+FFFD) until it completes.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams):
        self.tok = tokenizer
        self.kw = {"skip_special_tokens": params.skip_special_tokens,
                   "spaces_between_special_tokens": params.spaces_between_special_tokens}
        self.prefix = 0
        self.read = 0
        self.text = ""

    def feed(self, ids: list[int]) -> str:
        """The text of ``ids`` (which extends the previous call's list) as far as it is final."""
        if len(ids) <= self.read:
            return self.text
        before = self.tok.decode(ids[self.prefix : self.read], **self.kw)
        after = self.tok.decode(ids[self.prefix :], **self.kw)
        if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(ids)
        return self.text
