"""Base accuracy and response lengths of a model on the long-tailed ``chain`` task.

Workload: the first ``--num_problems`` held-out problems of ``--config``
(configs/smollm2_longtail.yaml: SmolLM2-135M-Instruct fp32, the ``chain`` task with its system
prompt and assistant prefill), one response each, sampled at T = 1 (top_p 1, top_k off: the RL
sampling distribution) with at most ``rollout.max_response_len`` new tokens, generated and scored
by :func:`asyncrl.evaluation.evaluate.evaluate` exactly as ``asyncrl eval`` does (engine backend,
``check_answer`` on ``prefix + response``).

Recorded (JSON): accuracy with its 95% Wilson interval; the response lengths in generated
tokens (median, p90, p99, max, mean, p99/median) and the same for the problems' step counts and
for the gold worked answers (:func:`asyncrl.tasks.generated.chain_solution`, tokenized with the
model's tokenizer); per step-count bucket: n, accuracy, mean response tokens and mean response
lines, so one can see whether the model's length follows the problem's; the Pearson correlation
of steps and response tokens; a few sample responses; the 1-minute load average before and after
(the machine may be shared, so the seconds are not a speed claim).

Usage: ``python bench/longtail_base.py [--config configs/smollm2_longtail.yaml]
[--num_problems 200] [--threads 2] [--json docs/bench/longtail_base.json]
[--samples_jsonl FILE]`` (``--samples_jsonl``: every response, one JSON line per problem with its
step count, to read the failures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._report import emit, record_path  # noqa: E402

#: Step-count buckets of the per-length table (inclusive bounds).
BUCKETS = ((1, 2), (3, 3), (4, 5), (6, 10), (11, 20), (21, 200))


def quantiles(values: list[float]) -> dict[str, float]:
    """Median, p90, p99 (nearest rank), max and mean of ``values`` (non-empty)."""
    s = sorted(values)

    def rank(q: float) -> float:
        return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]

    med = statistics.median(s)
    return {"median": med, "p90": rank(0.90), "p99": rank(0.99), "max": s[-1],
            "mean": round(statistics.fmean(s), 2), "p99_over_median": round(rank(0.99) / med, 2) if med else None}


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson correlation of two equal-length lists (None when one is constant)."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return round(sxy / (sxx * syy) ** 0.5, 3) if sxx and syy else None


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print (and optionally write) its JSON record; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "smollm2_longtail.yaml"))
    p.add_argument("--num_problems", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--samples_jsonl", type=Path, help="write every sample (with its step count) here")
    args = p.parse_args(argv)
    if args.num_problems < 1 or args.threads < 1 or args.batch_size < 1:
        raise SystemExit("longtail_base: --num_problems, --threads and --batch_size must be >= 1")

    from asyncrl.core.config import load_config
    from asyncrl.evaluation.evaluate import evaluate, wilson_interval
    from asyncrl.models import load_tokenizer, resolve_model_path
    from asyncrl.tasks.generated import chain_solution
    from asyncrl.tasks.tasks import load_task

    cfg = load_config(["--config", args.config], environ={})
    if cfg.data.task != "chain":
        raise SystemExit(f"longtail_base: {args.config} has data.task={cfg.data.task!r}, not 'chain'")
    max_new = cfg.rollout.max_response_len
    problems = load_task(cfg.data).heldout(args.num_problems)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.path))

    samples: list[dict] = []
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    (res,) = evaluate(cfg.model.path, cfg.data, num_problems=args.num_problems, temperatures=(1.0,),
                      seed=args.seed, max_new_tokens=max_new, batch_size=args.batch_size,
                      threads=args.threads, samples=samples)
    seconds = time.perf_counter() - start
    load_after = os.getloadavg()[0]

    steps = [pr.metadata["steps"] for pr in problems]
    tokens = [s["tokens"] for s in samples]
    lines = [s["response"].count("\n") + 1 for s in samples]
    gold_tokens = [len(tokenizer(chain_solution(pr.metadata["numbers"]), add_special_tokens=False)["input_ids"])
                   for pr in problems]
    buckets = []
    for lo, hi in BUCKETS:
        idx = [i for i, s in enumerate(steps) if lo <= s <= hi]
        if not idx:
            continue
        k = sum(samples[i]["correct"] for i in idx)
        ci = wilson_interval(k, len(idx))
        buckets.append({"steps": [lo, hi], "n": len(idx), "correct": k, "accuracy": round(k / len(idx), 3),
                        "ci95": [round(ci[0], 3), round(ci[1], 3)],
                        "mean_response_tokens": round(statistics.fmean(tokens[i] for i in idx), 1),
                        "mean_gold_tokens": round(statistics.fmean(gold_tokens[i] for i in idx), 1),
                        "mean_response_lines": round(statistics.fmean(lines[i] for i in idx), 1),
                        "mean_steps": round(statistics.fmean(steps[i] for i in idx), 1)})
    record = {
        "what": "base accuracy and response lengths on the chain task (sampled, T=1)",
        "config": record_path(args.config),
        "model": record_path(cfg.model.path),
        "chain": cfg.data.chain.model_dump(),
        "system_prompt": cfg.data.system_prompt,
        "few_shot": [ex.model_dump() for ex in cfg.data.few_shot],
        "response_prefix": cfg.data.response_prefix,
        "heldout_percent": cfg.data.heldout_percent,
        "n": res.n, "correct": res.correct, "accuracy": round(res.accuracy, 4),
        "accuracy_ci95": [round(res.accuracy_ci_low, 4), round(res.accuracy_ci_high, 4)],
        "format_compliance": round(res.format_compliance, 4),
        "max_new_tokens": max_new, "truncated": res.truncated, "temperature": 1.0, "seed": args.seed,
        "backend": res.backend, "batch_size": args.batch_size, "threads": args.threads,
        "response_tokens": quantiles(tokens),
        "gold_tokens": quantiles(gold_tokens),
        "steps": quantiles(steps),
        "pearson_steps_response_tokens": pearson(steps, tokens),
        "pearson_steps_response_lines": pearson(steps, lines),
        "by_steps": buckets,
        "examples": [{k: s[k] for k in ("problem", "gold", "response", "extracted", "correct", "tokens")}
                     for s in samples[:6]],
        "seconds": round(seconds, 1),
        "loadavg_1min_before_after": [round(load_before, 2), round(load_after, 2)],
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
    }
    if args.samples_jsonl:
        args.samples_jsonl.parent.mkdir(parents=True, exist_ok=True)
        with args.samples_jsonl.open("w") as f:
            for s, n in zip(samples, steps):
                f.write(json.dumps({"steps": n, **{k: s[k] for k in ("problem", "gold", "response", "extracted",
                                                                     "correct", "tokens")}}) + "\n")
    emit(record, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
