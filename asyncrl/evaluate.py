"""Held-out evaluation: ``asyncrl eval`` and the library function the controller calls.

Accuracy is measured on the task's held-out split (disjoint from training by problem hash,
see :mod:`asyncrl.tasks`) with the same answer extraction as the training reward
(:func:`asyncrl.rewards.check_answer`), greedily and by sampling at temperature 1.0 with
``top_p = 1``, ``top_k`` off (the RL sampling distribution). Each figure comes with ``n`` and a
95% Wilson score interval; format compliance (an ``Answer:`` line with a parseable answer) is
reported separately from correctness.

Generation is plain transformers ``generate`` on CPU: prompts rendered with the chat template,
left-padded batches, KV cache on, stop at EOS or ``max_new_tokens``. Simplified: no continuous
batching (the rollout engine has it); batches are formed in problem order.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["EvalResult", "wilson_interval", "evaluate_problems", "evaluate", "main"]

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

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return asdict(self)

    def summary(self) -> str:
        """One line: ``sampled T=1.0: accuracy 23.5% [19.6, 27.9] n=400; format 80.0% ...``."""
        return (
            f"{self.mode:<7} T={self.temperature:<4g} accuracy {100 * self.accuracy:5.1f}% "
            f"[{100 * self.accuracy_ci_low:.1f}, {100 * self.accuracy_ci_high:.1f}] n={self.n}; "
            f"format compliance {100 * self.format_compliance:5.1f}% "
            f"[{100 * self.format_ci_low:.1f}, {100 * self.format_ci_high:.1f}]; "
            f"{self.mean_response_tokens:.1f} tokens/response, {self.truncated} truncated; {self.seconds:.1f} s"
        )


def _stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    if not ids:
        raise ValueError("the tokenizer and model define no EOS token: cannot tell where a response ends")
    return sorted(ids)


def evaluate_problems(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Any],
    *,
    system_prompt: str | None,
    temperature: float,
    response_prefix: str | None = None,
    max_new_tokens: int,
    seed: int = 0,
    batch_size: int = 32,
    task: str = "",
    model_name: str = "",
    samples: list[dict[str, Any]] | None = None,
) -> EvalResult:
    """Generate one response per problem and score it (the core of :func:`evaluate`).

    Args:
        model: a transformers causal LM (eval mode is set here).
        tokenizer: its tokenizer (with a chat template).
        problems: :class:`asyncrl.tasks.Problem` records.
        system_prompt: system message for the chat template (``data.system_prompt``).
        response_prefix: assistant prefill template (``data.response_prefix``); the answer is
            checked on ``prefix + generated text``, as in training.
        temperature: 0 for greedy decoding, > 0 for sampling with top_p = 1 and top_k off.
        max_new_tokens: response cap in tokens.
        seed: torch seed set before generation (sampling reproducible for a fixed batch size).
        batch_size: prompts per ``generate`` call.
        samples: when a list, one dict per problem (problem, gold, response, extracted,
            correct, format_ok) is appended to it.

    Raises:
        ValueError: ``temperature < 0``, ``max_new_tokens < 1`` or no problems.
    """
    import torch

    from asyncrl.rewards import check_answer
    from asyncrl.tasks import render_prompt, render_response_prefix

    if temperature < 0 or max_new_tokens < 1 or not problems:
        raise ValueError(
            f"need temperature >= 0 (got {temperature}), max_new_tokens >= 1 (got {max_new_tokens}) "
            f"and at least one problem (got {len(problems)})"
        )
    start = time.perf_counter()
    model.eval()
    stop_ids = _stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    gen_kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id)
    if temperature > 0:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
    else:
        gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    torch.manual_seed(seed)
    correct = fmt = tokens = truncated = 0
    for lo in range(0, len(problems), batch_size):
        batch = problems[lo : lo + batch_size]
        prefixes = [render_response_prefix(response_prefix, p.metadata) for p in batch]
        ids = [render_prompt(tokenizer, p.text, system_prompt, pre)[1] for p, pre in zip(batch, prefixes)]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids])  # (B, T) left-padded
        attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention, **gen_kwargs)
        for p, prefix, row in zip(batch, prefixes, out[:, width:].tolist()):
            n_tok = next((i + 1 for i, t in enumerate(row) if t in stop_ids), None)
            truncated += n_tok is None
            row = row[: n_tok or len(row)]
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
        seconds=time.perf_counter() - start,
    )


def evaluate(
    model_path: str | Path,
    data: Any,
    *,
    num_problems: int = 400,
    temperatures: Sequence[float] = (0.0, 1.0),
    seed: int = 0,
    max_new_tokens: int = 64,
    batch_size: int = 32,
    threads: int | None = 2,
    samples: list[dict[str, Any]] | None = None,
) -> list[EvalResult]:
    """Held-out accuracy of a model at each temperature (0 = greedy).

    Args:
        model_path: a name prepared by ``asyncrl models prepare`` or a local HF directory
            (a published-weights or checkpoint directory holding ``config.json``).
        data: the ``data`` config section (task, difficulty, system prompt, file path).
        num_problems: held-out problems per temperature (the first ``num_problems`` of the split).
        temperatures: e.g. ``(0.0, 1.0)`` for greedy and sampled.
        threads: ``torch.set_num_threads`` (None leaves torch's default).

    Returns:
        One :class:`EvalResult` per temperature, in order.

    Raises:
        asyncrl.tasks.TaskError: the task cannot supply ``num_problems`` held-out problems.
        FileNotFoundError / ValueError: from model loading (missing or corrupt model).
    """
    import torch

    from asyncrl.models import load_causal_lm, load_tokenizer, resolve_model_path
    from asyncrl.tasks import load_task

    if threads:
        torch.set_num_threads(threads)
    problems = load_task(data).heldout(num_problems)
    path = resolve_model_path(str(model_path))
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path)
    return [
        evaluate_problems(
            model, tokenizer, problems, system_prompt=data.system_prompt,
            response_prefix=data.response_prefix, temperature=t,
            max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size, task=data.task,
            model_name=str(model_path), samples=samples,
        )
        for t in temperatures
    ]


USAGE = """usage: asyncrl eval [--model PATH_OR_NAME] [--task arithmetic|gsm8k|jsonl|parquet]
                    [--num_problems 400] [--modes greedy,sampled] [--temperature 1.0]
                    [--max_new_tokens N] [--batch_size 32] [--seed 0] [--threads 2]
                    [--json] [--samples_out FILE.jsonl] [--config F] [--FIELD VALUE ...]

Held-out accuracy (greedy and sampled) with n and 95% Wilson intervals; format compliance
separately. --model defaults to model.path, --task to data.task and --max_new_tokens to
rollout.max_response_len of the config; any config field can be set as a dotted flag
(e.g. --data.arithmetic.digits 3)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl eval", add_help=False)
    p.add_argument("--model")
    p.add_argument("--task", choices=["arithmetic", "gsm8k", "jsonl", "parquet"])
    p.add_argument("--num_problems", type=int, default=400)
    p.add_argument("--modes", default="greedy,sampled")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--seed", type=int)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--samples_out", type=Path)
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl eval``; returns the exit code (2: bad arguments or config, 1: eval failed)."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    from asyncrl.config_cli import config_from_argv

    try:
        args, rest = _parser().parse_known_args(argv)
    except SystemExit as exc:  # argparse already printed the problem
        return int(exc.code or 2)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("greedy", "sampled")]
    problems = []
    if bad or not modes:
        problems.append(f"--modes takes greedy and/or sampled, comma-separated (got {args.modes!r})")
    if args.num_problems < 1 or args.batch_size < 1 or args.threads < 1:
        problems.append("--num_problems, --batch_size and --threads must be >= 1")
    if args.temperature <= 0:
        problems.append(f"--temperature must be > 0 (got {args.temperature}); greedy is --modes greedy")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        problems.append("--max_new_tokens must be >= 1")
    if problems:
        print("asyncrl eval: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.task:
        rest += ["--data.task", args.task]
    if args.model:
        rest += ["--model.path", args.model]
    cfg = config_from_argv(rest, "eval")
    if isinstance(cfg, int):
        return cfg
    temps = [0.0 if m == "greedy" else args.temperature for m in modes]
    samples: list[dict[str, Any]] | None = [] if args.samples_out else None
    try:
        results = evaluate(
            cfg.model.path, cfg.data, num_problems=args.num_problems, temperatures=temps,
            seed=cfg.run.seed if args.seed is None else args.seed,
            max_new_tokens=args.max_new_tokens or cfg.rollout.max_response_len,
            batch_size=args.batch_size, threads=args.threads, samples=samples,
        )
    except (OSError, ValueError) as exc:
        print(f"asyncrl eval: {exc}", file=sys.stderr)
        return 1
    if args.samples_out and samples is not None:
        args.samples_out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.samples_out, "w") as f:
            for row in samples:
                f.write(json.dumps(row) + "\n")
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        print(f"model {cfg.model.path}  task {cfg.data.task}  held-out problems {args.num_problems}")
        for r in results:
            print(r.summary())
    return 0
