"""The simulator's inputs and the configurations built from them: this machine's runs, and GPU clusters.

* Measured on this machine (docs/ files): the embedded engine's decode rate (eq. 1 fitted by
  :func:`cpu_engine`), the trainer's rate (:func:`cpu_trainer`), optimizer, publish, load and
  checkpoint times, the main job's prompt and response lengths; :func:`main_job_config` and
  :func:`bench_b_configs` are the runs the validation predicts, :data:`MAIN_MEASURED` what
  they measured.
* For GPUs: the HBM-bandwidth efficiency calibrated on SGLang's published latency
  (:func:`calibrate_bandwidth_efficiency`), the engine, weight sync and trainer built from it
  (:func:`gpu_engine`, :func:`gpu_weight_sync`, :func:`gpu_trainer`), the workloads and
  :func:`gpu_config`, one row of the scaling tables. Every assumption is named where it is set.
"""

from __future__ import annotations

import json
import math

from .components import EngineModel, TrainerModel
from .hardware import (
    A100,
    H100,
    IB_NDR_PORT_BYTES_PER_S,
    LLAMA31_8B,
    QWEN25_7B,
    SGLANG_A100_LLAMA8B,
    Hardware,
    ModelShape,
)
from .lengths import BenchParetoLength, CappedMixtureLength, LogNormalLength, PhasedLength, UniformLength
from .model import SimConfig

__all__ = ["CPU_DECODE_1T", "CPU_TRAINER_TOK_S_2T", "CPU_OPTIM_S", "CPU_PUBLISH_S", "CPU_LOAD_S", "CPU_CHECKPOINT_S",
           "CPU_CHECKPOINT_EVERY", "MAIN_PROMPT_TOKENS", "BENCH_B_PROMPT_TOKENS", "MAIN_LENGTHS", "cpu_engine",
           "cpu_trainer", "main_job_config", "MAIN_MEASURED", "bench_b_configs", "GPU_DECODE_COMPUTE_EFFICIENCY",
           "GPU_TRAIN_MFU", "GPU_SYNC_OVERHEAD_S", "calibrate_bandwidth_efficiency", "gpu_engine", "gpu_weight_sync",
           "gpu_trainer", "WORKLOADS", "GLOBAL_BATCH_GROUPS", "gpu_config"]

#: Embedded engine, SmolLM2-135M fp32, one torch thread: streamed requests -> generated tok/s
#: (docs/rollout.md, benchmark (a), "server" column: 19.2 / 71.2 / 110.0 at 1 / 8 / 32).
CPU_DECODE_1T = [(1, 19.2), (8, 71.2), (32, 110.0)]
#: Trainer, SmolLM2-135M fp32 ZeRO-0, 2 torch threads, quiet machine: 142.8 processed tok/s
#: (docs/trainer.md benchmark run 6; bench/trainer_bench_result.json).
CPU_TRAINER_TOK_S_2T = 142.8
#: Optimizer step of the main job's batch, 2 threads (docs/bench/trainer_profile.json, unshared_row).
CPU_OPTIM_S = 0.41
#: Publish (write + fsync + announce, 538 MB) and engine load (bench/trainer_bench_result.json).
CPU_PUBLISH_S, CPU_LOAD_S = 1.11, 0.03
#: Checkpoint phase, median of the two main-job runs (2.4 s and 3.1 s, docs/results.md), every 10 steps.
CPU_CHECKPOINT_S, CPU_CHECKPOINT_EVERY = 2.75, 10
#: The main job's prompt (docs/trainer.md: "the job's own 42-token prompts").
MAIN_PROMPT_TOKENS = 42
#: The benchmark (b) prompts: SmolLM2's chat template with its default system prompt around
#: "What is A + B? Answer briefly." is 43-45 tokens (counted with the model's tokenizer).
BENCH_B_PROMPT_TOKENS = 44

