"""Trainer throughput vs a plain PyTorch loop, packing efficiency, weight publish + load time.

Workload (stated distribution, seeded): each train batch has ``--groups`` prompt groups of 2
samples; prompt lengths ~ U[32, 96] tokens, response lengths ~ U[16, 256] tokens, random token
ids, behaviour logprobs ~ -U[0.5, 4], rewards 0/1. Model: SmolLM2-135M-Instruct
(``asyncrl models prepare smollm2-135m-instruct``), fp32, ZeRO-0, one rank, CPU.

Measured:

1. trainer tokens/s through ``begin_step`` + ``forward_backward`` + ``optim_step`` (decoupled
   PPO, one optimizer step per batch so pi_prox is the forward pass itself; entropy metric on);
2. the ceiling: a plain loop in this script over the *same packed micro-batches* doing the same
   forward (fp32 logprobs of the response tokens) and backward passes with an inline PPO loss,
   ``clip_grad_norm_`` and ``torch.optim.AdamW`` — no DeepSpeed, no metrics;
3. packing efficiency over 8 batches: real tokens / processed tokens for the packed
   micro-batches, and for padding each micro-batch's samples to its longest sample (and to the
   longest of all batches);

Timing alternates trainer and plain steps on the same batch; tokens/s use the fastest of
``--steps`` repeats (the machine may be shared), the ratio of mean step times is also reported.
4. ``publish_weights`` (gather, cast, write + fsync + sha256 + rename) and the rollout side's
   load (``asyncrl.core.weights.load_state_dict_from_dir`` + ``load_state_dict``) for 135M fp32.

Usage: ``python bench/trainer_bench.py [--steps 3] [--groups 4] [--threads 2] [--json out.json]``.

On a GPU (``bench/gpu_check.py``): ``--device cuda [--precision bf16]`` runs the trainer with
DeepSpeed's CUDA accelerator and the plain loop on the same device (bf16: under autocast); the
JSON then also holds ``device``, ``device_name``, ``precision`` and ``peak_memory_bytes``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_batches(n_batches: int, n_groups: int, vocab: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    batches = []
    for b in range(n_batches):
        groups = []
        for gi in range(n_groups):
            p = int(torch.randint(32, 97, (1,), generator=g))
            prompt = torch.randint(10, vocab, (p,), generator=g).tolist()
            samples = []
            for si in range(2):
                r = int(torch.randint(16, 257, (1,), generator=g))
                samples.append({
                    "sample_id": f"b{b}g{gi}s{si}", "index": si,
                    "response_ids": torch.randint(10, vocab, (r,), generator=g).tolist(),
                    "behaviour_logprobs": (-(torch.rand(r, generator=g) * 3.5 + 0.5)).tolist(),
                    "versions": [0] * r, "finish_reason": "stop", "reward": float(si),
                })
            groups.append({"group_id": f"b{b}g{gi}", "prompt_ids": prompt, "samples": samples})
        batches.append(groups)
    return batches


def plain_step(model, opt, plan, temperature: float, clip: float, share_prompts: bool, device: str = "cpu",
               autocast: bool = False) -> int:
    """The ceiling: same micro-batches (same prompt sharing), same forward/backward, inline loss, torch AdamW."""
    import torch

    if device != "cpu":  # the packed tensors are built on the device; bf16 under autocast
        with torch.device(device), torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
            tokens = plain_step(model, opt, plan, temperature, clip, share_prompts)
        torch.cuda.synchronize()
        return tokens
    from trainer.packing import build_micro_batch, packed_logits

    samples = plan.batch.samples
    prompts = [s.prompt_ids for s in samples]
    responses = [s.response_ids for s in samples]
    tokens = 0
    for mb in plan.minibatches:
        total = mb.total_loss_tokens
        for indices in mb.micro_batches:
            packed = build_micro_batch(prompts, responses, indices, share_prompts=share_prompts)
            x = packed_logits(model, packed).float() / temperature
            logp = x.gather(-1, packed.targets[:, None])[:, 0] - torch.logsumexp(x, -1)
            behav = torch.cat([samples[i].behaviour_logprobs for i in indices]).to(logp.device)
            adv = torch.cat([samples[i].advantages for i in indices]).to(logp.device)
            ratio = torch.exp(logp - logp.detach())
            w = torch.clamp(torch.exp(logp.detach() - behav), max=5.0)
            pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.28)) * w
            (pg.sum() / total).backward()
            tokens += packed.num_tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=3, help="timed repeats of the same batch per loop (after a warm-up)")
    ap.add_argument("--groups", type=int, default=4, help="prompt groups (of 2 samples) per batch")
    ap.add_argument("--micro_batch_tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: DeepSpeed's accelerator and the plain loop's device")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="trainer.precision (default fp32)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device != "cpu":
        os.environ["DS_ACCELERATOR"] = "cuda"  # before anything imports deepspeed

    import torch

    torch.set_num_threads(args.threads)
    from asyncrl.core.config import load_config
    from asyncrl.models import load_causal_lm, resolve_model_path
    from asyncrl.core.weights import load_state_dict_from_dir
    from trainer.packing import packing_efficiency
    from trainer.trainer import Trainer

    model_dir = resolve_model_path(args.model)
    base = load_causal_lm(model_dir, "float32")
    vocab = base.config.vocab_size
    batches = make_batches(8, args.groups, vocab)
    out_dir = Path(tempfile.mkdtemp(prefix="trainer_bench_"))
    cfg = load_config([], environ={}, overrides={
        "model": {"path": str(model_dir)},
        "run": {"output_dir": str(out_dir), "name": "bench", "total_steps": 100},
        "rollout": {"n_samples_per_prompt": 2},
        "trainer": {"micro_batch_tokens": args.micro_batch_tokens, "optimizer": {"lr": 1e-6}, "precision": args.precision},
        "weight_sync": {"keep_last": 1},
    })
    trainer = Trainer(cfg, model=copy.deepcopy(base))
    plain = copy.deepcopy(base).to(args.device).train()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def trainer_step(groups):
        plan = trainer.begin_step(groups)
        tokens = 0
        for mb in plan.minibatches:
            tokens += int(trainer.forward_backward(mb)["processed_tokens"])
            trainer.optim_step(1e-6)
        return plan, tokens

    # Warm-up both, then alternate trainer and plain steps on the same batch so machine noise
    # (a shared 2-core machine) hits both alike; the min over repeats is the least-disturbed
    # measurement, the mean is reported too. Packing statistics use every batch.
    def sync():
        if args.device != "cpu":
            torch.cuda.synchronize()

    on_device = {"device": args.device, "autocast": args.precision == "bf16"}
    plan, _ = trainer_step(batches[0])
    plain_step(plain, opt, plan, 1.0, 1.0, trainer.share_prompts, **on_device)
    t_tr, t_pl = [], []
    tokens = 0
    for k in range(args.steps):
        t0 = time.perf_counter()
        plan, tokens = trainer_step(batches[1])
        sync()
        t_tr.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert plain_step(plain, opt, plan, 1.0, 1.0, trainer.share_prompts, **on_device) == tokens
        t_pl.append(time.perf_counter() - t0)
    lengths, micro = [], []
    for groups in batches:
        plan = trainer.begin_step(groups)
        plan.done = True  # statistics only: no forward pass
        offset = len(lengths)
        lengths += [s.num_tokens for s in plan.batch.samples]
        micro += [[offset + i for i in m] for mb in plan.minibatches for m in mb.micro_batches if m is not None]
    eff = packing_efficiency(lengths, micro)
    padded = sum(lengths) / sum(len(m) * max(lengths[i] for i in m) for m in micro)

    # publish + load, 135M fp32
    pubs, loads = [], []
    fresh = copy.deepcopy(base).to(args.device)
    for _ in range(2):
        trainer.step += 1
        t0 = time.perf_counter()
        pub = trainer.publish_weights()
        pubs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sd = load_state_dict_from_dir(pub["uri"])
        missing, unexpected = fresh.load_state_dict(sd, strict=False)
        sync()
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        loads.append(time.perf_counter() - t0)

    from bench._report import record_path

    result = {
        "model": record_path(args.model), "params": sum(p.numel() for p in base.parameters()), "threads": args.threads,
        "steps": args.steps, "samples_per_step": 2 * args.groups,
        "tokens_per_step": tokens, "trainer_step_seconds": t_tr, "plain_step_seconds": t_pl,
        "trainer_tokens_per_second": tokens / min(t_tr), "plain_tokens_per_second": tokens / min(t_pl),
        "throughput_ratio": min(t_pl) / min(t_tr),
        "throughput_ratio_of_means": (sum(t_pl) / len(t_pl)) / (sum(t_tr) / len(t_tr)),
        "load_average_1min": os.getloadavg()[0],
        "packing_efficiency": eff["packed"], "padding_efficiency_per_micro_batch": padded,
        "padding_efficiency_whole_batch": eff["padded"],
        "publish_seconds": min(pubs), "load_seconds": min(loads), "publish_plus_load_seconds": min(pubs) + min(loads),
        "publish_bytes": pub.get("publish_bytes"),
    }
    if args.device != "cpu":
        result.update(device=args.device, device_name=torch.cuda.get_device_name(args.device), precision=args.precision,
                      peak_memory_bytes=torch.cuda.max_memory_allocated(args.device))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
