"""A discrete-event simulator of an asyncrl cluster: rollout servers, the buffer and the trainer.

``python -m bench.simulate validate`` (from the repository root) prints predicted vs measured
figures for the runs this repository measured on its 2-core machine; ``python -m bench.simulate
agents`` does the same for the slow-tool agent's runs (multi-call episodes with tool latency),
``python -m bench.simulate longtail`` for the long-tail task's runs (each with its own response
lengths); ``python -m bench.simulate
scaling`` prints the predicted asynchronous / synchronous speed-up for 8, 64 and 512 H100 GPUs;
``python -m bench.simulate run ...`` simulates one configuration; ``python -m bench.simulate doc
--write`` renders the generated tables of docs/scaling.md into it. ``--json FILE`` writes the raw
results. Everything is seeded (``--seed``): the same command prints the same numbers. The model,
its inputs, its validation and the tables are discussed in docs/scaling.md.

Modules (``from bench.simulate import ...`` gets every public name of them):

* the model: :mod:`~bench.simulate.hardware` (published GPU and model figures),
  :mod:`~bench.simulate.lengths` (response-length models), :mod:`~bench.simulate.components`
  (the engine's eq. 1 and the trainer's eq. 2), :mod:`~bench.simulate.buffer` (the port of the
  Lua scripts), :mod:`~bench.simulate.agents` (multi-call agent episodes and tool latency) and
  :mod:`~bench.simulate.model` (servers, the event loop, ``simulate``);
* :mod:`~bench.simulate.calibration`: the inputs measured here, the GPU calibration and the
  configurations built from them;
* :mod:`~bench.simulate.validation`, :mod:`~bench.simulate.agent_check` and
  :mod:`~bench.simulate.longtail_check` (predicted vs measured: the main job and benchmark (b);
  the slow-tool agent; the long-tail task) and :mod:`~bench.simulate.scaling`
  (the GPU predictions, the published results);
* :mod:`~bench.simulate.tables` (the printed tables and docs/scaling.md's) and
  :mod:`~bench.simulate.cli` (the command line).

What is modelled
================

**Buffer** (``Buffer``): a Python port of the state transitions of ``buffers/lua/*.lua``, one
method per script, same order of checks:

* admission (``settings.lua: admit``, AReaL eq. 3): a pending group is admitted while fewer than
  R groups are *generating* (admitted, not READY, not batched) **and**
  ``admitted < (eta + v + 1) * B * batches_per_version`` (``admitted`` counts groups admitted
  and not dropped, v is the clock). ``admission_counts_ready=True`` reproduces the rule before
  the third session (READY groups held a slot too, docs/buffer.md "Changed in the third
  session"), which the 60-minute runs of docs/results.md were measured with;
* ``claim.lua``: parked samples whose budget version is older than the clock become resumable,
  admission runs, then items are handed out in the Lua order: resumable partials (oldest
  policy version first; a resumable whose budget under this version is spent is parked
  instead), fresh samples (oldest group first), and only when nothing else is admissible a
  budget-parked sample under the same version (``idle`` resume: its budget window restarts).
  A partial about to resume whose staleness ``v - minv`` exceeds eta gets the stale policy
  (``restart``: back to its pristine prompt; ``drop``: its group is dropped). Each item gets
  ``max_new_tokens = min(M - used, L - len)`` where ``used`` is the tokens produced under the
  clock's version;
* ``append.lua`` (``end_segment``): per token version ``tv``: ``tv > bver`` starts a new budget
  window (``bver = tv, bused = 0``), ``bused += 1``, ``minv = min(minv, tv)``; ``stop`` or
  ``len >= L`` completes the sample; a segment that used its ``max_new_tokens`` (``budget``) or
  ``bused >= M`` parks it at ``bver``; ``abort`` makes it resumable (or pending with no token);
* ``score.lua``: rewards are instantaneous; the group is READY when all n samples are scored;
* ``next_batch.lua``: READY groups oldest first, each checked for staleness
  ``v - min(minv over its samples) > eta`` (``restart``: the group is regenerated whole;
  ``drop``: dropped); a batch is formed only with B groups; ``acknowledge`` admits.

**Rollout server** (``Server``): one engine (an SGLang server on a GPU or the embedded torch
engine on CPU cores) plus its rollout worker. Continuous batching as a *fluid* model: every
running request advances one token per decode step, and a decode step with ``b`` rows holding
``C`` tokens of context lasts

    t_step(b, C) = alpha + beta * b + gamma * C                                        (1)

seconds (``EngineModel``). Between two events the batch does not change, so the time of the next
segment end is exact for gamma = 0 and piecewise constant (refreshed every ``refresh_steps``
steps) for gamma > 0. Requests that join are prefilled first (``prefill_per_token`` seconds per
token, stalling the running rows): a group's shared prompt once with SGLang's radix cache
(``shared_prefix``), every request in full on the embedded engine, which has no prefix cache
while the worker sends one request per sample; prompt + response for a resumed sample. The
worker keeps ``max_inflight`` items claimed; the engine runs at most ``max_rows`` of them and
only while their context plus segment fits ``kv_capacity`` (a claimed item that does not fit
waits in the engine's queue, as SGLang's waiting queue). On a published version the server
(after ``notice`` seconds: pub/sub) fetches, pauses (``abort``: running requests end with their
partial output and are resumed later with the KV recomputed; ``in_place``: they keep their KV
and continue under the new version), loads for ``load`` seconds and continues; a worker that
claims while its engine is behind the clock loads first (``RolloutWorker._catch_up``).
With ``SimConfig.engine_wide`` (``resources.core_sharing: follow``) a server decodes with that
engine while the trainer waits for a batch and with ``engine`` while it trains.

**Agent episodes** (``SimConfig.agent``, :mod:`~bench.simulate.agents`): a sample is a sequence of
model calls separated by tool calls; at a tool call its request leaves the engine and waits the
tool's latency holding its worker slot (the server counts as idle when only tool waits are in
flight), then the next call is prefilled whole (no prefix cache across calls). Each episode's
calls and observations are drawn from a run's own recorded episodes, by policy version.

**Trainer** (``TrainerModel``): ``wait_batch`` polls ``next_batch`` every ``poll`` seconds; a
step then takes ``forward_backward`` + ``optim`` + ``publish`` (+ ``checkpoint`` every
``checkpoint_interval`` steps), acknowledging before the publish and moving the clock at the
end of the publish, as ``trainer/loop.py`` does. ``forward_backward`` is either processed tokens
/ measured tokens-per-second (CPU) or FLOPs / (GPUs x peak x MFU) (GPU) with the forward +
backward FLOPs of a sample of S = prompt + response tokens

    F(S) = 6 N S + 3 n_layer d_model S^2                                               (2)

(Kaplan et al. 2020, arXiv:2001.08361, Table 1: 2N + 2 n_layer n_ctx d_attn per token forward,
x3 for forward + backward, summed over the causal context 1..S). Processed tokens are
``prompt + response[:-1]`` per sample (or the prompt once per group with
``share_prompts``, docs/trainer.md). The benchmark's simulated trainer of docs/rollout.md
(take a READY batch every ``tick`` seconds, publish at once) is ``tick``.

**Synchronous mode** is the same machinery with asyncrl's synchronous knobs (p = 1,
M >= max_response_len, eta = 0, docs/concepts.md): the buffer admits one rollout batch per
version, so generation and training alternate. ``colocated=True`` gives every GPU to both roles
(the servers stall while the trainer computes), which is what ``asyncrl train`` does with the
synchronous knobs (docs/results.md) and what verl's and AReaL's synchronous baselines do.

**Measured quantities** (``SimResult``), with asyncrl's definitions: seconds per train step,
trained samples and response tokens per second, the trainer's idle ratio (``wait_batch`` share of
each step, averaged over steps: ``asyncrl/controller/run_watch.py``), each rollout server's idle ratio (time
with no request in flight: ``RolloutWorker._set_idle``), running requests (time average, as
``/v1/loads`` sampled), staleness of every trained group (mean, max), restarts and drops, and the
books: groups fed = trained + live + dropped.

What is not modelled
====================

Reward computation time (instantaneous), Redis round trips and the worker's claim poll delay
(a free slot is filled at once), failures and recovery, the engine's per-request scheduling
order beyond FIFO, SGLang's radix-cache reuse between a group's samples beyond the shared prompt
prefill, chunked prefill (a prefill stalls the decode batch), KV retraction (a segment reserves
its whole budget), tensor parallelism inside a server, contention between roles sharing CPU
cores, evaluation pauses, and the learning dynamics: response lengths come from a length model
(``LengthModel``), possibly a function of the policy version, never from the policy.

Inputs and sources
==================

Measured on this machine (docs/ files): the embedded engine's decode throughput against batch
size (docs/rollout.md benchmark (a): 19.2 / 71.2 / 110.0 tok/s at 1 / 8 / 32 streamed requests,
one thread), the trainer's throughput (docs/trainer.md benchmark run 6, 142.8 tok/s on 2
threads; optimizer 0.41 s, docs/bench/trainer_profile.json), publish 1.11 s and load 0.03 s
(bench/trainer_bench_result.json), response lengths and prompt length of the main job
(docs/results.md, docs/trainer.md). Published figures for GPUs (every number with its source in
``H100``, ``A100``, ``QWEN25_7B``, ``LLAMA31_8B``, ``SGLANG_A100_LLAMA8B`` and
``IB_NDR_PORT_BYTES_PER_S`` of :mod:`bench.simulate.hardware`, and in docs/scaling.md): NVIDIA's H100 and A100 datasheets,
SGLang's published Llama-3.1-8B inter-token latency (sgl-project/sglang
``benchmark/benchmark_vllm_060/README.md``), DeepSpeed-Ulysses' sustained training throughput
(arXiv:2309.14509), nccl-tests' broadcast bandwidth formula (NVIDIA/nccl-tests
``doc/PERFORMANCE.md``) and the DGX H100 InfiniBand ports (NVIDIA DGX BasePOD reference
architecture). Anything else is an assumption and is named as one where it is set.

Only the standard library is imported.
"""