#: Response lengths of the main job (docs/results.md, docs/tasks.md, docs/bench/eval_backends.json):
#: the base model answers 28.9-30.6 tokens on average at T = 1 with 92-94 of 400 answers cut at 64
#: (23.5%); after ~12 steps the policy answers "46 + 9 = 55." in 3-10 tokens (docs/trainer.md's
#: late-run batch). The rest of the early distribution (log-normal, median 14, sigma 0.8: mean 29.7
#: with the cut share) and the crossover between versions 4 and 16 are assumptions fitted to those
#: figures ("the first 10 minutes", 12 steps, and a 30-45% partial ratio early at M = 32).
MAIN_LENGTHS = PhasedLength(
    early=CappedMixtureLength(0.235, 64, LogNormalLength(14, 0.8, 63)),
    late=UniformLength(3, 10), v0=4, v1=16)


def cpu_engine(threads: int) -> EngineModel:
    """The embedded engine on ``threads`` cores: eq. (1) fitted to CPU_DECODE_1T.

    Prefill: a forward pass costs a third of forward + backward (2N vs 6N FLOPs per token, Kaplan
    et al. 2020), so ``prefill_per_token = 1 / (3 * trainer tok/s at this thread count)``.
    """
    trainer_tps = CPU_TRAINER_TOK_S_2T * threads / 2.0
    return EngineModel.fit_cpu(CPU_DECODE_1T, threads=threads, measured_threads=1,
                               name=f"embedded engine, SmolLM2-135M fp32, {threads} thread(s)",
                               prefill_per_token=1.0 / (3.0 * trainer_tps), max_rows=64,
                               source="docs/rollout.md benchmark (a); prefill from docs/trainer.md run 6")


def cpu_trainer(threads: int) -> TrainerModel:
    """The DeepSpeed trainer on ``threads`` cores (the main job's unshared layout of docs/results.md).

    Tokens/s scale linearly with threads from the 2-thread measurement (an assumption: the
    main-job runs themselves took 31.9 s on one core and 17.5 s on two, a ratio of 1.82).
    """
    return TrainerModel(name=f"trainer, {threads} thread(s)", tokens_per_second=CPU_TRAINER_TOK_S_2T * threads / 2.0,
                        optim=CPU_OPTIM_S, publish=CPU_PUBLISH_S, checkpoint_interval=CPU_CHECKPOINT_EVERY,
                        checkpoint=CPU_CHECKPOINT_S, share_prompts=False)


def main_job_config(mode: str, admission_counts_ready: bool = True, duration: float | None = None,
                    seed: int = 0) -> SimConfig:
    """The main job of docs/results.md: ``async`` (§1) or ``sync`` (§2) on the 2-core machine."""
    common = dict(n_samples=8, max_response_len=64, prompt_tokens=MAIN_PROMPT_TOKENS, lengths=MAIN_LENGTHS,
                  servers=1, max_inflight=32, pause_mode="abort", notice=0.0, fetch=0.0, load=CPU_LOAD_S,
                  stale_policy="restart", admission_counts_ready=admission_counts_ready, seed=seed)
    if mode == "async":  # rollout core 0, trainer core 1
        return SimConfig(name="main job, async", rollout_batch_size=8, partial_percent=0.75, max_budget=32,
                         max_staleness=2, engine=cpu_engine(1), trainer=cpu_trainer(1),
                         duration=duration or 60.4 * 60, **common)
    if mode == "sync":  # every role gets both cores, generation and training alternate
        return SimConfig(name="main job, sync", rollout_batch_size=6, partial_percent=1.0, max_budget=64,
                         max_staleness=0, engine=cpu_engine(2), trainer=cpu_trainer(2),
                         duration=duration or 30.1 * 60, **common)
    raise ValueError(f"mode must be async or sync, got {mode!r}")


