"""How the embedded engine turns logits into output: sampling, appended tokens, and when a sample ends.

One job: a sample's output bookkeeping. :class:`EngineOutputs` is a mixin of
:class:`rollout_server.engine.Engine`: it samples next tokens (a row whose logits or sampling
distribution are not finite fails alone with a 500 naming it, and so does a row whose own
parameters make sampling or its stop rules raise), appends tokens, logprobs and
the weight version that produced them, applies the stop-token, stop-string, ``max_new_tokens``
and context-length rules, finishes samples, and computes prompt logprobs.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from rollout_server.sampling import NonFiniteLogits, sample_tokens

if TYPE_CHECKING:
    from rollout_server.engine_sample import EngineSample

__all__ = ["EngineOutputs", "eos_ids"]

#: the engine's logger: a request failing on non-finite logits is logged as the engine's error
log = logging.getLogger("rollout_server.engine")


class EngineOutputs:
    """Sampling and per-sample output (mixin of :class:`rollout_server.engine.Engine`).

    Expects ``torch``, ``tokenizer``, ``generator``, ``eos_ids``, ``context_len``,
    ``weight_version``, ``stats``, ``_live``, ``_rows``, ``_finished_unpublished``,
    ``_throughput_window`` and ``_maybe_compact()`` on the engine.
    """

    def _finish(self, s: EngineSample, reason: dict) -> None:
        s.finish_reason = reason
        s.finished_time = time.time()
        self._live.pop(s.rid, None)
        self._finished_unpublished.append(s)  # published by the next _publish, even if this step fails later

    def _prompt_logprobs(self, items: list[Any], logits_all: Any, L: int) -> None:
        """Fill ``input_token_logprobs`` of the samples asking ``logprob_start_len >= 0`` from the
        prefill's logits ``(P, L, V)`` (rows left-padded to width ``L``)."""
        torch = self.torch
        lsm = torch.log_softmax(logits_all, dim=-1)
        for i, it in enumerate(items):
            n = len(it.ids)
            for s in it.samples:
                if s.return_logprob and s.logprob_start_len >= 0 and s.input_token_logprobs is None:
                    prompt = s.prompt_ids
                    k = min(s.logprob_start_len, len(prompt))
                    base = L - n  # column of the first prompt token
                    vals = []
                    for j in range(k, len(prompt)):
                        if j == 0:
                            vals.append([None, prompt[0], None])
                        else:
                            vals.append([float(lsm[i, base + j - 1, prompt[j]]), prompt[j], None])
                    if vals and vals[0][0] is not None:
                        vals[0][0] = None  # SGLang always pads the first one with None
                    s.input_token_logprobs = vals

    def _sample(self, logits, samples: list[EngineSample]):
        """:func:`sample_tokens`, failing (500) the samples whose distribution is invalid.

        Returns ``(tokens, logprobs, tops, failed)`` for the samples not in ``failed``, in order.
        """
        torch = self.torch
        failed: list[EngineSample] = []
        while samples:
            try:
                tokens, lps, tops = sample_tokens(logits, samples, self._stop_ids, self.generator)
                return tokens, lps, tops, failed
            except NonFiniteLogits as exc:
                bad = set(exc.rows)
                failed += self._fail_nonfinite([samples[k] for k in exc.rows], "sampling (after penalties, logit bias and temperature)")
                keep = [k for k in range(len(samples)) if k not in bad]
                samples = [samples[k] for k in keep]
                logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)] if keep else logits[:0]
            except Exception as exc:  # a request's own parameters made sampling raise: find it, fail it alone
                if len(samples) == 1:
                    failed += self._fail_requests(samples, exc, "sampling its next token")
                    return [], [], [], failed
                return self._sample_rows(logits, samples, failed)
        return [], [], [], failed

    def _sample_rows(self, logits, samples: list[EngineSample], failed: list[EngineSample]):
        """:meth:`_sample` one row at a time (after a batched call raised): the rows that raise
        on their own fail alone, the others get their tokens."""
        tokens: list[int] = []
        lps: list[float] = []
        tops: list[Any] = []
        for k, s in enumerate(samples):
            t, lp, top, bad = self._sample(logits[k : k + 1], [s])
            failed += bad
            tokens += t
            lps += lp
            tops += top
        return tokens, lps, tops, failed

    def _fail_requests(self, samples: list[EngineSample], exc: BaseException, where: str) -> list[EngineSample]:
        """End ``samples`` with a 500 naming them and ``exc``: their own data made the engine raise in ``where``."""
        for s in samples:
            message = (
                f"engine error: request {s.rid} failed in {where}: {type(exc).__name__}: {exc} (prompt "
                f"{len(s.prompt_ids)} tokens, output {len(s.output_ids)} tokens); only this request failed"
            )
            log.error(message, exc_info=(type(exc), exc, exc.__traceback__))
            self._finish(s, {"type": "abort", "message": message, "status_code": 500, "err_type": "InternalServerError"})
        self.stats["request_errors_total"] += len(samples)
        return list(samples)

    def _nonfinite_rows(self, logits) -> list[int]:
        """Indices of the rows of ``logits`` ``(R, V)`` that hold a NaN or an infinity."""
        torch = self.torch
        # a row's sum is finite when all its entries are (one pass, no (R, V) bool tensor); a
        # non-finite sum of finite entries (an overflow) is told apart by the exact test
        sums_ok = torch.isfinite(logits.sum(dim=-1))
        if bool(sums_ok.all()):
            return []
        ok = torch.isfinite(logits).all(dim=-1)
        if bool(ok.all()):
            return []
        return [int(i) for i in torch.nonzero(~ok).flatten()]

    def _fail_nonfinite(self, samples: list[EngineSample], where: str) -> list[EngineSample]:
        """End ``samples`` with a 500: the model produced non-finite logits for them."""
        for s in samples:
            message = (
                f"engine error: the model produced non-finite logits (NaN or inf) for request {s.rid} in "
                f"{where} (prompt {len(s.prompt_ids)} tokens, output {len(s.output_ids)} tokens, weight "
                f"version {self.weight_version}); only this request failed"
            )
            log.error(message)
            self._finish(s, {"type": "abort", "message": message, "status_code": 500, "err_type": "InternalServerError"})
        self.stats["nonfinite_logits_total"] += len(samples)
        return list(samples)

    def _stop_ids(self, s: EngineSample) -> set[int]:
        return set(s.params.stop_token_ids) | self.eos_ids

    def _append_tokens(self, samples, tokens, lps, tops, slots) -> list[EngineSample]:
        now = time.time()
        version = self.weight_version
        finished_any = False
        for s, tok, lp, top, slot in zip(samples, tokens, lps, tops, slots):
            if not s.version_starts or s.version_starts[-1][0] != version:
                s.version_starts.append((version, len(s.output_ids)))
            s.output_ids.append(tok)
            s.output_logprobs.append(lp)
            if s.top_logprobs_num:
                s.output_top_logprobs.append(top)
            if s.first_token_time is None:
                s.first_token_time = now
            try:
                reason = self._finish_rule(s, tok)
            except Exception as exc:  # e.g. a stop string the tokenizer cannot handle: this request only
                self._fail_requests([s], exc, "checking its stop conditions")
                self._rows[slot] = None
                finished_any = True
                continue
            if reason is not None:
                # kept for a later call that extends this one (prompt_cache.py) before the sample is
                # marked finished: whoever sees it finished (the HTTP answer, a waiting test) and
                # sends the next call finds its keys/values already there
                try:
                    self._remember_context(s, slot)
                except Exception:  # an optimisation only (e.g. no memory for the copy): the sample still finishes
                    log.warning("could not keep request %s in the context cache", s.rid, exc_info=True)
                self._finish(s, reason)
                self._rows[slot] = None
                finished_any = True
        self.stats["generation_tokens_total"] += len(tokens)
        self._throughput_window.append((time.monotonic(), len(tokens)))
        if finished_any:
            self._maybe_compact()
        return list(samples)

    def _finish_rule(self, s: EngineSample, tok: int) -> dict | None:
        """The finish reason of ``s`` after appending ``tok`` (stop token, stop string, length), or None."""
        p = s.params
        if not p.ignore_eos and (tok in self.eos_ids or tok in p.stop_token_ids):
            return {"type": "stop", "matched": tok}
        if p.stop and self.tokenizer is not None:
            matched = self._match_stop_string(s)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        if len(s.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(s.prompt_ids) + len(s.output_ids) >= self.context_len:
            return {"type": "length", "length": len(s.output_ids)}
        return None

    def _match_stop_string(self, s: EngineSample) -> str | None:
        """Decode the tail of the output and look for a stop string that ends in the new text."""
        p = s.params
        longest = max(len(x) for x in p.stop)
        tail_ids = s.output_ids[max(0, len(s.output_ids) - longest - 8) :]
        text = self.tokenizer.decode(tail_ids, skip_special_tokens=p.skip_special_tokens)
        prev = self.tokenizer.decode(tail_ids[:-1], skip_special_tokens=p.skip_special_tokens)
        # only matches that end inside the newly decoded part count (earlier ones were checked)
        common = 0
        while common < min(len(prev), len(text)) and prev[common] == text[common]:
            common += 1
        for stop in p.stop:
            pos = text.find(stop, max(0, common - len(stop) + 1))
            if pos != -1:
                return stop
        return None


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """EOS token ids from the generation config, the model config and the tokenizer."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids
