"""Held-out evaluation: the library functions ``asyncrl eval`` (:mod:`asyncrl.evaluation.cli`) and the controller call.

Accuracy is measured on the task's held-out split (disjoint from training by problem hash,
see :mod:`asyncrl.tasks.tasks`) with the same answer extraction as the training reward
(:func:`asyncrl.tasks.rewards.check_answer`), greedily and by sampling at temperature 1.0 with
``top_p = 1``, ``top_k`` off (the RL sampling distribution). Each figure comes with ``n`` and a
95% Wilson score interval; format compliance (an ``Answer:`` line with a parseable answer) is
reported separately from correctness.

Prompts are rendered with the chat template and the assistant prefill
(:func:`asyncrl.tasks.tasks.render_prompt`); a response ends at an EOS token (the union of the
generation config's, the model config's and the tokenizer's) or after ``max_new_tokens``.
Three interchangeable generation backends (``--backend``), same prompts, decoding, stop
conditions and scoring:

``engine`` (default)
    the rollout server's embedded continuous-batching engine
    (:class:`rollout_server.engine.Engine`) in this process: up to ``batch_size`` rows decode
    together and a finished row's slot is refilled by the next prompt at once, so short
    responses do not wait for the longest one of their batch. Sampled responses use one seeded
    generator per problem (``sampling_seed = seed * 1_000_003 + problem index``), so they do
    not depend on the batch size or on which rows share a step.
``hf``
    transformers ``generate``: left-padded batches of ``batch_size`` prompts in problem order,
    KV cache on; a batch decodes until its longest response ends. Kept to compare against.
``server``
    a running SGLang or embedded HTTP server (``--server_url``) through
    :class:`rollout_server.client.EngineClient`, ``batch_size`` requests in flight; only the
    tokenizer is loaded here, and the weights are whatever the server holds.

Greedy decoding is the same argmax in every backend; batch composition changes fp32
rounding, so a near-tie between the two best tokens may break differently (tested:
tests/test_fast_eval.py). Speed of the two in-process backends on 400 sampled problems:
``bench/eval_bench.py`` (docs/tasks.md).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["BACKENDS", "EvalError", "EvalResult", "wilson_interval", "evaluate_problems", "evaluate"]

#: z for a two-sided 95% interval.
Z_95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927), default 95%.

    Returns ``(low, high)`` in [0, 1]; ``(0, 1)`` when ``n == 0``.
    """
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


@dataclass
class EvalResult:
    """Held-out accuracy of one model at one temperature.

    Attributes:
        mode: ``"greedy"`` or ``"sampled"``.
        temperature: 0.0 for greedy.
        n: problems evaluated (one response each).
        correct: responses whose extracted answer equals the gold.
        accuracy, accuracy_ci_low, accuracy_ci_high: ``correct / n`` and its 95% Wilson interval.
        format_compliance, format_ci_low, format_ci_high: share with an ``Answer:`` line, and interval.
        mean_response_tokens: mean generated tokens per response.
        truncated: responses that hit ``max_new_tokens`` without EOS.
        seconds: wall time of generation and scoring.
        backend: the generation backend (``engine``, ``hf`` or ``server``).
        batch_size: rows decoded together (engine), prompts per call (hf) or requests in flight
            (server); None in records written before it was kept.
        episodes: for a workflow's episodes (``agent.workflow``, asyncrl/evaluation/episodes.py): mean
            turns, tool calls and reward, first-call accuracy and termination counts; None otherwise.
    """

    task: str
    model: str
    mode: str
    temperature: float
    n: int
    correct: int
    accuracy: float
    accuracy_ci_low: float
    accuracy_ci_high: float
    format_compliance: float
    format_ci_low: float
    format_ci_high: float
    mean_response_tokens: float
    truncated: int
    max_new_tokens: int
    seed: int
    seconds: float
    backend: str = "engine"
    episodes: dict[str, Any] | None = None
    batch_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return asdict(self)

    def summary(self) -> str:
        """One line: ``sampled T=1.0: accuracy 23.5% [19.6, 27.9] n=400; format 80.0% ...``."""
        if self.episodes is not None:
            e = self.episodes
            return (f"{self.mode:<7} T={self.temperature:<4g} success {100 * self.accuracy:5.1f}% "
                    f"[{100 * self.accuracy_ci_low:.1f}, {100 * self.accuracy_ci_high:.1f}] n={self.n} episodes of "
                    f"{e['workflow']}; first call {100 * e['first_turn_accuracy']:.1f}%; {e['turns_mean']:.2f} turns, "
                    f"{e['tool_calls_mean']:.2f} tool calls per episode; ended {e['terminations']}; {self.seconds:.1f} s")
        return (
            f"{self.mode:<7} T={self.temperature:<4g} accuracy {100 * self.accuracy:5.1f}% "
            f"[{100 * self.accuracy_ci_low:.1f}, {100 * self.accuracy_ci_high:.1f}] n={self.n}; "
            f"format compliance {100 * self.format_compliance:5.1f}% "
            f"[{100 * self.format_ci_low:.1f}, {100 * self.format_ci_high:.1f}]; "
            f"{self.mean_response_tokens:.1f} tokens/response, {self.truncated} truncated; {self.seconds:.1f} s"
        )