#: Measured figures of the main-job runs (docs/results.md §1-2 and docs/results/report-compare.md).
#: samples/s = 48 samples per step / seconds per step.
MAIN_MEASURED = {
    "async": {"seconds_per_step": 35.9, "samples_per_second": 48 / 35.9, "rollout_idle": 0.76, "trainer_idle": 0.00,
              "staleness_mean": 1.33, "staleness_max": 2},
    "sync": {"seconds_per_step": 25.8, "samples_per_second": 48 / 25.8, "rollout_idle": 0.79, "trainer_idle": 0.24,
             "staleness_mean": 0.0, "staleness_max": 0},
    # the 20-minute check after the admission change (docs/results.md): 28 steps in 1,228 s,
    # every train batch at staleness 2
    "async_after_change": {"seconds_per_step": 1228 / 28, "samples_per_second": 48 * 28 / 1228,
                           "staleness_mean": 2.0, "staleness_max": 2},
}


def bench_b_configs(path: str, seed: int = 0) -> list[tuple[SimConfig, dict[str, float]]]:
    """The runs of docs/rollout.md benchmark (b) stored in ``path`` (docs/bench/partial_*.json):
    one (SimConfig, measured) pair per mode, with the benchmark's own settings.

    The benchmark trainer takes a READY batch every ``train_seconds`` and publishes at once; the
    workers pause ``in_place`` and load a one-tensor directory (``load`` 0.05 s: an assumption).
    """
    with open(path) as f:
        d = json.load(f)
    threads = int(d["threads"])
    lengths = BenchParetoLength(d["pareto"]["x_m"], d["pareto"]["alpha"], d["max_response_len"], seed=0)
    out = []
    for r in d["results"]:
        R = int(d["rollout_batch_size"])
        p = r["train_batch_groups"] / R
        cfg = SimConfig(
            name=f"bench (b) {'sequential' if d['sequential'] else 'concurrent'}, {threads} thread(s), "
                 f"L {d['max_response_len']}, R {R}: {r['mode']}",
            rollout_batch_size=R, partial_percent=p, n_samples=int(d["n_samples"]), max_budget=int(r["max_budget"]),
            max_response_len=int(d["max_response_len"]), max_staleness=int(r["max_staleness"]),
            prompt_tokens=BENCH_B_PROMPT_TOKENS, lengths=lengths, servers=1, engine=cpu_engine(threads),
            max_inflight=int(d["inflight"]), pause_mode=r["pause_mode"], notice=0.0, load=0.05,
            trainer=TrainerModel(name="benchmark trainer", tick=float(d["train_seconds"])),
            warmup=20.0, duration=float(d["duration_seconds"]), seed=seed)
        measured = {"batches": r["batches"], "samples": r["samples"], "tokens": r["tokens"],
                    "tokens_per_second": r["tokens_per_second"], "engine_tokens_per_second": r["engine_tokens_per_second"],
                    "running_requests": r["mean_running_requests"], "staleness_mean": r["mean_staleness"]}
        out.append((cfg, measured))
    return out


# ==============================================================================================
# GPU cluster scenarios (published figures + named assumptions)

#: Decode matmul efficiency (fraction of BF16 peak) of a large decode batch: an assumption (the
#: prefill and the per-row decode FLOPs use it). For comparison, DeepSpeed-Ulysses sustains 54% of
#: peak in training (DEEPSPEED_SUSTAINED_MFU).
GPU_DECODE_COMPUTE_EFFICIENCY = 0.5
#: The trainer's model FLOPs utilisation with DeepSpeed ZeRO-3 on H100: an assumption below the
#: 54% DeepSpeed-Ulysses sustained on A100 (arXiv:2309.14509), since an RL step's micro-batches
#: are packed variable-length samples and ZeRO-3 gathers parameters every step.
GPU_TRAIN_MFU = 0.40
#: Fixed seconds added to a weight publish and to a server's weight load (HTTP calls, engine
#: pause/continue, tensor re-layout): an assumption. Moonshot's checkpoint-engine updates a
#: 1T-parameter Kimi-K2 across thousands of GPUs in about 20 s and GLM-4.5-Air (BF16) on 8 x H800
#: in 3.47 s (MoonshotAI/checkpoint-engine README), so a few seconds for 7B is conservative.
GPU_SYNC_OVERHEAD_S = 1.0