from __future__ import annotations

from .agent_check import agent_validation, calculator_config
from .agents import AgentModel, Episode, Episodes, ToolLatency, episodes_from_trace
from .buffer import Buffer, Group, Sample, WorkItem
from .calibration import (
    BENCH_B_PROMPT_TOKENS,
    CPU_CHECKPOINT_EVERY,
    CPU_CHECKPOINT_S,
    CPU_DECODE_1T,
    CPU_LOAD_S,
    CPU_OPTIM_S,
    CPU_PUBLISH_S,
    CPU_TRAINER_TOK_S_2T,
    GLOBAL_BATCH_GROUPS,
    GPU_DECODE_COMPUTE_EFFICIENCY,
    GPU_SYNC_OVERHEAD_S,
    GPU_TRAIN_MFU,
    MAIN_LENGTHS,
    MAIN_MEASURED,
    MAIN_PROMPT_TOKENS,
    WORKLOADS,
    bench_b_configs,
    calibrate_bandwidth_efficiency,
    cpu_engine,
    cpu_trainer,
    gpu_config,
    gpu_engine,
    gpu_trainer,
    gpu_weight_sync,
    main_job_config,
)
from .cli import main
from .components import INF, EngineModel, TrainerModel
from .hardware import (
    A100,
    DEEPSPEED_SUSTAINED_MFU,
    H100,
    IB_NDR_PORT_BYTES_PER_S,
    LLAMA31_8B,
    QWEN25_7B,
    SGLANG_A100_LLAMA8B,
    Hardware,
    ModelShape,
)
from .lengths import (
    BenchParetoLength,
    CappedMixtureLength,
    FixedLength,
    LengthModel,
    LogNormalLength,
    PerSampleLength,
    PhasedLength,
    RecordedGroupLengths,
    UniformLength,
)
from .longtail_check import longtail_config, longtail_validation
from .model import Req, Server, SimConfig, SimResult, Simulator, StepRecord, simulate, train_batch_groups
from .scaling import ASYNC_SETTINGS, PUBLISHED, ROLLOUT_FRACTIONS, scaling
from .tables import doc_blocks, print_scaling, print_validation, read_blocks, write_blocks
from .validation import validation