#: generation backends of :func:`evaluate_problems` (see the module docstring)
BACKENDS = ("engine", "hf", "server")


class EvalError(RuntimeError):
    """Generation failed for a problem (the engine or server failed the request)."""


def _stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids ending a response: generation config, model config and tokenizer (as the engine's)."""
    ids: set[int] = set()
    sources = (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer)
    for source in (getattr(s, "eos_token_id", None) if s is not None else None for s in sources):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    if not ids:
        raise ValueError("the tokenizer and model define no EOS token: cannot tell where a response ends")
    return sorted(ids)


def _sampling_seed(seed: int, index: int) -> int:
    """Per-problem sampling seed of the engine and server backends (independent of batching)."""
    return (int(seed) * 1_000_003 + int(index)) % (2**63 - 1)


def _generate_hf(model: Any, prompts: list[list[int]], *, temperature: float, max_new_tokens: int,
                 stop_ids: list[int], pad_id: int, seed: int, batch_size: int) -> list[tuple[list[int], bool]]:
    """transformers ``generate`` over left-padded batches; ``[(response ids, truncated)]`` per prompt.

    The response ids end with the stop token when one was generated (``truncated`` False).
    """
    import torch

    gen_kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id)
    if temperature > 0:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
    else:
        gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    torch.manual_seed(seed)
    out_rows: list[tuple[list[int], bool]] = []
    for lo in range(0, len(prompts), batch_size):
        ids = prompts[lo : lo + batch_size]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids])  # (B, T) left-padded
        attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention, **gen_kwargs)
        for row in out[:, width:].tolist():
            n_tok = next((i + 1 for i, t in enumerate(row) if t in stop_ids), None)
            out_rows.append((row[: n_tok or len(row)], n_tok is None))
    return out_rows


def _generate_engine(model: Any, tokenizer: Any, prompts: list[list[int]], *, temperature: float,
                     max_new_tokens: int, stop_ids: list[int], seed: int,
                     batch_size: int) -> list[tuple[list[int], bool]]:
    """The embedded continuous-batching engine, in this process; ``[(response ids, truncated)]``.

    Raises:
        EvalError: the engine failed a request (non-finite logits, an engine error).
    """
    import threading

    from rollout_server.engine import Engine
    from rollout_server.engine_sample import EngineGroup, EngineSample
    from rollout_server.sampling import SamplingParams

    finished: set[str] = set()
    all_done = threading.Event()
    lock = threading.Lock()

    def on_update(samples: list[EngineSample]) -> None:
        with lock:
            finished.update(s.rid for s in samples if s.published[1] is not None)
            if len(finished) >= len(prompts):
                all_done.set()

    context_len = max(len(p) for p in prompts) + max_new_tokens + 1  # never cut short by the context
    engine = Engine(model, tokenizer, context_len=context_len, max_batch_size=batch_size, seed=seed,
                    on_update=on_update)
    samples = []
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=1.0, top_k=-1,
                                stop_token_ids=list(stop_ids),
                                sampling_seed=_sampling_seed(seed, i) if temperature > 0 else None)
        samples.append(EngineSample(rid=f"eval-{i}", prompt_ids=list(ids), params=params))
    engine.start()
    try:
        engine.submit(EngineGroup(list(s.prompt_ids), [s]) for s in samples)
        while not all_done.wait(1.0):
            if not engine.alive:
                raise EvalError(f"the engine thread stopped ({engine.error!r})")
    finally:
        engine.stop()
    out: list[tuple[list[int], bool]] = []
    for s in samples:
        reason = s.finish_reason or {}
        if reason.get("type") not in ("stop", "length"):
            raise EvalError(f"generation failed for held-out problem {s.rid}: {reason.get('message', reason)}")
        out.append((list(s.output_ids), reason["type"] == "length"))
    return out


def _generate_server(url: str, prompts: list[list[int]], *, temperature: float, max_new_tokens: int,
                     stop_ids: list[int], batch_size: int, api_key: str | None = None) -> list[tuple[list[int], bool]]:
    """A running SGLang/embedded server over HTTP, ``batch_size`` requests in flight.

    Raises:
        EvalError: the server cannot be reached or rejected/failed a request.
    """
    import asyncio

    from rollout_server.client import EngineClient, EngineError, EngineUnavailable

    params = {"max_new_tokens": max_new_tokens, "temperature": float(temperature), "top_p": 1.0, "top_k": -1,
              "stop_token_ids": list(stop_ids), "skip_special_tokens": True}

    async def run() -> list[tuple[list[int], bool]]:
        client = EngineClient(url, api_key=api_key)
        gate = asyncio.Semaphore(batch_size)

        async def one(i: int, ids: list[int]) -> tuple[list[int], bool]:
            async with gate:
                res = await client.generate_collect(ids, params, rid=f"eval-{i}-{time.time_ns()}")
            if res.finish_type not in ("stop", "length"):
                raise EvalError(f"{url}: generation of held-out problem {i} ended with {res.finish_reason}")
            return list(res.token_ids), res.finish_type == "length"

        try:
            return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))
        except (EngineError, EngineUnavailable) as exc:
            raise EvalError(f"evaluation through {url} failed: {exc}") from exc
        finally:
            await client.close()

    return asyncio.run(run())