def calibrate_bandwidth_efficiency(ctx_tokens: float = 600.0) -> float:
    """The achieved fraction of HBM bandwidth in eq. (1), from SGLang's published latency.

    At 4 requests/s SGLang serves Llama-3.1-8B on one A100 with a median inter-token latency of
    11.93 ms and a median end-to-end latency of 1.564 s (SGLANG_A100_LLAMA8B), so by Little's law
    b = 4 x 1.564 = 6.3 requests decode together. Solving eq. (1) with the A100's 2,039 GB/s and
    312 TFLOPS, Llama-3.1-8B's 16.06 GB of BF16 weights and 131,072 KV bytes per token,
    ``ctx_tokens`` of context per request (an assumption; ShareGPT turns are a few hundred tokens,
    and the KV term is ~3% of the step) and the decode compute efficiency above:

        ITL = (W + b C kv) / (BW e) + b 2N / (peak e_c)  =>  e = (W + b C kv) / (BW (ITL - b 2N / (peak e_c)))
    """
    m, hw, pub = LLAMA31_8B, A100, SGLANG_A100_LLAMA8B
    b = pub["rps"] * pub["e2e_s"]
    compute = b * 2.0 * m.compute_params / (hw.bf16_flops * GPU_DECODE_COMPUTE_EFFICIENCY)
    return (m.weight_bytes + b * ctx_tokens * m.kv_bytes_per_token) / (hw.hbm_bytes_per_s * (pub["itl_s"] - compute))


def gpu_engine(hw: Hardware = H100, model: ModelShape = QWEN25_7B, max_rows: int = 256) -> EngineModel:
    """SGLang serving ``model`` on one ``hw`` GPU (TP 1): eq. (1) from the roofline, calibrated."""
    e_bw = calibrate_bandwidth_efficiency()
    return EngineModel.gpu(hw, model, e_bw, GPU_DECODE_COMPUTE_EFFICIENCY, max_rows=max_rows,
                           name=f"SGLang {model.name} on {hw.name} (e_bw {e_bw:.2f}, e_c {GPU_DECODE_COMPUTE_EFFICIENCY})")


def gpu_weight_sync(model: ModelShape = QWEN25_7B) -> tuple[float, float]:
    """(publish, load) seconds for one version over NCCL.

    nccl-tests (doc/PERFORMANCE.md): a broadcast of S bytes takes S / B with B the bottleneck link
    of the root; B = one InfiniBand NDR port, 50 GB/s (a DGX H100 has eight). The trainer first
    gathers its ZeRO-3 shards (one more S / B) then broadcasts; a server is paused for the
    broadcast. Plus GPU_SYNC_OVERHEAD_S each.
    """
    t = model.weight_bytes / IB_NDR_PORT_BYTES_PER_S
    return 2.0 * t + GPU_SYNC_OVERHEAD_S, t + GPU_SYNC_OVERHEAD_S


def gpu_trainer(gpus: int, hw: Hardware = H100, model: ModelShape = QWEN25_7B) -> TrainerModel:
    """DeepSpeed ZeRO-3 on ``gpus`` GPUs: eq. (2) FLOPs at GPU_TRAIN_MFU, data-parallel (linear)."""
    publish, _ = gpu_weight_sync(model)
    return TrainerModel(name=f"DeepSpeed on {gpus} x {hw.name}", flops_per_second=gpus * hw.bf16_flops * GPU_TRAIN_MFU,
                        model=model, optim=1.0, publish=publish, share_prompts=True)


