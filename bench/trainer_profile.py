"""One main-job trainer step: where its time goes, shared-prompt passes on and off, and the
fraction of the machine's matmul peak it reaches.

Workload: the main job's batches (``configs/smollm2_arith.yaml``: SmolLM2-135M-Instruct fp32,
ZeRO-0, one rank, decoupled PPO, 6 prompt groups x 8 samples). Prompts are the job's own train
stream (chat template, system prompt and ``A + B =`` prefill: 42 tokens each); responses have
``U[--min_response, --max_response]`` random tokens (default 3-10: the main job's late steps hold
205-416 response tokens over 48 samples) with 0/1 rewards. The token ids do not change the
compute; their count does.

Measured, in this one script, on the same threads:

1. ``profile``: one trainer step (``begin_step`` + ``forward_backward`` + ``optim_step``) under
   ``torch.profiler`` for each layout, self CPU time by component: attention (the SDPA/eager
   attention kernels, forward and backward), the attention projections (q, k, v, o), the MLP,
   ``lm_head`` and logprobs (the vocabulary matmuls, log-softmax, gather), the optimizer step
   (AdamW + clipping, timed as its phase), and the rest (norms, RoPE, activations, copies).
2. trainer tokens/s of each layout (``--variants``: shared prompts off/on ×
   ``trainer.attention`` row/blocks): sample tokens (``prompt + response - 1`` per sample: the
   work the unshared step does) over the step's wall time, the fastest of ``--repeats``
   alternating repeats on the same batch; the figures are the ratios to the first variant
   (``unshared_row``: the trainer before shared prompts and block attention).
3. the physical limit: a dense fp32 matmul's FLOP/s measured here with the same thread count
   (the best of a few model-shaped and square products), against the model FLOPs/s of each
   step: ``6 * N * tokens`` (N = non-embedding parameters, Kaplan et al. 2020) plus the
   ``lm_head``'s ``6 * V * d`` per kept logit row. Two fractions: *executed* (the tokens the
   step really processed) and *effective* (the unshared workload's tokens: with shared prompts
   this can exceed 1, since work is skipped, not sped up).

Usage: ``python bench/trainer_profile.py [--threads 2] [--repeats 3] [--variants unshared_row,shared_blocks]
[--min_response 3 --max_response 10] [--no_profile] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

from _report import emit, record_path  # bench/_report.py (the script's folder is on sys.path)

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


#: Trainer layouts: name -> (trainer.share_prompts, trainer.attention). ``unshared_row`` is the
#: trainer before shared prompts and block attention; ``shared_blocks`` is the default.
VARIANTS = {
    "unshared_row": (False, "row"),
    "unshared_blocks": (False, "blocks"),
    "shared_row": (True, "row"),
    "shared_blocks": (True, "blocks"),
}


def main_job_batch(cfg, tokenizer, groups: int, samples: int, lo: int, hi: int, seed: int = 0):
    """Prompt groups as the buffer hands them to the trainer (see the module docstring)."""
    import torch

    from asyncrl.tasks.tasks import TrainPromptStream

    stream = TrainPromptStream(cfg.data, tokenizer, seed=cfg.data.seed)
    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    out = []
    for gi in range(groups):
        prompt = stream.get(gi).prompt_ids
        members = []
        for si in range(samples):
            r = int(torch.randint(lo, hi + 1, (1,), generator=g))
            members.append({
                "sample_id": f"g{gi}s{si}", "index": si,
                "response_ids": torch.randint(10, vocab, (r,), generator=g).tolist(),
                "behaviour_logprobs": (-(torch.rand(r, generator=g) * 2.0 + 0.1)).tolist(),
                "versions": [0] * r, "finish_reason": "stop", "reward": float((si + gi) % 2),
            })
        out.append({"group_id": f"g{gi}", "prompt_ids": prompt, "samples": members})
    return out


def matmul_peak_flops(threads: int, d_model: int, d_ff: int, repeats: int = 5) -> dict[str, float]:
    """Best fp32 matmul FLOP/s over model-shaped and square products (same thread count)."""
    import torch

    torch.set_num_threads(threads)
    shapes = {"square_2048": (2048, 2048, 2048), "mlp_up_2048_rows": (2048, d_model, d_ff),
              "mlp_down_2048_rows": (2048, d_ff, d_model)}
    out = {}
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
        out[name] = 2.0 * m * k * n / best
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def classify(name: str, shapes: list, d_model: int, d_ff: int, vocab: int) -> str:
    """Component of one profiler op (by name, and for matmuls by operand shapes)."""
    low = name.lower()
    if "scaled_dot_product" in low or "flash_attention" in low or low in ("aten::bmm", "aten::baddbmm"):
        return "attention"
    if low in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul"):
        dims = {d for s in shapes if s for d in s}
        if vocab in dims:
            return "lm_head_and_logprobs"
        if d_ff in dims:
            return "mlp"
        return "attention_projections"
    if any(k in low for k in ("log_softmax", "logsumexp", "gather", "nll_loss")):
        return "lm_head_and_logprobs"
    return "other"


def profile_step(step_fn, groups, d_model: int, d_ff: int, vocab: int) -> dict[str, float]:
    """Self CPU seconds by component of one step (the optimizer phase is timed, not profiled)."""
    from torch.profiler import ProfilerActivity, profile

    totals: dict[str, float] = {}
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        timings = step_fn(groups)
    for ev in prof.key_averages(group_by_input_shape=True):
        comp = classify(ev.key, list(ev.input_shapes or []), d_model, d_ff, vocab)
        totals[comp] = totals.get(comp, 0.0) + ev.self_cpu_time_total / 1e6
    # the optimizer's ops are inside the profile too: move the measured phase out of "other"
    totals["other"] = max(0.0, totals.get("other", 0.0) - timings["optim_step"])
    totals["optimizer"] = timings["optim_step"]
    totals["step_wall_seconds_profiled"] = timings["total"]
    return totals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2_arith.yaml")
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--min_response", type=int, default=3)
    ap.add_argument("--max_response", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no_profile", action="store_true", help="skip the torch.profiler breakdown")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated layouts to time; the first is the baseline of the ratios")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from asyncrl.core.config import load_config
    from asyncrl.models import load_causal_lm, load_tokenizer, resolve_model_path
    from trainer.trainer import Trainer

    out_dir = Path(tempfile.mkdtemp(prefix="trainer_profile_"))
    base_cfg = load_config(["--config", str(args.config)], environ={})
    model_dir = resolve_model_path(base_cfg.model.path)
    base = load_causal_lm(model_dir, "float32")
    tokenizer = load_tokenizer(model_dir)
    mc = base.config
    d_model, d_ff, vocab = mc.hidden_size, mc.intermediate_size, mc.vocab_size
    n_embed = base.get_input_embeddings().weight.numel()
    n_nonembed = sum(p.numel() for p in base.parameters()) - n_embed
    groups = main_job_batch(base_cfg, tokenizer, args.groups, args.samples, args.min_response, args.max_response)

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r}; choose from {', '.join(VARIANTS)}")
    trainers = {}
    for v in variants:
        share, attention = VARIANTS[v]
        cfg = load_config(["--config", str(args.config)], environ={}, overrides={
            "model": {"path": str(model_dir)},
            "run": {"output_dir": str(out_dir), "name": v},
            "trainer": {"share_prompts": share, "attention": attention},
        })
        trainers[v] = Trainer(cfg, model=copy.deepcopy(base))

    def stepper(tr):
        def run(gs):
            t0 = time.perf_counter()
            plan = tr.begin_step(gs)
            processed = 0.0
            t_opt = 0.0
            for mb in plan.minibatches:
                processed += tr.forward_backward(mb)["processed_tokens"]
                t1 = time.perf_counter()
                tr.optim_step(1e-9)
                t_opt += time.perf_counter() - t1
            samples = plan.batch.samples
            return {"total": time.perf_counter() - t0, "optim_step": t_opt, "processed_tokens": processed,
                    "sample_tokens": float(sum(s.num_tokens for s in samples)),
                    "logit_rows": float(sum(len(s.response_ids) for s in samples))}
        return run

    steps = {v: stepper(tr) for v, tr in trainers.items()}
    for v in variants:  # warm-up
        steps[v](groups)
    timed: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            timed[v].append(steps[v](groups))
    peak = matmul_peak_flops(args.threads, d_model, d_ff)
    peak_best = max(peak.values())

    result: dict = {"model": record_path(base_cfg.model.path), "threads": args.threads, "groups": args.groups,
                    "samples_per_group": args.samples, "response_tokens": [args.min_response, args.max_response],
                    "non_embedding_params": n_nonembed,
                    "matmul_flops_per_second": peak, "matmul_peak_flops_per_second": peak_best,
                    "load_average_1min": os.getloadavg()[0], "variants": {}}
    for v in variants:
        share = VARIANTS[v][0]
        best = min(timed[v], key=lambda t: t["total"])
        # lm_head rows: unshared every response token; shared, one row fewer per shared sample
        shared_rows = best["logit_rows"] - (args.groups * (args.samples - 1) if share else 0)
        executed = 6.0 * n_nonembed * best["processed_tokens"] + 6.0 * vocab * d_model * shared_rows
        effective = 6.0 * n_nonembed * best["sample_tokens"] + 6.0 * vocab * d_model * best["logit_rows"]
        result["variants"][v] = {
            "step_seconds": [t["total"] for t in timed[v]],
            "best_step_seconds": best["total"], "optim_step_seconds": best["optim_step"],
            "processed_tokens": best["processed_tokens"], "sample_tokens": best["sample_tokens"],
            "sample_tokens_per_second": best["sample_tokens"] / best["total"],
            "processed_tokens_per_second": best["processed_tokens"] / best["total"],
            "model_flops_per_second_executed": executed / best["total"],
            "model_flops_per_second_effective": effective / best["total"],
            "peak_fraction_executed": executed / best["total"] / peak_best,
            "peak_fraction_effective": effective / best["total"] / peak_best,
        }
    base_v = variants[0]
    result["baseline"] = base_v
    result["sample_tokens_per_second_over_baseline"] = {
        v: r["sample_tokens_per_second"] / result["variants"][base_v]["sample_tokens_per_second"]
        for v, r in result["variants"].items()}
    if not args.no_profile:
        result["profile_self_seconds"] = {v: profile_step(steps[v], groups, d_model, d_ff, vocab) for v in variants}
    for tr in trainers.values():
        tr.close()
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
