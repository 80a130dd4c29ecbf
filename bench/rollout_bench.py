"""Rollout benchmark, part (a): the embedded server against the engine's own ceiling.

For each concurrency B (default 1, 8, 32):

* **ceiling** — in this process, a static batch of B prompts of the same length is prefilled
  once and decoded for ``--gen-tokens`` steps in a plain loop with transformers' KV cache
  (``DynamicCache``) and the engine's sampling (temperature 1, inverse-CDF draw, behaviour
  logprob; ``--sampler multinomial`` for the loop before 2026-11-29) — no server, no
  HTTP, no scheduling: what the model itself can do on this machine;
* **server** — the embedded server (``python -m rollout_server.server``, a separate process)
  receives B concurrent *streamed* ``/generate`` requests (``return_logprob``,
  ``ignore_eos``, same prompts and lengths) from the asyncrl client; the clock runs from the
  first request sent to the last ``[DONE]``.

Both report generated tokens per second; the ratio server/ceiling is the efficiency of
continuous batching + HTTP streaming (target at B = 32: >= 0.85). Both sides use the same
number of torch threads (``--threads``). Prompts are chat-formatted arithmetic questions cut
or padded to ``--prompt-tokens`` tokens.

Run: ``python bench/rollout_bench.py [--model smollm2-135m-instruct] [--concurrency 1 8 32]
[--prompt-tokens 64] [--gen-tokens 128] [--threads 2] [--json out.json]``.

On a GPU (``bench/gpu_check.py``): ``--device cuda [--dtype bfloat16]`` runs both on the GPU:
the ceiling loop, and the embedded server started with the same ``--device`` and ``--dtype``
(its engine runs where its model is). ``--no-server`` skips the server (its column is then null).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` distinct chat-formatted prompts of exactly ``length`` tokens."""
    prompts = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"What is {17 + i} + {29 * (i + 1)}? Think step by step. " * 8}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        ids = (ids * (length // max(1, len(ids)) + 1))[-length:]
        prompts.append(ids)
    return prompts


def ceiling(model, prompts: list[list[int]], gen_tokens: int, seed: int = 0, device: str = "cpu",
            sampler: str = "inverse_cdf") -> float:
    """Tokens/s of a static batch decoded with a KV cache in a plain loop (prefill included).

    Each step samples at temperature 1 and takes the sampled token's logprob. ``sampler``:
    ``inverse_cdf`` (default), the embedded engine's own draw
    (:func:`rollout_server.sampling.inverse_cdf_sample`, logprob = logit - logsumexp);
    ``multinomial``, this loop before 2026-11-29 (``log_softmax``, ``exp``, ``torch.multinomial``,
    whose serial per-row loop cost ~40 ms a step at 28 rows on two CPU cores).

    Raises:
        ValueError: an unknown ``sampler``.
    """
    import torch
    from transformers import DynamicCache

    from rollout_server.sampling import inverse_cdf_sample

    if sampler not in ("inverse_cdf", "multinomial"):
        raise ValueError(f"sampler must be 'inverse_cdf' or 'multinomial', got {sampler!r}")

    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor(prompts, device=device)
    B = ids.shape[0]
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for step in range(gen_tokens):
            logits = out.logits[:, -1, :].float()
            if sampler == "multinomial":
                logprobs = torch.log_softmax(logits, dim=-1)
                nxt = torch.multinomial(logprobs.exp(), 1, generator=g)
                _ = logprobs.gather(1, nxt)
            else:
                m = logits.amax(dim=-1, keepdim=True)
                e = (logits - m).exp_()
                lse = m + e.sum(dim=-1, keepdim=True).log_()
                u = torch.rand(B, 1, generator=g, dtype=torch.float64, device=device)
                nxt = inverse_cdf_sample(e, u)[:, None]
                _ = logits.gather(1, nxt) - lse
            if step == gen_tokens - 1:
                break
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    if device != "cpu":
        torch.cuda.synchronize()
    return B * gen_tokens / (time.perf_counter() - t0)


async def server_run(url: str, prompts: list[list[int]], gen_tokens: int) -> float:
    """Tokens/s of B concurrent streamed requests against a running server."""
    from rollout_server.client import EngineClient

    body = {"max_new_tokens": gen_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}
    async with EngineClient(url) as c:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(c.generate_collect(p, body) for p in prompts))
        dt = time.perf_counter() - t0
    n = sum(len(r.token_ids) for r in results)
    assert n == len(prompts) * gen_tokens, n
    return n / dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="runs per point (the best is kept)")
    ap.add_argument("--cumulative", action="store_true", help="cumulative streaming (default: incremental, as asyncrl launches it)")
    ap.add_argument("--device", default="cpu", help="where the ceiling loop runs: cpu (default) or cuda[:N]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype (default float32)")
    ap.add_argument("--sampler", default="inverse_cdf", choices=["inverse_cdf", "multinomial"],
                    help="the ceiling loop's draw: the engine's (default) or torch.multinomial (the loop before 2026-11-29)")
    ap.add_argument("--no-server", action="store_true", help="skip the embedded server (ceiling loop only)")
    ap.add_argument("--server-log", type=Path, default=None, help="the embedded server's log file (default: none kept)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    import torch

    torch.set_num_threads(a.threads)
    from asyncrl.models import load_causal_lm, load_tokenizer, resolve_model_path
    from rollout_server.testing import start_embedded_server

    path = resolve_model_path(a.model)
    model, tok = load_causal_lm(path, a.dtype).to(a.device), load_tokenizer(path)
    prompts_all = make_prompts(tok, max(a.concurrency), a.prompt_tokens)
    flags = ["--max-running-requests", str(max(64, max(a.concurrency)))]
    if not a.cumulative:
        flags.append("--incremental-streaming-output")
    if a.device != "cpu" or a.dtype != "float32":  # the server's engine where the ceiling runs, same weights
        flags += ["--device", a.device, "--dtype", a.dtype]
    server_error = None
    srv = None
    if not a.no_server:
        try:
            srv = start_embedded_server(path, *flags, threads=a.threads, log_path=a.server_log)
        except Exception as exc:  # the ceiling is still measured; the JSON says why the server column is empty
            server_error = f"the embedded server did not start: {type(exc).__name__}: {str(exc)[-1500:]}"
            print(server_error, flush=True)
    rows = []
    from bench._report import record_path

    header = {"model": record_path(path), "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens,
              "threads": a.threads, "streaming": "cumulative" if a.cumulative else "incremental",
              "server": not a.no_server, "cpu_count": os.cpu_count(), "concurrency_asked": list(a.concurrency),
              "ceiling_sampler": a.sampler}
    if a.device != "cpu" or a.dtype != "float32":
        header.update(device=a.device, dtype=a.dtype,
                      device_name=torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else a.device)

    def write_json(complete: bool) -> None:
        """Write the rows measured so far (after every batch size, so a run stopped from outside, as
        by bench/gpu_check.py's stage timeout, leaves what it measured; ``complete`` says whether
        every batch size of ``--concurrency`` was reached)."""
        if a.json:
            a.json.write_text(json.dumps({**header, "server_error": server_error, "load_average": os.getloadavg(),
                                          "complete": complete, "rows": rows}, indent=2))

    try:
        # warm both paths once
        ceiling(model, prompts_all[:2], 4, device=a.device, sampler=a.sampler)
        if srv is not None:
            asyncio.run(server_run(srv.url, prompts_all[:2], 4))
        for B in a.concurrency:
            prompts = prompts_all[:B]
            ceil_best = serv_best = 0.0
            for _ in range(a.repeats):
                ceil_best = max(ceil_best, ceiling(model, prompts, a.gen_tokens, device=a.device, sampler=a.sampler))
                if srv is not None:
                    try:
                        serv_best = max(serv_best, asyncio.run(server_run(srv.url, prompts, a.gen_tokens)))
                    except Exception as exc:  # keep measuring the ceiling; say where the server failed
                        server_error = f"the server failed at concurrency {B}: {type(exc).__name__}: {str(exc)[-1500:]}"
                        print(server_error, flush=True)
                        srv.stop()
                        srv = None
            if srv is None:
                rows.append({"concurrency": B, "ceiling_tokens_per_second": ceil_best, "server_tokens_per_second": None,
                             "ratio": None})
                print(f"B={B:3d}  ceiling {ceil_best:8.1f} tok/s", flush=True)
                write_json(complete=False)
                continue
            rows.append({"concurrency": B, "ceiling_tokens_per_second": ceil_best, "server_tokens_per_second": serv_best,
                         "ratio": serv_best / ceil_best})
            print(f"B={B:3d}  ceiling {ceil_best:8.1f} tok/s  server {serv_best:8.1f} tok/s  ratio {serv_best / ceil_best:5.2f}",
                  flush=True)
            write_json(complete=False)
    finally:
        if srv is not None:
            srv.stop()
    write_json(complete=True)
    print("| concurrent streamed requests | ceiling (tok/s) | server (tok/s) | server / ceiling |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        if r["ratio"] is None:
            print(f"| {r['concurrency']} | {r['ceiling_tokens_per_second']:.1f} | – | – |")
            continue
        print(f"| {r['concurrency']} | {r['ceiling_tokens_per_second']:.1f} | {r['server_tokens_per_second']:.1f} | {r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
