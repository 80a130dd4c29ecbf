"""How far ``pause_mode: in_place`` moves behaviour logprobs from any real policy.

With ``rollout.pause_mode: in_place`` a weight update lands in the middle of a sample: the KV
cache of its prompt and first ``k`` response tokens was computed by the old weights A, and the
tokens after the update are decoded by the new weights B on top of that cache. The logprobs the
engine reports for those tokens (the behaviour logprobs) are then those of a *mixed* policy, which
is neither A nor B; the trainer's proximal policy is B recomputed over the whole sequence.

This probe measures that gap on real weights of two versions of a run. For each held-out
problem it samples a response from A (T = 1), and for each split ``k`` (the update lands after
``k`` response tokens) it computes, on the response tokens after ``k``:

- ``mixed_vs_new``: mean |log pi_mixed - log pi_B| and the k3 KL estimate of the pair, the drift
  ``in_place`` adds to ``train/behaviour_kl``;
- ``old_vs_new``: the same between A and B recomputed cleanly, the policy change of the update
  itself (what ``abort`` would leave after its re-prefill under B: 0 for the tokens after ``k``,
  since ``abort`` decodes them with B on B's own cache).

The behaviour weight pi_prox / pi_behav stays an exact correction either way, because the mixed
policy is what sampled the tokens; the question is only how large the weights get.

Usage: ``python bench/in_place_drift.py --old runs/X/weights/v000016 --new runs/X/weights/v000017
[--num_problems 64] [--splits 1,2,3] [--json F]``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit, record_path  # noqa: E402  (bench/_report.py: print the result, keep it as JSON)


def _token_logprobs(logits_LV, targets_L):
    import torch

    return torch.log_softmax(logits_LV.float(), dim=-1).gather(-1, targets_L.unsqueeze(-1)).squeeze(-1)


def _stats(a: list[float], b: list[float]) -> dict:
    """Mean absolute difference, max, and k3 KL estimate (``r - 1 - log r``, r = p_b / p_a) of two logprob lists."""
    if not a:
        return {"tokens": 0, "mean_abs": 0.0, "max_abs": 0.0, "k3": 0.0}
    d = [y - x for x, y in zip(a, b)]
    return {"tokens": len(d), "mean_abs": sum(abs(x) for x in d) / len(d), "max_abs": max(abs(x) for x in d),
            "k3": sum(math.exp(x) - 1.0 - x for x in d) / len(d)}


def drift(old_dir: str, new_dir: str, config: str, num_problems: int, splits: list[int], max_new_tokens: int,
          seed: int = 0) -> dict:
    """Measure the in_place drift between weights ``old_dir`` (A) and ``new_dir`` (B); see the module docstring.

    Returns:
        ``{"old", "new", "n", "splits": {k: {"mixed_vs_new": stats, "old_vs_new": stats}}}`` where
        stats are ``{"tokens", "mean_abs", "max_abs", "k3"}`` over the response tokens after ``k``.
    Raises:
        ValueError: a negative split.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.core.config import load_config
    from asyncrl.tasks.tasks import load_task, render_prompt, render_response_prefix

    if not splits or any(k < 1 for k in splits):
        raise ValueError("splits are numbers of response tokens sampled before the update, each >= 1 (the "
                         "first token always comes from the prefill, under the old weights)")
    cfg = load_config(["--config", config], environ={})
    tok = AutoTokenizer.from_pretrained(old_dir)
    a = AutoModelForCausalLM.from_pretrained(old_dir, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    problems = load_task(cfg.data, cfg.data.seed).heldout(num_problems)
    gen = torch.Generator().manual_seed(seed)
    acc = {k: {"mixed": [], "new": [], "old": []} for k in splits}
    with torch.no_grad():
        for p in problems:
            prefix = render_response_prefix(cfg.data.response_prefix, p.metadata)
            _, ids = render_prompt(tok, p.text, cfg.data.system_prompt, prefix)
            # sample a response from A at T = 1 (the behaviour policy before the update)
            out = a(torch.tensor([ids]), use_cache=True)
            response = []
            for _ in range(max_new_tokens):
                probs = torch.softmax(out.logits[0, -1].float(), dim=-1)
                t = int(torch.multinomial(probs, 1, generator=gen))
                response.append(t)
                if t == tok.eos_token_id:
                    break
                out = a(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            full = torch.tensor([ids + response])
            n_p = len(ids)
            targets = torch.tensor(response)
            lp_a = _token_logprobs(a(full).logits[0, n_p - 1:-1], targets)
            lp_b = _token_logprobs(b(full).logits[0, n_p - 1:-1], targets)
            for k in splits:
                if k >= len(response):
                    continue
                # The update lands after k response tokens were sampled under A. The cache then
                # holds A's keys and values of the prompt and of r_0..r_{k-2}; r_{k-1} is fed at the
                # next decode step, under B, and so is every later token (each step adds its own
                # key and value, computed by B). B decoding r_{k-1}..r_{L-2} on A's cache gives the
                # logits of r_k..r_{L-1} exactly as the engine's step-by-step decode does.
                pre = a(torch.tensor([ids + response[:k - 1]]), use_cache=True)
                logits = b(torch.tensor([response[k - 1:-1]]), past_key_values=pre.past_key_values).logits[0]
                acc[k]["mixed"] += _token_logprobs(logits, targets[k:]).tolist()
                acc[k]["new"] += lp_b[k:].tolist()
                acc[k]["old"] += lp_a[k:].tolist()
    return {"old": record_path(old_dir), "new": record_path(new_dir), "n": len(problems),
            "splits": {str(k): {"mixed_vs_new": _stats(v["mixed"], v["new"]), "old_vs_new": _stats(v["old"], v["new"])}
                       for k, v in acc.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="weights directory of version v (A)")
    ap.add_argument("--new", required=True, help="weights directory of a later version (B)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2_arith.yaml"))
    ap.add_argument("--num_problems", type=int, default=64)
    ap.add_argument("--splits", default="1,2,3", help="response tokens sampled before the update (>= 1)")
    ap.add_argument("--max_new_tokens", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        splits = [int(x) for x in args.splits.split(",") if x.strip()]
        result = drift(args.old, args.new, args.config, args.num_problems, splits, args.max_new_tokens)
    except ValueError as exc:
        ap.error(str(exc))
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
