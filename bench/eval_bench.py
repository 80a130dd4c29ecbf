"""Held-out evaluation speed: the embedded continuous-batching engine vs transformers ``generate``.

Workload: the first ``--num_problems`` (400) held-out problems of ``--config``
(configs/smollm2_arith.yaml: SmolLM2-135M-Instruct, fp32, the arithmetic task with its chat
template, system prompt and assistant prefill, 64 new tokens at most), scored by
:func:`asyncrl.evaluation.evaluate.evaluate_problems` exactly as ``asyncrl eval`` scores them. The model
is loaded once; each run evaluates every problem with one backend and batch size, on
``--threads`` torch threads, in this process:

* ``hf:32``: transformers ``generate``, left-padded batches of 32 in problem order (the
  previous ``asyncrl eval`` default: the baseline);
* ``hf:64``: the same with batches of 64;
* ``engine:N``: :class:`rollout_server.engine.Engine`, N rows decoded together, a finished
  row's slot refilled at once (``engine:128`` is the ``asyncrl eval`` default).

Printed: seconds, accuracy with its 95% interval, mean response tokens and generated tokens/s
per run, and the speed-up ``seconds(hf:32) / seconds(run)`` of every run. For greedy (``--modes
sampled,greedy``) also how many responses are identical to the baseline's (the same argmax
decoding; batch composition changes fp32 rounding, which may break a near-tie differently).
Sampled accuracies differ by sampling noise only (different random streams, same
distribution). The machine may be shared: the 1-minute load average before and after each run
is recorded; speed targets are these in-script ratios, never absolute times.

Usage: ``python bench/eval_bench.py [--config configs/smollm2_arith.yaml] [--num_problems 400]
[--threads 2] [--modes sampled] [--runs hf:32,hf:64,engine:64,engine:128] [--json FILE]``.
The JSON in docs/bench/eval_backends.json: ``--modes sampled,greedy --runs
hf:32,engine:64,engine:128,engine:256``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse_runs(text: str) -> list[tuple[str, int]]:
    """``"hf:32,engine:64"`` -> ``[("hf", 32), ("engine", 64)]``; the first run is the baseline.

    Raises:
        SystemExit: a malformed entry, an unknown backend or a batch size < 1.
    """
    runs = []
    for part in text.split(","):
        backend, _, size = part.strip().partition(":")
        if backend not in ("hf", "engine") or not size.isdigit() or int(size) < 1:
            raise SystemExit(f"eval_bench: --runs takes hf:N / engine:N entries, comma-separated (got {part!r})")
        runs.append((backend, int(size)))
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "smollm2_arith.yaml"))
    ap.add_argument("--num_problems", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="sampled")
    ap.add_argument("--runs", default="hf:32,hf:64,engine:64,engine:128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = parse_runs(args.runs)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("sampled", "greedy") for m in modes):
        raise SystemExit(f"eval_bench: --modes takes sampled and/or greedy (got {args.modes!r})")

    import torch

    from asyncrl.core.config_cli import config_from_argv
    from asyncrl.evaluation.evaluate import evaluate_problems
    from asyncrl.models import load_causal_lm, load_tokenizer, resolve_model_path
    from asyncrl.tasks.tasks import load_task

    torch.set_num_threads(args.threads)
    cfg = config_from_argv(["--config", args.config], "eval")
    if isinstance(cfg, int):
        return cfg
    path = resolve_model_path(cfg.model.path)
    model, tok = load_causal_lm(path), load_tokenizer(path)
    problems = load_task(cfg.data).heldout(args.num_problems)
    max_new = cfg.rollout.max_response_len
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    from bench._report import record_path

    out: dict = {
        "config": str(Path(args.config).relative_to(REPO)) if Path(args.config).resolve().is_relative_to(REPO) else args.config,
        "model": record_path(cfg.model.path), "num_problems": len(problems), "max_new_tokens": max_new, "seed": args.seed,
        "threads": args.threads, "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(), "commit": commit, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "baseline": f"{runs[0][0]}:{runs[0][1]}", "modes": {},
    }
    print(f"{len(problems)} held-out problems of {out['config']} ({cfg.model.path}), max {max_new} new tokens, "
          f"{args.threads} threads", flush=True)
    for mode in modes:
        temperature = 0.0 if mode == "greedy" else cfg.rollout.temperature
        rows = []
        responses: dict[str, list[str]] = {}
        for backend, size in runs:
            name = f"{backend}:{size}"
            samples: list = []
            load_before = os.getloadavg()[0]
            r = evaluate_problems(model, tok, problems, system_prompt=cfg.data.system_prompt, few_shot=cfg.data.few_shot,
                                  response_prefix=cfg.data.response_prefix, temperature=temperature,
                                  max_new_tokens=max_new, seed=args.seed, batch_size=size, samples=samples,
                                  backend=backend, task=cfg.data.task, model_name=cfg.model.path)
            responses[name] = [s["response"] for s in samples]
            tokens = sum(s["tokens"] for s in samples)
            row = {"run": name, "backend": backend, "batch_size": size, "seconds": round(r.seconds, 2),
                   "accuracy": r.accuracy, "accuracy_ci95": [r.accuracy_ci_low, r.accuracy_ci_high],
                   "correct": r.correct, "format_compliance": r.format_compliance,
                   "mean_response_tokens": r.mean_response_tokens, "truncated": r.truncated,
                   "generated_tokens": tokens, "generated_tokens_per_second": round(tokens / r.seconds, 1),
                   "loadavg_1min_before": round(load_before, 2), "loadavg_1min_after": round(os.getloadavg()[0], 2)}
            rows.append(row)
            print(f"{mode:<7} {name:<10} {r.seconds:7.1f} s  accuracy {100 * r.accuracy:5.1f}% "
                  f"[{100 * r.accuracy_ci_low:.1f}, {100 * r.accuracy_ci_high:.1f}]  {r.mean_response_tokens:5.1f} "
                  f"tokens/response  {tokens / r.seconds:6.1f} tokens/s  load {row['loadavg_1min_before']:.2f}"
                  f"->{row['loadavg_1min_after']:.2f}", flush=True)
        base = rows[0]
        for row in rows:
            row["speedup_vs_baseline"] = round(base["seconds"] / row["seconds"], 3)
            if mode == "greedy":
                same = sum(a == b for a, b in zip(responses[row["run"]], responses[base["run"]]))
                row["identical_to_baseline"] = same
        out["modes"][mode] = rows
        print(" ".join(f"{row['run']} x{row['speedup_vs_baseline']:.2f}" for row in rows)
              + f"  (speed-up vs {base['run']}, {mode})", flush=True)
        if mode == "greedy":
            print(" ".join(f"{row['run']} identical {row['identical_to_baseline']}/{len(problems)}" for row in rows), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