__all__ = [
    "agent_validation", "calculator_config", "AgentModel", "Episode", "Episodes", "ToolLatency", "episodes_from_trace",
    "Buffer", "Group", "Sample", "WorkItem", "BENCH_B_PROMPT_TOKENS", "CPU_CHECKPOINT_EVERY", "CPU_CHECKPOINT_S",
    "CPU_DECODE_1T", "CPU_LOAD_S", "CPU_OPTIM_S", "CPU_PUBLISH_S", "CPU_TRAINER_TOK_S_2T", "GLOBAL_BATCH_GROUPS",
    "GPU_DECODE_COMPUTE_EFFICIENCY", "GPU_SYNC_OVERHEAD_S", "GPU_TRAIN_MFU", "MAIN_LENGTHS", "MAIN_MEASURED",
    "MAIN_PROMPT_TOKENS", "WORKLOADS", "bench_b_configs", "calibrate_bandwidth_efficiency", "cpu_engine",
    "cpu_trainer", "gpu_config", "gpu_engine", "gpu_trainer", "gpu_weight_sync", "main_job_config", "main", "INF",
    "EngineModel", "TrainerModel", "A100", "DEEPSPEED_SUSTAINED_MFU", "H100", "IB_NDR_PORT_BYTES_PER_S", "LLAMA31_8B",
    "QWEN25_7B", "SGLANG_A100_LLAMA8B", "Hardware", "ModelShape", "BenchParetoLength", "CappedMixtureLength",
    "FixedLength", "LengthModel", "LogNormalLength", "PerSampleLength", "PhasedLength", "RecordedGroupLengths",
    "UniformLength", "longtail_config", "longtail_validation", "Req",
    "Server", "SimConfig", "SimResult", "Simulator", "StepRecord", "simulate", "train_batch_groups", "ASYNC_SETTINGS",
    "PUBLISHED", "ROLLOUT_FRACTIONS", "scaling", "doc_blocks", "print_scaling", "print_validation", "read_blocks",
    "write_blocks", "validation",
]
