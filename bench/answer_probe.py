"""What a policy answers on the held-out arithmetic problems, by kind of problem and kind of error.

The main job's held-out accuracy swings between neighbouring evaluations (docs/results.md). This
probe reads a weights directory (a run's ``weights/vNNNNNN`` or the base model) and answers each
held-out problem greedily, then splits the problems into those whose sum needs a carry into the
tens digit (``a % 10 + b >= 10`` for ``a + b``) and those that do not, and classifies each wrong
answer: ``dropped_carry`` (answer = gold - 10: the carry was not added), ``extra_carry`` (answer =
gold + 10 on a sum without a carry), ``no_number`` and ``other``. It is the "policy's answer
distribution" of issue 27 for the built-in two-operand addition task.

Usage: ``python bench/answer_probe.py --model runs/X/weights/v000050 [--num_problems 200] [--json F]``
(``--model base`` for the configured base model). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit, record_path  # noqa: E402  (bench/_report.py: print the result, keep it as JSON)

_OPERANDS = re.compile(r"(\d+)\s*\+\s*(\d+)")
_NUMBER = re.compile(r"-?\d+")


def classify(a: int, b: int, gold: int, answer_text: str) -> str:
    """``correct``, ``dropped_carry``, ``extra_carry``, ``no_number`` or ``other`` for one answer.

    Args:
        a, b: the operands of ``a + b``; gold: their sum.
        answer_text: the generated text after the ``a + b =`` prefill (its first number is the answer).
    """
    m = _NUMBER.search(answer_text)
    if m is None:
        return "no_number"
    got = int(m.group())
    if got == gold:
        return "correct"
    if got == gold - 10 and a % 10 + b % 10 >= 10:
        return "dropped_carry"
    if got == gold + 10 and a % 10 + b % 10 < 10:
        return "extra_carry"
    return "other"


def probe(model_dir: str, config: str, num_problems: int, max_new_tokens: int = 8) -> dict:
    """Greedy answers of ``model_dir`` on the first ``num_problems`` held-out problems, tallied.

    Returns:
        ``{"model", "n", "accuracy", "by_kind": {"carry"|"no_carry": {"n", "correct"}},
        "errors": {kind: count}, "examples": [[prefill, answer, gold], ...]}`` (at most 12 examples).
    Raises:
        ValueError: the configured task is not two-operand addition.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.core.config import load_config
    from asyncrl.models import resolve_model_path
    from asyncrl.tasks.tasks import load_task, render_prompt, render_response_prefix

    cfg = load_config(["--config", config], environ={})
    if cfg.data.task != "arithmetic" or cfg.data.arithmetic.n_terms != 2 or cfg.data.arithmetic.operators != "+":
        raise ValueError("answer_probe reads two-operand addition problems (the main job's task)")
    path = resolve_model_path(cfg.model.path) if model_dir == "base" else model_dir
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    problems = load_task(cfg.data, cfg.data.seed).heldout(num_problems)
    by_kind = {k: collections.Counter() for k in ("carry", "no_carry")}
    errors: collections.Counter = collections.Counter()
    examples = []
    for p in problems:
        prefix = render_response_prefix(cfg.data.response_prefix, p.metadata)
        _, ids = render_prompt(tok, p.text, cfg.data.system_prompt, prefix)
        a, b = (int(x) for x in _OPERANDS.search(prefix or p.text).groups())
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tok.eos_token_id)
        answer = tok.decode(out[0, len(ids):], skip_special_tokens=True)
        kind = classify(a, b, int(p.gold), answer)
        bucket = by_kind["carry" if a % 10 + b % 10 >= 10 else "no_carry"]
        bucket["n"] += 1
        bucket["correct"] += kind == "correct"
        if kind != "correct":
            errors[kind] += 1
            if len(examples) < 12:
                examples.append([prefix, answer.strip()[:16], int(p.gold)])
    n = sum(b["n"] for b in by_kind.values())
    correct = sum(b["correct"] for b in by_kind.values())
    return {"model": record_path(model_dir), "n": n, "accuracy": correct / n if n else 0.0,
            "by_kind": {k: dict(v) for k, v in by_kind.items()}, "errors": dict(errors), "examples": examples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a weights directory, or 'base'")
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2_arith.yaml"))
    ap.add_argument("--num_problems", type=int, default=200)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        result = probe(args.model, args.config, args.num_problems)
    except ValueError as exc:
        ap.error(str(exc))
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