def evaluate_problems(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Any],
    *,
    system_prompt: str | None,
    temperature: float,
    response_prefix: str | None = None,
    few_shot: Sequence[Any] = (),
    max_new_tokens: int,
    seed: int = 0,
    batch_size: int = 128,
    task: str = "",
    model_name: str = "",
    samples: list[dict[str, Any]] | None = None,
    backend: str = "engine",
    server_url: str | None = None,
) -> EvalResult:
    """Generate one response per problem and score it (the core of :func:`evaluate`).

    Args:
        model: a transformers causal LM (eval mode is set here); unused (may be None) with
            ``backend="server"``.
        tokenizer: its tokenizer (with a chat template).
        problems: :class:`asyncrl.tasks.base.Problem` records.
        system_prompt: system message for the chat template (``data.system_prompt``).
        response_prefix: assistant prefill template (``data.response_prefix``); the answer is
            checked on ``prefix + generated text``, as in training.
        few_shot: worked examples rendered as earlier chat turns (``data.few_shot``).
        temperature: 0 for greedy decoding, > 0 for sampling with top_p = 1 and top_k off.
        max_new_tokens: response cap in tokens.
        seed: sampling seed (``hf``: ``torch.manual_seed`` before generation, reproducible for a
            fixed batch size; ``engine``: per-problem seeds, reproducible for any batch size).
        batch_size: ``engine``: rows decoded together; ``hf``: prompts per ``generate`` call;
            ``server``: requests in flight.
        samples: when a list, one dict per problem (problem, gold, response, extracted,
            correct, format_ok, tokens) is appended to it.
        backend: ``engine`` (default), ``hf`` or ``server`` (see the module docstring).
        server_url: the server's base URL (``backend="server"`` only).

    Returns:
        An :class:`EvalResult` (``seconds``: wall time of generation and scoring).

    Raises:
        ValueError: ``temperature < 0``, ``max_new_tokens < 1``, ``batch_size < 1``, no
            problems, an unknown backend, or ``server_url`` missing/unexpected.
        EvalError: the engine or server failed a request.
    """
    from asyncrl.tasks.rewards import check_answer
    from asyncrl.tasks.tasks import render_prompt, render_response_prefix

    if temperature < 0 or max_new_tokens < 1 or batch_size < 1 or not problems:
        raise ValueError(
            f"need temperature >= 0 (got {temperature}), max_new_tokens >= 1 (got {max_new_tokens}), "
            f"batch_size >= 1 (got {batch_size}) and at least one problem (got {len(problems)})"
        )
    if backend not in BACKENDS:
        raise ValueError(f"unknown evaluation backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if (backend == "server") != (server_url is not None):
        raise ValueError("server_url is required with backend='server' and only then"
                         f" (backend {backend!r}, server_url {server_url!r})")
    start = time.perf_counter()
    if backend != "server":
        model.eval()
    stop_ids = _stop_token_ids(model if backend != "server" else None, tokenizer)
    prefixes = [render_response_prefix(response_prefix, p.metadata) for p in problems]
    prompts = [render_prompt(tokenizer, p.text, system_prompt, pre, few_shot)[1] for p, pre in zip(problems, prefixes)]
    if backend == "hf":
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
        rows = _generate_hf(model, prompts, temperature=temperature, max_new_tokens=max_new_tokens,
                            stop_ids=stop_ids, pad_id=pad_id, seed=seed, batch_size=batch_size)
    elif backend == "engine":
        rows = _generate_engine(model, tokenizer, prompts, temperature=temperature, max_new_tokens=max_new_tokens,
                                stop_ids=stop_ids, seed=seed, batch_size=batch_size)
    else:
        rows = _generate_server(str(server_url), prompts, temperature=temperature, max_new_tokens=max_new_tokens,
                                stop_ids=stop_ids, batch_size=batch_size)
    correct = fmt = tokens = truncated = 0
    for p, prefix, (row, cut) in zip(problems, prefixes, rows):
        truncated += cut
        tokens += len(row)
        response = prefix + tokenizer.decode(row, skip_special_tokens=True)
        check = check_answer(response, p.gold)
        correct += check.correct
        fmt += check.format_ok
        if samples is not None:
            samples.append(
                dict(problem=p.text, gold=p.gold, response=response, extracted=check.extracted,
                     correct=check.correct, format_ok=check.format_ok, tokens=len(row))
            )
    n = len(problems)
    acc_lo, acc_hi = wilson_interval(correct, n)
    fmt_lo, fmt_hi = wilson_interval(fmt, n)
    return EvalResult(
        task=task, model=model_name, mode="sampled" if temperature > 0 else "greedy",
        temperature=float(temperature), n=n, correct=int(correct), accuracy=correct / n,
        accuracy_ci_low=acc_lo, accuracy_ci_high=acc_hi, format_compliance=fmt / n,
        format_ci_low=fmt_lo, format_ci_high=fmt_hi, mean_response_tokens=tokens / n,
        truncated=int(truncated), max_new_tokens=max_new_tokens, seed=seed,
        seconds=time.perf_counter() - start, backend=backend, batch_size=batch_size,
    )


def evaluate(
    model_path: str | Path,
    data: Any,
    *,
    num_problems: int = 400,
    temperatures: Sequence[float] = (0.0, 1.0),
    seed: int = 0,
    max_new_tokens: int = 64,
    batch_size: int = 128,
    threads: int | None = 2,
    samples: list[dict[str, Any]] | None = None,
    backend: str = "engine",
    server_url: str | None = None,
) -> list[EvalResult]:
    """Held-out accuracy of a model at each temperature (0 = greedy).

    Args:
        model_path: a name prepared by ``asyncrl models prepare`` or a local HF directory
            (a published-weights or checkpoint directory holding ``config.json``); with
            ``backend="server"`` only its tokenizer is loaded.
        data: the ``data`` config section (task, difficulty, system prompt, file path).
        num_problems: held-out problems per temperature (the first ``num_problems`` of the split).
        temperatures: e.g. ``(0.0, 1.0)`` for greedy and sampled.
        batch_size: see :func:`evaluate_problems`.
        threads: ``torch.set_num_threads`` (None leaves torch's default).
        backend, server_url: see :func:`evaluate_problems`.

    Returns:
        One :class:`EvalResult` per temperature, in order.

    Raises:
        asyncrl.tasks.tasks.TaskError: the task cannot supply ``num_problems`` held-out problems.
        FileNotFoundError / ValueError: from model loading (missing or corrupt model), or bad arguments.
        EvalError: the engine or server failed a request.
    """
    import torch

    from asyncrl.models import load_causal_lm, load_tokenizer, resolve_model_path
    from asyncrl.tasks.tasks import load_task

    if backend not in BACKENDS:
        raise ValueError(f"unknown evaluation backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if threads:
        torch.set_num_threads(threads)
    problems = load_task(data).heldout(num_problems)
    path = resolve_model_path(str(model_path))
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path) if backend != "server" else None
    return [
        evaluate_problems(
            model, tokenizer, problems, system_prompt=data.system_prompt,
            response_prefix=data.response_prefix, few_shot=data.few_shot, temperature=t,
            max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size, task=data.task,
            model_name=str(server_url or model_path), samples=samples, backend=backend, server_url=server_url,
        )
        for t in temperatures
    ]
