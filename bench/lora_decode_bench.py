"""LoRA decode benchmark (issue 30 item 2): the embedded engine's decode tokens/s with the base model,
a merged adapter, and the same adapter applied per request (SGLang's ``lora_path`` path).

For each batch size B (default 1, 4, 16), B samples of one ``--prompt-tokens`` prompt decode
``--gen-tokens`` tokens (``ignore_eos``, temperature 1, seeded) in an embedded engine
(``rollout_server.engine.Engine``, in this process, no HTTP) under

* **base** — the base model (the baseline of every ratio);
* **per_request** — a rank ``--rank`` PEFT adapter on ``--targets`` registered by name
  (``load_lora``) in the same engine and named by every sample: two extra matmuls per targeted
  linear per token (rollout_server/engine_lora.py);
* **merged** — the same adapter merged into the weights (``update_adapter``) of a second engine
  with its own copy of the model: the base model's arithmetic, so its ratio should be about 1.

Each repeat runs the three back to back (so a change of the machine's load hits them alike) and
gives one ratio to base per mode; the JSON holds the median tokens/s and the median of those
per-repeat ratios, per B. Decode tokens/s = the tokens after each sample's first, over the time
from the earliest first token to the last finish (prefill excluded). As a check, ``per_request``
and ``merged`` sample the same tokens with logprobs within 1e-3 (the same policy).

Run: ``python bench/lora_decode_bench.py [--model smollm2-135m-instruct] [--batch 1 4 16]
[--gen-tokens 64] [--rank 16] [--threads 1] [--json docs/bench/lora_decode.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapter(model, rank: int, targets: list[str], seed: int) -> tuple[dict, dict]:
    """A PEFT LoRA adapter on ``model`` with random ``A`` and ``B`` (``B`` ~ N(0, 0.01^2)): ``(tensors, adapter_config)``."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from trainer.lora import adapter_config_json

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    return state, adapter_config_json(peft_model)


def run_batch(engine, prompt: list[int], batch: int, gen_tokens: int, lora_name: str | None, tag: str) -> tuple[float, list[float]]:
    """Decode ``batch`` samples of ``prompt``; returns (decode tokens/s, the first sample's logprobs)."""
    from rollout_server.engine_sample import EngineGroup, EngineSample
    from rollout_server.schemas import sampling_params_from_dict

    params = sampling_params_from_dict({"max_new_tokens": gen_tokens, "ignore_eos": True, "temperature": 1.0,
                                        "sampling_seed": 1}, engine.vocab_size)
    samples = [EngineSample(rid=f"{tag}-{i}", prompt_ids=list(prompt), params=params, return_logprob=True,
                            lora_name=lora_name) for i in range(batch)]
    engine.submit([EngineGroup(list(prompt), samples)])
    while not all(s.published[1] is not None for s in samples):
        time.sleep(0.005)
    for s in samples:
        if s.finish_reason.get("type") != "length":
            raise RuntimeError(f"sample {s.rid} ended with {s.finish_reason}")
    t0 = min(s.first_token_time for s in samples)
    t1 = max(s.finished_time for s in samples)
    return batch * (gen_tokens - 1) / (t1 - t0), list(samples[0].output_logprobs)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", nargs="+", default=DEFAULT_TARGETS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import torch

    from asyncrl.models import load_causal_lm, resolve_model_path
    from rollout_server.engine import Engine

    torch.set_num_threads(a.threads)
    path = resolve_model_path(a.model)
    model = load_causal_lm(path, "float32")
    tensors, config = random_adapter(model, a.rank, a.targets, seed=0)
    prompt = [(17 * i + 5) % (model.config.vocab_size - 1) + 1 for i in range(a.prompt_tokens)]

    def engine_of(m):
        return Engine(m, None, context_len=a.prompt_tokens + a.gen_tokens + 8, max_batch_size=max(a.batch),
                      threads=a.threads, reserve_rows=0).start()

    import copy

    plain, merged = engine_of(model), engine_of(copy.deepcopy(model))
    modes = {"base": (plain, None), "per_request": (plain, "bench"), "merged": (merged, None)}
    runs: dict = {m: {str(b): [] for b in a.batch} for m in modes}
    ratios: dict = {m: {str(b): [] for b in a.batch} for m in ("per_request", "merged")}
    first_lps: dict = {}
    try:
        plain.call("load_lora", "bench", "(in memory)", tensors, config, "0" * 64).result()
        merged.call("update_adapter", tensors, config, "0" * 64, "1", False).result()
        for r in range(a.repeats):
            for b in a.batch:
                got = {}
                for mode, (engine, name) in modes.items():
                    got[mode], lps = run_batch(engine, prompt, b, a.gen_tokens, name, f"{mode}-{b}-{r}")
                    runs[mode][str(b)].append(got[mode])
                    first_lps.setdefault(mode, lps)
                for mode in ratios:
                    ratios[mode][str(b)].append(got[mode] / got["base"])
                print(f"repeat {r} B={b:3d}: " + ", ".join(f"{m} {got[m]:.1f}" for m in modes) + " decode tokens/s",
                      flush=True)
    finally:
        plain.stop()
        merged.stop()
    gap = max(abs(x - y) for x, y in zip(first_lps["per_request"], first_lps["merged"]))
    if gap > 1e-3:
        raise RuntimeError(f"per-request and merged adapters disagree by {gap} in logprob: not the same policy")
    out = {
        "bench": "lora_decode",
        "model": a.model,
        "rank": a.rank,
        "targets": a.targets,
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
        "threads": a.threads,
        "repeats": a.repeats,
        "decode_tokens_per_s_median": {m: {b: statistics.median(v) for b, v in d.items()} for m, d in runs.items()},
        "decode_tokens_per_s_runs": runs,
        "ratio_to_base": {m: {b: statistics.median(v) for b, v in d.items()} for m, d in ratios.items()},
        "ratio_to_base_runs": ratios,
        "per_request_vs_merged_max_logprob_gap": gap,
    }
    print(json.dumps(out["ratio_to_base"], indent=1))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
