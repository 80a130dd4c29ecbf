"""``asyncrl eval``: the command line of held-out evaluation.

Parses the flags and the config, then runs :func:`asyncrl.evaluation.evaluate.evaluate` (single-turn
prompts) or :func:`asyncrl.evaluation.episodes.evaluate_episodes` (an ``agent.workflow``'s
episodes) and prints the results. Kept apart from both so neither imports the other's caller.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from asyncrl.core.choices import BUILTIN_TASKS
from asyncrl.evaluation.evaluate import EvalError, evaluate

__all__ = ["USAGE", "main"]

USAGE = """usage: asyncrl eval [--model PATH_OR_NAME] [--task arithmetic|chain|gsm8k|jsonl|parquet]
                    [--num_problems 400] [--modes greedy,sampled] [--temperature 1.0]
                    [--max_new_tokens N] [--batch_size 128] [--seed 0] [--threads 2]
                    [--backend engine|hf] [--server_url URL]
                    [--json] [--samples_out FILE.jsonl] [--config F] [--FIELD VALUE ...]

Held-out accuracy (greedy and sampled) with n and 95% Wilson intervals; format compliance
separately. --model defaults to model.path, --task to data.task and --max_new_tokens to
rollout.max_response_len of the config; any config field can be set as a dotted flag
(e.g. --data.arithmetic.digits 3).

--backend engine (default) generates with the rollout engine's continuous batching in this
process (--batch_size rows decode together); --backend hf with transformers generate
(--batch_size prompts per call). --server_url URL sends the requests to a running SGLang or
`asyncrl rollout-server` instead (its weights; --model then only names the tokenizer).
--model may be a LoRA adapter directory that a run with trainer.lora published: it is merged
into the base model its adapter_config.json names, in a temporary directory, first."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl eval", add_help=False)
    p.add_argument("--model")
    p.add_argument("--task", choices=list(BUILTIN_TASKS))
    p.add_argument("--num_problems", type=int, default=400)
    p.add_argument("--modes", default="greedy,sampled")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--backend", choices=["engine", "hf"], default=None)
    p.add_argument("--server_url")
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
    if args.server_url is not None and args.backend is not None:
        problems.append("--server_url generates on the server: it excludes --backend")
    if args.server_url is not None and not args.server_url.startswith(("http://", "https://")):
        problems.append(f"--server_url must be an http(s) URL (got {args.server_url!r})")
    if problems:
        print("asyncrl eval: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.task:
        rest += ["--data.task", args.task]
    merged_dir = None
    if args.model and not args.server_url:
        from asyncrl.models import ModelError, adapter_base, is_adapter_dir, merge_adapter

        if is_adapter_dir(args.model):  # a LoRA run's published version: evaluate base + adapter
            import tempfile

            merged_dir = Path(tempfile.mkdtemp(prefix="asyncrl-eval-"))
            try:
                args.model = str(merge_adapter(args.model, adapter_base(args.model), merged_dir / "model"))
            except ModelError as exc:
                print(f"asyncrl eval: {exc}", file=sys.stderr)
                _rm(merged_dir)
                return 1
    try:
        return _main_with(args, rest, modes)
    finally:
        if merged_dir is not None:
            _rm(merged_dir)


def _rm(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _main_with(args: argparse.Namespace, rest: list[str], modes: list[str]) -> int:
    """The evaluation itself, once the arguments are checked and ``args.model`` is a full model."""
    from asyncrl.core.config_cli import config_from_argv

    if args.model:
        rest += ["--model.path", args.model]
    cfg = config_from_argv(rest, "eval")
    if isinstance(cfg, int):
        return cfg
    temps = [0.0 if m == "greedy" else args.temperature for m in modes]
    samples: list[dict[str, Any]] | None = [] if args.samples_out else None
    if cfg.agent.workflow:
        return _main_episodes(cfg, args, temps)
    try:
        results = evaluate(
            cfg.model.path, cfg.data, num_problems=args.num_problems, temperatures=temps,
            seed=cfg.run.seed if args.seed is None else args.seed,
            max_new_tokens=args.max_new_tokens or cfg.rollout.max_response_len,
            batch_size=args.batch_size, threads=args.threads, samples=samples,
            backend="server" if args.server_url else (args.backend or "engine"), server_url=args.server_url,
        )
    except (OSError, ValueError, EvalError) as exc:
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
        print(f"model {cfg.model.path}  task {cfg.data.task}  held-out problems {args.num_problems}  "
              f"backend {results[0].backend}")
        for r in results:
            print(r.summary())
    return 0


def _main_episodes(cfg: Any, args: argparse.Namespace, temps: list[float]) -> int:
    """``asyncrl eval`` of a workflow's episodes (``agent.workflow`` set; asyncrl/evaluation/episodes.py)."""
    import torch

    from asyncrl.agents import WorkflowError
    from asyncrl.evaluation.episodes import evaluate_episodes
    from asyncrl.models import load_causal_lm, load_tokenizer, resolve_model_path
    from asyncrl.tasks.tasks import load_task

    if args.server_url or (args.backend and args.backend != "engine"):
        print("asyncrl eval: episodes of agent.workflow run on the in-process engine only (no --server_url or "
              "--backend hf)", file=sys.stderr)
        return 2
    try:
        torch.set_num_threads(args.threads)
        problems = load_task(cfg.data).heldout(args.num_problems)
        path = resolve_model_path(str(cfg.model.path))
        model, tokenizer = load_causal_lm(path), load_tokenizer(path)
        seed = cfg.run.seed if args.seed is None else args.seed
        results = [evaluate_episodes(model, tokenizer, problems, cfg, temperature=t, seed=seed,
                                     batch_size=args.batch_size, model_name=str(cfg.model.path)) for t in temps]
    except (OSError, ValueError, EvalError, WorkflowError) as exc:
        print(f"asyncrl eval: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        print(f"model {cfg.model.path}  workflow {cfg.agent.workflow}  held-out problems {args.num_problems}")
        for r in results:
            print(r.summary())
    return 0