#: Workloads of the scaling tables. Response lengths are assumptions, not measurements: a
#: long-tail reasoning model (log-normal, median 4,096 tokens, sigma 0.9, cut at 32,768: mean
#: ~6,100, 1% at the cut), in the range of the 27K-32K generation limits of AReaL and verl's
#: fully-async recipe; and short answers (median 384, sigma 0.6, cut at 4,096).
WORKLOADS = {
    "long-tail": {"lengths": LogNormalLength(4096, 0.9, 32768, lo=16), "prompt": 512, "L": 32768, "n": 16,
                  "budget": 8192},
    "short": {"lengths": LogNormalLength(384, 0.6, 4096, lo=8), "prompt": 256, "L": 4096, "n": 16,
              "budget": 1024},
}


#: Prompt groups per train step at every scale (strong scaling: the same job on more GPUs):
#: verl's fully-async recipe trains 512 prompts x 16 responses per step (docs/advance/fully_async.md:
#: train_batch_size 512, rollout.n 16), which is used here.
GLOBAL_BATCH_GROUPS = 512


def gpu_config(total_gpus: int, workload: str, mode: str, rollout_gpus: int | None = None,
               partial_percent: float = 0.8, max_staleness: int = 4, budget: int | None = None,
               pause_mode: str = "abort", steps: int | None = None, groups: int = GLOBAL_BATCH_GROUPS,
               seed: int = 0) -> SimConfig:
    """One row of the scaling tables: ``total_gpus`` H100s, B = ``groups`` prompt groups of n = 16
    per train step (GLOBAL_BATCH_GROUPS at every scale), a 7B model (QWEN25_7B).

    ``sync``: asyncrl's synchronous knobs, every GPU both rolls out and trains (colocated).
    ``async``: ``rollout_gpus`` SGLang servers and the rest training; R = B / p so that a train
    batch holds the same B groups; ``budget`` tokens per sample per version (None: the
    workload's), ``max_staleness``. The first third of the ``steps`` is warm-up, not measured.
    """
    w = WORKLOADS[workload]
    B = groups
    publish, load = gpu_weight_sync()
    common = dict(n_samples=w["n"], max_response_len=w["L"], prompt_tokens=w["prompt"], lengths=w["lengths"],
                  engine=gpu_engine(), notice=0.0, fetch=0.0, load=load, seed=seed)

    def inflight(R: int, servers: int) -> int:
        """``max_inflight_requests``: a server's share of the R groups being generated (each
        worker claims up to that many items and asyncrl has no other load balancing)."""
        return max(1, min(256, math.ceil(R * w["n"] / servers)))

    if mode == "sync":
        return SimConfig(name=f"{workload}, {total_gpus} GPUs, sync (colocated)", rollout_batch_size=B, partial_percent=1.0,
                         max_budget=w["L"], max_staleness=0, servers=total_gpus, trainer=gpu_trainer(total_gpus),
                         max_inflight=inflight(B, total_gpus), colocated=True, pause_mode=pause_mode,
                         steps=steps or 6, warmup_steps=max(1, (steps or 6) // 3), **common)
    if mode != "async":
        raise ValueError(f"mode must be sync or async, got {mode!r}")
    rollout_gpus = rollout_gpus or total_gpus * 3 // 4
    if not 0 < rollout_gpus < total_gpus:
        raise ValueError("async needs 0 < rollout_gpus < total_gpus")
    R = math.ceil(B / partial_percent - 1e-9)
    M = budget if budget is not None else (w["budget"] if partial_percent < 1 else w["L"])
    return SimConfig(name=f"{workload}, {total_gpus} GPUs, async {rollout_gpus}:{total_gpus - rollout_gpus}, "
                          f"p {partial_percent:g}, M {M}, eta {max_staleness}",
                     rollout_batch_size=R, partial_percent=partial_percent, max_budget=M, max_staleness=max_staleness,
                     servers=rollout_gpus, trainer=gpu_trainer(total_gpus - rollout_gpus), pause_mode=pause_mode,
                     max_inflight=inflight(R, rollout_gpus), steps=steps or 12,
                     warmup_steps=max(1, (steps or 12) // 3), **common)
