"""A discrete-event simulator of an asyncrl cluster: rollout servers, the buffer and the trainer.

``python bench/simulate.py validate`` prints predicted vs measured figures for the runs this
repository measured on its 2-core machine; ``python bench/simulate.py scaling`` prints the
predicted asynchronous / synchronous speed-up for 8, 64 and 512 H100 GPUs; ``python
bench/simulate.py run ...`` simulates one configuration. ``--json FILE`` writes the raw
results. Everything is seeded (``--seed``): the same command prints the same numbers. The model,
its inputs, its validation and the tables are discussed in docs/scaling.md.

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
``IB_NDR_PORT_BYTES_PER_S`` below, and in docs/scaling.md): NVIDIA's H100 and A100 datasheets,
SGLang's published Llama-3.1-8B inter-token latency (sgl-project/sglang
``benchmark/benchmark_vllm_060/README.md``), DeepSpeed-Ulysses' sustained training throughput
(arXiv:2309.14509), nccl-tests' broadcast bandwidth formula (NVIDIA/nccl-tests
``doc/PERFORMANCE.md``) and the DGX H100 InfiniBand ports (NVIDIA DGX BasePOD reference
architecture). Anything else is an assumption and is named as one where it is set.

Only the standard library is imported.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

INF = float("inf")


def train_batch_groups(partial_percent: float, rollout_batch_size: int) -> int:
    """B = ceil(p * R) prompt groups per train batch.

    The same formula as ``asyncrl.core.config.train_batch_groups`` (not imported: this module imports
    nothing heavy; ``tests/test_simulate.py`` pins the two together).
    """
    return max(1, math.ceil(partial_percent * rollout_batch_size - 1e-9))


# ==============================================================================================
# Published hardware and model figures (sources in the docstrings; see docs/scaling.md)


@dataclass(frozen=True)
class Hardware:
    """One accelerator's published peak figures.

    Attributes:
        name: the part.
        hbm_bytes: GPU memory, bytes.
        hbm_bytes_per_s: peak memory bandwidth, bytes/s.
        bf16_flops: dense BF16 tensor-core peak, FLOP/s.
        source: where the numbers come from.
    """

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    source: str


H100 = Hardware(
    "H100 SXM", 80e9, 3.35e12, 989e12,
    "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 80 GB HBM3, 3.35 TB/s, BF16 Tensor Core "
    "1,979 TFLOPS with sparsity = 989 TFLOPS dense, NVLink 900 GB/s "
    "(https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet)")
A100 = Hardware(
    "A100 80GB SXM", 80e9, 2.039e12, 312e12,
    "NVIDIA A100 datasheet, A100 80GB SXM: 2,039 GB/s HBM2e, BF16 Tensor Core 312 TFLOPS dense "
    "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)")

#: One InfiniBand NDR port, bytes/s (400 Gb/s). A DGX H100 has eight single-port ConnectX-7
#: adapters "up to 400 Gb/s InfiniBand/Ethernet" (NVIDIA DGX BasePOD reference architecture,
#: https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/core-components.html).
IB_NDR_PORT_BYTES_PER_S = 400e9 / 8


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's size, from its Hugging Face ``config.json``.

    Attributes:
        name: the model.
        params: all parameters.
        embedding_params: input-embedding parameters (no FLOPs; the LM head is counted in N).
        n_layer, d_model: layers and hidden size (attention FLOPs, eq. 2).
        kv_heads, head_dim: for the KV cache: ``2 * n_layer * kv_heads * head_dim * 2`` bytes
            per token in BF16.
        source: where the shape comes from.
    """

    name: str
    params: float
    embedding_params: float
    n_layer: int
    d_model: int
    kv_heads: int
    head_dim: int
    source: str

    @property
    def compute_params(self) -> float:
        """N of eq. (2): parameters that cost 2 FLOPs per token forward (all but the embedding)."""
        return self.params - self.embedding_params

    @property
    def weight_bytes(self) -> float:
        """BF16 weights, bytes."""
        return 2.0 * self.params

    @property
    def kv_bytes_per_token(self) -> float:
        """BF16 K and V of one token over all layers, bytes."""
        return 2.0 * self.n_layer * self.kv_heads * self.head_dim * 2.0

    def train_flops(self, seq_tokens: float) -> float:
        """Forward + backward FLOPs of one sequence of ``seq_tokens`` tokens, eq. (2)."""
        return 6.0 * self.compute_params * seq_tokens + 3.0 * self.n_layer * self.d_model * seq_tokens ** 2


QWEN25_7B = ModelShape(
    "Qwen2.5-7B", 7.62e9, 152064 * 3584, 28, 3584, 4, 128,
    "Qwen/Qwen2.5-7B config.json: 28 layers, hidden 3584, 28 heads, 4 KV heads (head dim 128), "
    "intermediate 18944, vocab 152064, untied LM head: 7.62B parameters (the model card rounds to 7.61B)")
LLAMA31_8B = ModelShape(
    "Llama-3.1-8B", 8.03e9, 128256 * 4096, 32, 4096, 8, 128,
    "meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 8 KV heads (head dim 128), "
    "vocab 128256; 8.03B parameters")

#: SGLang v0.3.0, Llama-3.1-8B-Instruct on 1 x A100 80G, ShareGPT at 4 requests/s: median
#: inter-token latency 11.93 ms (median TPOT 13.17 ms, median E2E latency 1,564 ms); offline
#: 5,000 prompts: 4,281.51 output tok/s (sgl-project/sglang benchmark/benchmark_vllm_060/README.md).
SGLANG_A100_LLAMA8B = {"itl_s": 11.93e-3, "e2e_s": 1.56417, "rps": 4.0, "offline_tok_s": 4281.51}

#: DeepSpeed-Ulysses: "sustained throughput of over 175 TFlops/GPU (over 54% of hardware peak)"
#: on A100 (Jacobs et al., arXiv:2309.14509; microsoft/DeepSpeed blogs/deepspeed-ulysses).
DEEPSPEED_SUSTAINED_MFU = 0.54


# ==============================================================================================
# Component models


class LengthModel(ABC):
    """Response lengths (tokens) of the n samples of a prompt group.

    ``lengths(rng, feed_index, version, n)`` draws them when the group is admitted (``version``
    is the clock then); ``resample_on_restart`` says whether a regenerated sample draws again (a
    new sample of the current policy) or keeps its length (lengths fixed by the prompt).
    """

    resample_on_restart = True

    @abstractmethod
    def lengths(self, rng: random.Random, feed_index: int, version: int, n: int) -> list[int]:
        """``n`` lengths for the group fed at ``feed_index``, admitted at policy ``version``."""

    def describe(self) -> str:
        """One line for the tables."""
        return type(self).__name__


class PerSampleLength(LengthModel):
    """A length model whose samples are independent draws: subclasses give :meth:`one`."""

    def lengths(self, rng: random.Random, feed_index: int, version: int, n: int) -> list[int]:
        """``n`` independent draws of :meth:`one`."""
        return [self.one(rng, version) for _ in range(n)]

    @abstractmethod
    def one(self, rng: random.Random, version: int) -> int:
        """One length (tokens) for a sample generated at policy ``version``."""


@dataclass
class FixedLength(PerSampleLength):
    """Every response has ``n`` tokens."""

    n: int

    def one(self, rng: random.Random, version: int) -> int:
        """``n``."""
        return self.n

    def describe(self) -> str:
        """One line for the tables."""
        return f"fixed {self.n}"


@dataclass
class UniformLength(PerSampleLength):
    """Uniform integer in [lo, hi]."""

    lo: int
    hi: int

    def one(self, rng: random.Random, version: int) -> int:
        """Uniform in [lo, hi]."""
        return rng.randint(self.lo, self.hi)

    def describe(self) -> str:
        """One line for the tables."""
        return f"uniform [{self.lo}, {self.hi}]"


@dataclass
class LogNormalLength(PerSampleLength):
    """Log-normal with the given median and sigma (of the log), rounded, clipped to [lo, cap]."""

    median: float
    sigma: float
    cap: int
    lo: int = 1

    def one(self, rng: random.Random, version: int) -> int:
        """``median * exp(sigma * z)``, z ~ N(0, 1), clipped."""
        return max(self.lo, min(self.cap, int(round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))))))

    def describe(self) -> str:
        """One line for the tables."""
        return f"log-normal median {self.median:g}, sigma {self.sigma:g}, cap {self.cap}"


@dataclass
class CappedMixtureLength(PerSampleLength):
    """With probability ``p_cap`` exactly ``cap`` tokens, else ``rest`` (clipped below cap)."""

    p_cap: float
    cap: int
    rest: LengthModel

    def one(self, rng: random.Random, version: int) -> int:
        """``cap`` or a draw of ``rest``."""
        if rng.random() < self.p_cap:
            return self.cap
        return min(self.cap - 1, self.rest.one(rng, version))

    def describe(self) -> str:
        """One line for the tables."""
        return f"{self.p_cap:.1%} at {self.cap}, else {self.rest.describe()}"


@dataclass
class PhasedLength(PerSampleLength):
    """``early`` lengths at version <= v0, ``late`` from v1 on, linearly mixed in between.

    Stands for a policy whose answers change during training (docs/results.md: long answers
    in the first ~12 steps of the main job, 3-10 tokens after).
    """

    early: LengthModel
    late: LengthModel
    v0: int
    v1: int

    def one(self, rng: random.Random, version: int) -> int:
        """A draw of ``early`` with probability (v1 - version) / (v1 - v0), else ``late``."""
        w = 1.0 if version <= self.v0 else 0.0 if version >= self.v1 else (self.v1 - version) / (self.v1 - self.v0)
        return self.early.one(rng, version) if rng.random() < w else self.late.one(rng, version)

    def describe(self) -> str:
        """One line for the tables."""
        return f"{self.early.describe()} until v{self.v0}, {self.late.describe()} from v{self.v1}"


class BenchParetoLength(LengthModel):
    """The exact target lengths of ``bench/rollout_partial_bench.py`` (``target_lengths``).

    ``min(cap, floor(x_m * U**(-1/alpha)))``, U ~ (0, 1], from ``random.Random(seed)``; the group fed
    at index c gets ``lengths[c*n:(c+1)*n]`` (its metadata), so a restarted sample keeps its length.
    """

    resample_on_restart = False

    def __init__(self, x_m: float, alpha: float, cap: int, seed: int = 0, count: int = 200_000):
        self.x_m, self.alpha, self.cap, self.seed = x_m, alpha, cap, seed
        rng = random.Random(seed)
        self._seq = []
        for _ in range(count):
            u = 1.0 - rng.random()
            self._seq.append(max(1, min(cap, int(x_m * u ** (-1.0 / alpha)))))

    def lengths(self, rng: random.Random, feed_index: int, version: int, n: int) -> list[int]:
        """The benchmark's lengths of group ``feed_index``."""
        return self._seq[feed_index * n:(feed_index + 1) * n]

    def describe(self) -> str:
        """One line for the tables."""
        return f"Pareto x_m {self.x_m:g}, alpha {self.alpha:g}, cap {self.cap} (the benchmark's sequence)"


@dataclass
class EngineModel:
    """Decode and prefill time of one rollout server, eq. (1).

    Attributes:
        name: what this stands for.
        alpha: seconds per decode step regardless of batch (weights read, per-step overhead).
        beta: seconds per decode step per running row (per-token compute).
        gamma: seconds per decode step per token of context held in the KV cache (KV read).
        prefill_per_token: seconds per prefilled token (stalls the decode batch).
        max_rows: most running requests (SGLang ``--max-running-requests``,
            ``rollout.engine_max_batch_size``).
        kv_capacity: most tokens of context the KV cache holds (inf: no limit).
        shared_prefix: the samples of a prompt group claimed together prefill their prompt once
            (SGLang's radix cache); False for the embedded engine, which shares a prefill only
            between the ``n`` samples of one request, while the worker sends one request per sample.
        refresh_steps: with gamma > 0, the step time is recomputed at least this often.
        source: where the figures come from.
    """

    name: str
    alpha: float
    beta: float
    gamma: float = 0.0
    prefill_per_token: float = 0.0
    max_rows: int = 64
    kv_capacity: float = INF
    shared_prefix: bool = False
    refresh_steps: int = 256
    source: str = ""

    def step_seconds(self, rows: int, kv_tokens: float) -> float:
        """Eq. (1): seconds of one decode step with ``rows`` rows holding ``kv_tokens`` tokens."""
        return self.alpha + self.beta * rows + self.gamma * kv_tokens

    def tokens_per_second(self, rows: int, context: float) -> float:
        """Steady decode throughput with ``rows`` rows of ``context`` tokens each, tok/s."""
        return rows / self.step_seconds(rows, rows * context)

    @staticmethod
    def fit_cpu(points: list[tuple[int, float]], threads: float = 1.0, measured_threads: float = 1.0,
                **kw: Any) -> "EngineModel":
        """alpha, beta by least squares of step time ``b / tok_s(b)`` against b.

        ``threads`` other than ``measured_threads`` scales beta by measured/threads and keeps
        alpha: per-row compute parallelises over threads, the per-step overhead (Python,
        scheduling, sampling) does not. That split is an assumption; see docs/scaling.md.
        """
        xs = [float(b) for b, _ in points]
        ys = [b / tps for b, tps in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        alpha = my - beta * mx
        beta *= measured_threads / threads
        kw.setdefault("name", "fitted engine")
        return EngineModel(alpha=alpha, beta=beta, **kw)

    @staticmethod
    def gpu(hw: Hardware, model: ModelShape, bw_efficiency: float, compute_efficiency: float,
            max_rows: int = 256, mem_fraction: float = 0.88, name: str = "", source: str = "") -> "EngineModel":
        """A roofline engine: eq. (1) with

        alpha = weight_bytes / (BW * e_bw), beta = 2 N / (peak * e_c), gamma = kv_bytes / (BW * e_bw),
        prefill = 2 N / (peak * e_c) per token, KV capacity = (mem_fraction * HBM - weights) / kv_bytes.

        Decoding reads every weight once per step and every cached token's K and V once per step
        (memory-bound), and does 2 N FLOPs per row (Kaplan et al. 2020). ``mem_fraction`` 0.88 is
        SGLang's static memory fraction at TP 1 quoted in benchmark_vllm_060/README.md.
        """
        bw = hw.hbm_bytes_per_s * bw_efficiency
        flops = hw.bf16_flops * compute_efficiency
        return EngineModel(
            name=name or f"SGLang {model.name} on {hw.name}",
            alpha=model.weight_bytes / bw, beta=2.0 * model.compute_params / flops,
            gamma=model.kv_bytes_per_token / bw, prefill_per_token=2.0 * model.compute_params / flops,
            max_rows=max_rows, kv_capacity=max(0.0, mem_fraction * hw.hbm_bytes - model.weight_bytes) / model.kv_bytes_per_token,
            shared_prefix=True, source=source or f"{hw.source}; {model.source}")


@dataclass
class TrainerModel:
    """Time of one train step's phases (trainer/loop.py).

    ``forward_backward = overhead + processed_tokens / tokens_per_second`` when
    ``tokens_per_second`` is set (measured CPU rate), else ``overhead + sum_samples F(S) /
    flops_per_second`` with F of eq. (2) (``model``) and ``flops_per_second = GPUs * peak * MFU``.

    Attributes:
        name: what this stands for.
        tokens_per_second / flops_per_second, model: the rate (one of the two).
        overhead: fixed seconds per forward_backward.
        optim: seconds of the optimizer step.
        publish: seconds from the end of the optimizer step to the announce (write + announce,
            or the NCCL broadcast).
        checkpoint_interval, checkpoint: a checkpoint of ``checkpoint`` seconds every so many steps.
        poll: ``wait_batch`` polling period (buffers.ReplayBuffer.wait_batch: 0.05 s).
        tick: if set, the benchmark trainer of docs/rollout.md (b): every ``tick`` seconds take a
            READY batch, if any, and publish at once (no compute).
        share_prompts: the prompt is processed once per group (docs/trainer.md, trainer.share_prompts).
    """

    name: str = "trainer"
    tokens_per_second: float | None = None
    flops_per_second: float | None = None
    model: ModelShape | None = None
    overhead: float = 0.0
    optim: float = 0.0
    publish: float = 0.0
    checkpoint_interval: int = 0
    checkpoint: float = 0.0
    poll: float = 0.05
    tick: float | None = None
    share_prompts: bool = False

    def forward_backward_seconds(self, groups: list["Group"], prompt_tokens: int) -> float:
        """Seconds of forward + backward over the batch ``groups``."""
        if self.tick is not None:
            return 0.0
        if self.tokens_per_second:
            tokens = 0
            for g in groups:
                resp = sum(max(0, s.length - 1) for s in g.samples)
                tokens += resp + (prompt_tokens if self.share_prompts else prompt_tokens * len(g.samples))
            return self.overhead + tokens / self.tokens_per_second
        assert self.flops_per_second and self.model is not None, "a trainer needs a token rate or a FLOP rate"
        flops = sum(self.model.train_flops(prompt_tokens + s.length) for g in groups for s in g.samples)
        return self.overhead + flops / self.flops_per_second


# ==============================================================================================
# Buffer (port of buffers/lua)


class Sample:
    """One sample's buffer state (the fields of ``sample:<gid>/<i>`` the scripts read)."""

    __slots__ = ("sid", "group", "idx", "target", "length", "status", "minv", "bver", "bused",
                 "restarts", "resumes", "qtoken", "maxv")

    def __init__(self, sid: int, group: "Group", idx: int, target: int):
        self.sid, self.group, self.idx, self.target = sid, group, idx, target
        self.length = 0
        self.status = "pending"
        self.minv = self.bver = self.maxv = -1
        self.bused = 0
        self.restarts = self.resumes = 0
        self.qtoken = 0


class Group:
    """One prompt group's buffer state."""

    __slots__ = ("gid", "seq", "n", "samples", "state", "n_scored", "feed_index", "admit_version", "admit_time", "minv",
                 "ready_time")

    def __init__(self, gid: int, feed_index: int, n: int):
        self.gid, self.feed_index, self.n = gid, feed_index, n
        self.seq = 0
        self.samples: list[Sample] = []
        self.state = "pending"
        self.n_scored = 0
        self.admit_version = -1
        self.admit_time = 0.0
        self.minv = -1
        self.ready_time = 0.0


@dataclass
class WorkItem:
    """A claimed GENERATE item: the sample, ``max_new_tokens`` and whether it is an idle resume."""

    sample: Sample
    max_new: int
    idle: bool


class Buffer:
    """The replay buffer's state machine (buffers/lua/*.lua), one method per script.

    Args:
        R: rollout batch size (cap on generating groups).
        B: train batch groups.
        n: samples per group.
        M: max_budget tokens per sample per version.
        L: max_response_len.
        eta: max_staleness.
        stale_policy: ``restart`` | ``drop`` | ``keep``.
        lengths: the LengthModel; rng: its random source.
        batches_per_version: weight_sync.interval.
        admission_counts_ready: the rule before the third session (READY groups hold a slot).
    """

    def __init__(self, R: int, B: int, n: int, M: int, L: int, eta: int, stale_policy: str,
                 lengths: LengthModel, rng: random.Random, batches_per_version: int = 1,
                 admission_counts_ready: bool = False):
        if stale_policy not in ("restart", "drop", "keep"):
            raise ValueError(f"stale_policy must be restart, drop or keep, got {stale_policy!r}")
        self.R, self.B, self.n, self.M, self.L, self.eta = R, B, n, M, L, eta
        self.policy, self.lengths, self.rng, self.bpv = stale_policy, lengths, rng, batches_per_version
        self.counts_ready = admission_counts_ready
        self.v = 0
        self.admitted = 0
        self.generating = 0
        self.ready_count = 0
        self.pending: deque[Group] = deque()
        self.fresh: list = []
        self.resumable: list = []
        self.parked: list = []
        self.ready: list = []
        self.ready_by_minv: list = []
        self._seq = 0
        self._pseq = 0
        self._sid = 0
        self._gid = 0
        self.fed = 0
        self.groups_live: dict[int, Group] = {}
        self.stats = {"admitted": 0, "parked_budget": 0, "parked_abort": 0, "idle_resumes": 0,
                      "restarted_samples": 0, "restarted_groups": 0, "dropped_groups": 0,
                      "trained_groups": 0, "completed_samples": 0, "resumes": 0}
        self.now = 0.0

    # -------------------------------------------------------------------------------- feeding
    def feed_to(self, count: int) -> None:
        """The feeder keeps ``count`` groups pending (asyncrl.feeder.feeder keeps R)."""
        while len(self.pending) < count:
            g = Group(self._gid, self.fed, self.n)
            self._gid += 1
            self.fed += 1
            self.pending.append(g)
            self.groups_live[g.gid] = g

    def _generating_slots(self) -> int:
        return self.generating + (self.ready_count if self.counts_ready else 0)

    def admit(self) -> int:
        """settings.lua ``admit``: admit pending groups under the R cap and AReaL's bound."""
        limit = (self.eta + self.v + 1) * self.B * self.bpv
        count = 0
        while self.admitted < limit and self._generating_slots() < self.R:
            if not self.pending:
                self.feed_to(self.R)
            g = self.pending.popleft()
            self._seq += 1
            g.seq = self._seq
            g.state = "generating"
            g.admit_version = self.v
            g.admit_time = self.now
            targets = self.lengths.lengths(self.rng, g.feed_index, self.v, g.n)
            for i in range(g.n):
                s = Sample(self._sid, g, i, max(1, min(self.L, int(targets[i]))))
                self._sid += 1
                g.samples.append(s)
                self._push_fresh(s)
            self.generating += 1
            self.admitted += 1
            count += 1
        if count:
            self.stats["admitted"] += count
            self.feed_to(self.R)
        return count

    # -------------------------------------------------------------------------------- queues
    def _push_fresh(self, s: Sample) -> None:
        s.qtoken += 1
        heapq.heappush(self.fresh, (s.group.seq * 2048 + s.idx, s.qtoken, s))

    def _push_resumable(self, s: Sample) -> None:
        s.qtoken += 1
        self._pseq += 1
        heapq.heappush(self.resumable, (s.minv, self._pseq, s.qtoken, s))

    def _push_parked(self, s: Sample) -> None:
        s.qtoken += 1
        self._pseq += 1
        heapq.heappush(self.parked, (s.bver, self._pseq, s.qtoken, s))

    @staticmethod
    def _top(heap: list) -> Sample | None:
        while heap:
            entry = heap[0]
            s = entry[-1]
            if entry[-2] == s.qtoken and s.status in ("pending", "partial"):
                return s
            heapq.heappop(heap)
        return None

    def has_work(self) -> bool:
        """True when a claim would hand something out (work queued or a group admissible)."""
        if self._top(self.resumable) or self._top(self.fresh) or self._top(self.parked):
            return True
        limit = (self.eta + self.v + 1) * self.B * self.bpv
        return self.admitted < limit and self._generating_slots() < self.R

    def _reset_sample(self, s: Sample, reason: str) -> None:
        if s.status == "scored":
            s.group.n_scored -= 1
        s.status = "pending"
        s.length = 0
        s.minv = s.bver = s.maxv = -1
        s.bused = 0
        s.restarts += 1
        if self.lengths.resample_on_restart:
            s.target = max(1, min(self.L, int(self.lengths.one(self.rng, self.v))))
        self._push_fresh(s)
        self.stats["restarted_samples"] += 1

    def _drop_group(self, g: Group, reason: str) -> None:
        if g.state == "generating":
            self.generating -= 1
        elif g.state == "ready":
            self.ready_count -= 1
        g.state = "dropped"
        for s in g.samples:
            s.status = "dropped"
            s.qtoken += 1
        self.groups_live.pop(g.gid, None)
        self.admitted -= 1
        self.stats["dropped_groups"] += 1

    def _stale_ok(self, s: Sample) -> bool:
        if s.minv < 0 or self.v - s.minv <= self.eta or self.policy == "keep":
            return True
        if self.policy == "restart":
            self._reset_sample(s, "stale_resume")
        else:
            self._drop_group(s.group, "stale_resume")
            self.admit()
        return False

    # -------------------------------------------------------------------------------- claim.lua
    def claim(self, max_items: int) -> list[WorkItem]:
        """claim.lua: promote parked samples, admit, hand out up to ``max_items`` items."""
        while self.parked:
            s = self._top(self.parked)
            if s is None or s.bver >= self.v:
                break
            heapq.heappop(self.parked)
            self._push_resumable(s)
        self.admit()
        out: list[WorkItem] = []
        guard = 0
        while len(out) < max_items and guard < 100_000:
            guard += 1
            s = self._top(self.resumable)
            if s is not None:
                if s.bver == self.v and s.bused >= self.M:
                    heapq.heappop(self.resumable)
                    self._push_parked(s)
                elif self._stale_ok(s):
                    heapq.heappop(self.resumable)
                    out.append(self._take(s, idle=False))
                continue
            s = self._top(self.fresh)
            if s is not None:
                heapq.heappop(self.fresh)
                out.append(self._take(s, idle=False))
                continue
            s = self._top(self.parked)
            if s is None:
                break
            if self._stale_ok(s):
                heapq.heappop(self.parked)
                out.append(self._take(s, idle=True))
        return out

    def _take(self, s: Sample, idle: bool) -> WorkItem:
        if idle:
            s.bver, s.bused = self.v, 0
            self.stats["idle_resumes"] += 1
        used = s.bused if s.bver == self.v else 0
        if s.length > 0:
            s.resumes += 1
            self.stats["resumes"] += 1
        s.status = "running"
        s.qtoken += 1
        return WorkItem(s, max(0, min(self.M - used, self.L - s.length)), idle)

    # -------------------------------------------------------------------------------- append.lua
    def end_segment(self, s: Sample, by_version: list[tuple[int, int]], reason: str) -> str:
        """append.lua with a finish reason: ``stop`` | ``budget`` | ``abort``; returns the new status."""
        for tv, k in by_version:
            if k <= 0:
                continue
            if tv > self.v:
                raise AssertionError(f"token version {tv} ahead of the clock {self.v}")
            if tv > s.bver:
                s.bver, s.bused = tv, 0
            if tv == s.bver:
                s.bused += k
            if s.minv < 0 or tv < s.minv:
                s.minv = tv
            s.maxv = max(s.maxv, tv)
            s.length += k
        if s.length > self.L:
            raise AssertionError(f"sample {s.sid} holds {s.length} > L = {self.L} tokens")
        if reason == "stop" or s.length >= self.L:
            s.status = "complete"
            self.stats["completed_samples"] += 1
            self._score(s)
            return "complete"
        if reason == "budget" or s.bused >= self.M:
            s.status = "partial"
            self._push_parked(s)
            self.stats["parked_budget"] += 1
            return "parked"
        self.stats["parked_abort"] += 1
        if s.length == 0:
            s.status = "pending"
            self._push_fresh(s)
            return "pending"
        s.status = "partial"
        self._push_resumable(s)
        return "resumable"

    # -------------------------------------------------------------------------------- score.lua
    def _score(self, s: Sample) -> None:
        s.status = "scored"
        g = s.group
        g.n_scored += 1
        if g.n_scored == g.n:
            g.state = "ready"
            g.ready_time = self.now
            g.minv = self.group_minv(g)  # scored samples do not change while READY
            self.generating -= 1
            self.ready_count += 1
            heapq.heappush(self.ready, (g.seq, g.gid, g))
            heapq.heappush(self.ready_by_minv, (g.minv, g.seq, g.gid, g))
            self.admit()

    # -------------------------------------------------------------------------------- next_batch.lua
    def group_minv(self, g: Group) -> int:
        """Oldest token version among the group's scored samples (-1: none)."""
        mv = -1
        for s in g.samples:
            if s.status == "scored" and s.minv >= 0 and (mv < 0 or s.minv < mv):
                mv = s.minv
        return mv

    def next_batch(self, min_groups: int | None = None) -> list[tuple[Group, int]] | None:
        """next_batch.lua: B READY groups oldest first, staleness-checked; None if fewer."""
        need = self.B if min_groups is None else min_groups
        if self.ready_count < need:
            # fewer than B READY: the script still applies the stale policy to stale READY groups;
            # skip the scan when none is stale (the oldest minv among READY groups is recent)
            while self.ready_by_minv and self.ready_by_minv[0][-1].state != "ready":
                heapq.heappop(self.ready_by_minv)
            top = self.ready_by_minv[0][0] if self.ready_by_minv else None
            if top is None or top < 0 or self.policy == "keep" or self.v - top <= self.eta:
                self.admit()
                return None
        chosen: list[tuple[Group, int]] = []
        keep_heap = []
        while self.ready and len(chosen) < self.B:
            seq, gid, g = heapq.heappop(self.ready)
            if g.state != "ready":
                continue
            mv = g.minv
            if mv >= 0 and self.v - mv > self.eta and self.policy != "keep":
                self.ready_count -= 1
                if self.policy == "restart":
                    for s in g.samples:
                        self._reset_sample(s, "stale_batch")
                    g.minv = -1
                    g.state = "generating"
                    g.n_scored = 0
                    self.generating += 1
                    self.stats["restarted_groups"] += 1
                else:
                    self._drop_group_ready(g)
                continue
            chosen.append((g, self.v - mv if mv >= 0 else 0))
            keep_heap.append((seq, gid, g))
        if len(chosen) < need or not chosen:
            for e in keep_heap:
                heapq.heappush(self.ready, e)
            self.admit()
            return None
        for g, _ in chosen:
            g.state = "batched"
            self.ready_count -= 1
        self.admit()
        return chosen

    def _drop_group_ready(self, g: Group) -> None:
        g.state = "dropped"
        self.groups_live.pop(g.gid, None)
        self.admitted -= 1
        self.stats["dropped_groups"] += 1

    def acknowledge(self, groups: Iterable[Group]) -> None:
        """ack.lua (+ commit: trained groups leave the buffer)."""
        for g in groups:
            g.state = "trained"
            self.groups_live.pop(g.gid, None)
            self.stats["trained_groups"] += 1
        self.admit()

    def publish(self) -> None:
        """publish.lua: the clock moves forward."""
        self.v += 1

    def books(self) -> dict[str, int]:
        """fed = trained + live + dropped, the check ``asyncrl train`` prints at the end."""
        live = len(self.groups_live)
        return {"fed": self.fed, "trained": self.stats["trained_groups"], "live": live,
                "dropped": self.stats["dropped_groups"],
                "balanced": int(self.fed == self.stats["trained_groups"] + live + self.stats["dropped_groups"])}


# ==============================================================================================
# Rollout servers


class Req:
    """One request running (or queued) on an engine: a segment of one sample."""

    __slots__ = ("item", "start", "end", "ver_offset", "ver", "credited", "ctx0", "seg_len", "finish")

    def __init__(self, item: WorkItem, seg_len: int, finish: str):
        self.item = item
        self.seg_len = seg_len
        self.finish = finish
        self.start = self.end = self.ver_offset = 0.0
        self.ver = 0
        self.credited: list[tuple[int, int]] = []
        self.ctx0 = 0


class Server:
    """One rollout server: engine (fluid continuous batching) + rollout worker."""

    def __init__(self, idx: int, engine: EngineModel, max_inflight: int):
        self.idx = idx
        self.engine = engine
        self.max_inflight = max_inflight
        self.version = 0
        self.updating = False
        self.running: dict[int, Req] = {}
        self.waiting: deque[Req] = deque()
        self.heap: list = []
        self.offset = 0.0
        self.t = 0.0
        self.stall_until = 0.0
        self.kv_base = 0.0
        self.gen = 0
        self.tokens = 0.0
        self.idle_time = 0.0
        self.row_time = 0.0

    @property
    def kv(self) -> float:
        """Tokens of context in the KV cache now."""
        return self.kv_base + len(self.running) * self.offset

    def inflight(self) -> int:
        """Claimed items (running + queued in the engine)."""
        return len(self.running) + len(self.waiting)

    def advance(self, now: float) -> None:
        """Move the fluid state to ``now`` (decode progress, idle and occupancy integrals)."""
        if now <= self.t:
            return
        rows = len(self.running)
        if self.inflight() == 0:
            self.idle_time += now - self.t
        self.row_time += rows * (now - self.t)
        start = max(self.t, self.stall_until)
        if rows and now > start:
            steps = (now - start) / self.engine.step_seconds(rows, self.kv)
            self.offset += steps
            self.tokens += rows * steps
        self.t = now


# ==============================================================================================
# Simulation


@dataclass
class SimConfig:
    """One simulated configuration (the asyncrl knobs and the component models).

    Attributes:
        name: label.
        rollout_batch_size, partial_percent, n_samples, max_budget, max_response_len,
            max_staleness, stale_policy, batches_per_version: the asyncrl knobs (docs/concepts.md).
        prompt_tokens: prompt length.
        lengths: LengthModel of the responses.
        servers, engine, max_inflight: rollout servers, their EngineModel, worker items in flight
            (``rollout.max_inflight_requests``).
        pause_mode: ``abort`` | ``in_place`` (``rollout.pause_mode``).
        notice, fetch, load: seconds from publish to the worker noticing, fetching and loading.
        trainer: TrainerModel.
        colocated: servers and trainer share the devices (synchronous asyncrl on GPUs).
        admission_counts_ready: the admission rule before the third session.
        warmup, duration: measurement window (seconds) when ``steps`` is 0.
        steps: stop after this many train steps (0: run ``warmup + duration`` seconds).
        warmup_steps: with ``steps``, measure from the end of this step on.
        seed: random seed.
    """

    name: str = "run"
    rollout_batch_size: int = 8
    partial_percent: float = 1.0
    n_samples: int = 8
    max_budget: int = 64
    max_response_len: int = 64
    max_staleness: int = 0
    stale_policy: str = "restart"
    batches_per_version: int = 1
    prompt_tokens: int = 42
    lengths: LengthModel = field(default_factory=lambda: FixedLength(16))
    servers: int = 1
    engine: EngineModel = field(default_factory=lambda: EngineModel("engine", 0.01, 0.001))
    max_inflight: int = 32
    pause_mode: str = "abort"
    notice: float = 0.0
    fetch: float = 0.0
    load: float = 0.0
    trainer: TrainerModel = field(default_factory=TrainerModel)
    colocated: bool = False
    admission_counts_ready: bool = False
    warmup: float = 0.0
    duration: float = 600.0
    steps: int = 0
    warmup_steps: int = 0
    seed: int = 0

    @property
    def train_batch_groups(self) -> int:
        """B = ceil(p R)."""
        return train_batch_groups(self.partial_percent, self.rollout_batch_size)

    def validate(self) -> None:
        """The config validator's rules that matter here (asyncrl/core/config.py)."""
        if self.partial_percent < 1 and self.max_staleness == 0:
            raise ValueError("partial_percent < 1 needs max_staleness >= 1 (docs/concepts.md)")
        if self.pause_mode not in ("abort", "in_place"):
            raise ValueError(f"pause_mode must be abort or in_place, got {self.pause_mode!r}")
        if self.max_budget < 1 or self.max_response_len < 1:
            raise ValueError("max_budget and max_response_len must be >= 1")


@dataclass
class StepRecord:
    """One train step: its phases (seconds), groups, staleness of each group, samples, tokens."""

    step: int
    t_start: float
    wait: float
    forward_backward: float
    optim: float
    publish: float
    checkpoint: float
    staleness: list[int]
    samples: int
    response_tokens: int

    @property
    def total(self) -> float:
        """Sum of the phases."""
        return self.wait + self.forward_backward + self.optim + self.publish + self.checkpoint


@dataclass
class SimResult:
    """What a run measured (asyncrl's definitions, see the module docstring)."""

    name: str
    window_seconds: float
    steps: int
    seconds_per_step: float
    samples_per_second: float
    tokens_per_second: float
    engine_tokens_per_second: float
    engine_tokens_per_second_window: float
    trainer_idle: float
    rollout_idle: float
    running_requests: float
    staleness_mean: float
    staleness_max: int
    phases: dict[str, float]
    buffer: dict[str, int]
    books: dict[str, int]
    trained_samples: int
    trained_tokens: int

    def row(self) -> dict[str, Any]:
        """A flat dict for JSON."""
        return asdict(self)


class Simulator:
    """Discrete-event simulation of one SimConfig (see the module docstring)."""

    def __init__(self, cfg: SimConfig):
        cfg.validate()
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.buf = Buffer(cfg.rollout_batch_size, cfg.train_batch_groups, cfg.n_samples, cfg.max_budget,
                          cfg.max_response_len, cfg.max_staleness, cfg.stale_policy, cfg.lengths, self.rng,
                          cfg.batches_per_version, cfg.admission_counts_ready)
        self.servers = [Server(i, cfg.engine, cfg.max_inflight) for i in range(cfg.servers)]
        self.events: list = []
        self._eseq = 0
        self.now = 0.0
        self.end_time = INF if cfg.steps else cfg.warmup + cfg.duration
        self.records: list[tuple[float, StepRecord]] = []
        self.trained: list[Group] = []
        self.snap0: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
        self.hungry: set[int] = set()
        self._rr = 0
        # trainer state
        self.step = 0
        self.step_start = 0.0
        self.batch: list[tuple[Group, int]] | None = None
        self.phase_t: dict[str, float] = {}
        self.trainer_busy_until = 0.0
        self.done = False

    # -------------------------------------------------------------------------------- events
    def _push(self, t: float, kind: str, *payload: Any) -> None:
        self._eseq += 1
        heapq.heappush(self.events, (t, self._eseq, kind, payload))

    def run(self) -> SimResult:
        """Run to the end of the window (or ``steps``) and summarise."""
        cfg = self.cfg
        self.buf.feed_to(cfg.rollout_batch_size)
        first = cfg.trainer.tick if cfg.trainer.tick is not None else 0.0
        self._push(first, "trainer_poll")
        if not cfg.steps and cfg.warmup > 0:
            self._push(cfg.warmup, "snapshot")
        self.hungry = set(range(len(self.servers)))
        self._wake()
        while self.events and not self.done:
            t, _, kind, payload = heapq.heappop(self.events)
            if t > self.end_time:
                self.now = self.end_time
                break
            self.now = t
            self.buf.now = t
            getattr(self, "_on_" + kind)(*payload)
        return self._summarise()

    # -------------------------------------------------------------------------------- servers
    def _schedule(self, srv: Server) -> None:
        srv.gen += 1
        if not srv.running:
            return
        while srv.heap and (srv.heap[0][2] not in srv.running or srv.running[srv.heap[0][2]].end != srv.heap[0][0]):
            heapq.heappop(srv.heap)
        start = max(self.now, srv.stall_until)
        steps = max(0.0, srv.heap[0][0] - srv.offset)
        eng = srv.engine
        if eng.gamma > 0:
            steps = min(steps, float(eng.refresh_steps))
        t = start + steps * eng.step_seconds(len(srv.running), srv.kv)
        self._push(t, "server", srv.idx, srv.gen)

    def _on_server(self, idx: int, gen: int) -> None:
        srv = self.servers[idx]
        if gen != srv.gen:
            return
        srv.advance(self.now)
        finished = []
        while srv.heap:
            end, _, sid = srv.heap[0]
            r = srv.running.get(sid)
            if r is None or r.end != end:
                heapq.heappop(srv.heap)
                continue
            if end <= srv.offset + 1e-6 + 1e-9 * srv.offset:
                heapq.heappop(srv.heap)
                finished.append(r)
                continue
            break
        for r in finished:
            self._finish(srv, r, r.seg_len, r.finish)
        self._start_waiting(srv)
        self._dispatch(srv)
        self._schedule(srv)
        self._wake()

    def _credit(self, srv: Server, r: Req, produced: int) -> list[tuple[int, int]]:
        done = sum(k for _, k in r.credited)
        return r.credited + [(r.ver, max(0, produced - done))]

    def _finish(self, srv: Server, r: Req, produced: int, reason: str) -> None:
        """A segment ends (``stop`` / ``budget``: its tokens all produced; ``abort``: cut short)."""
        del srv.running[r.item.sample.sid]
        srv.kv_base -= r.ctx0 - r.start
        if not srv.running:
            srv.kv_base = 0.0
        s = r.item.sample
        if s.status != "running":  # dropped meanwhile
            return
        self.buf.end_segment(s, self._credit(srv, r, produced), reason)

    def _start_waiting(self, srv: Server) -> None:
        """Move queued requests into the running batch while rows and KV allow; prefill them."""
        eng = srv.engine
        prefill = 0
        groups_prefilled: set[int] = set()
        srv.advance(self.now)
        while srv.waiting and len(srv.running) < eng.max_rows:
            r = srv.waiting[0]
            need = r.ctx0 + r.seg_len
            if srv.running and srv.kv + need > eng.kv_capacity:
                break
            srv.waiting.popleft()
            s = r.item.sample
            if s.status != "running":
                continue
            r.start = r.ver_offset = srv.offset
            r.end = srv.offset + r.seg_len
            r.ver = srv.version
            srv.running[s.sid] = r
            srv.kv_base += r.ctx0 - r.start
            heapq.heappush(srv.heap, (r.end, s.group.gid * 4096 + s.idx, s.sid))
            if s.length == 0 and eng.shared_prefix:
                if s.group.gid not in groups_prefilled:
                    groups_prefilled.add(s.group.gid)
                    prefill += self.cfg.prompt_tokens
            else:
                prefill += r.ctx0
        if prefill and eng.prefill_per_token > 0:
            srv.stall_until = max(srv.stall_until, self.now) + prefill * eng.prefill_per_token

    def _dispatch(self, srv: Server) -> None:
        """The worker's claim loop for ``srv`` (catch-up first when the engine is behind)."""
        if srv.updating or self.done:
            return
        if srv.version < self.buf.v:
            self._begin_update(srv)
            return
        if self.cfg.colocated and self.now < self.trainer_busy_until:
            self.hungry.add(srv.idx)
            return
        free = srv.max_inflight - srv.inflight()
        if free <= 0:
            self.hungry.discard(srv.idx)
            return
        items = self.buf.claim(free)
        if len(items) < free:
            self.hungry.add(srv.idx)
        else:
            self.hungry.discard(srv.idx)
        if not items:
            return
        srv.advance(self.now)
        for it in items:
            s = it.sample
            remaining = s.target - s.length
            seg = min(it.max_new, remaining)
            if seg <= 0:  # nothing left to generate (cannot happen with max_new >= 1): complete it
                self.buf.end_segment(s, [], "stop")
                continue
            finish = "stop" if seg == remaining else "budget"
            r = Req(it, seg, finish)
            r.ctx0 = self.cfg.prompt_tokens + s.length
            srv.waiting.append(r)
        self._start_waiting(srv)
        self._schedule(srv)

    def _wake(self) -> None:
        """Servers with free slots claim while the buffer has work (round robin)."""
        if not self.hungry:
            return
        order = sorted(self.hungry)
        k = self._rr % len(order)
        self._rr += 1
        for idx in order[k:] + order[:k]:
            if not self.buf.has_work():
                break
            if idx in self.hungry:
                self._dispatch(self.servers[idx])

    # -------------------------------------------------------------------------------- weights
    def _begin_update(self, srv: Server) -> None:
        srv.updating = True
        self.hungry.discard(srv.idx)
        self._push(self.now + self.cfg.fetch, "pause", srv.idx, self.buf.v)

    def _on_notice(self, idx: int) -> None:
        srv = self.servers[idx]
        if not srv.updating and srv.version < self.buf.v:
            self._begin_update(srv)

    def _on_pause(self, idx: int, version: int) -> None:
        srv = self.servers[idx]
        srv.advance(self.now)
        if self.cfg.pause_mode == "abort":
            for r in list(srv.running.values()):
                produced = min(r.seg_len - 1, int(math.floor(srv.offset - r.start + 1e-9)))
                self._finish(srv, r, max(0, produced), "abort")
            srv.heap.clear()
            while srv.waiting:
                r = srv.waiting.popleft()
                if r.item.sample.status == "running":
                    self.buf.end_segment(r.item.sample, [], "abort")
        srv.stall_until = max(srv.stall_until, self.now) + self.cfg.load
        self._push(self.now + self.cfg.load, "loaded", idx, version)
        self._schedule(srv)
        self._wake()

    def _on_loaded(self, idx: int, version: int) -> None:
        srv = self.servers[idx]
        srv.advance(self.now)
        for r in srv.running.values():  # in_place: the rest of the segment is the new version's
            k = int(round(srv.offset - r.ver_offset))
            k = max(0, min(k, r.seg_len - sum(c for _, c in r.credited)))
            r.credited.append((r.ver, k))
            r.ver, r.ver_offset = version, srv.offset
        for r in srv.waiting:
            r.ver = version
        srv.version = version
        srv.updating = False
        self._dispatch(srv)
        self._schedule(srv)
        self._wake()

    # -------------------------------------------------------------------------------- trainer
    def _on_trainer_poll(self) -> None:
        tr = self.cfg.trainer
        batch = self.buf.next_batch()
        if batch is None:
            self._push(self.now + (tr.tick if tr.tick is not None else tr.poll), "trainer_poll")
            self._wake()
            return
        self.batch = batch
        groups = [g for g, _ in batch]
        wait = self.now - self.step_start
        fb = tr.forward_backward_seconds(groups, self.cfg.prompt_tokens)
        self.phase_t = {"wait": wait, "forward_backward": fb, "optim": tr.optim if tr.tick is None else 0.0}
        busy = fb + self.phase_t["optim"]
        if self.cfg.colocated and busy > 0:
            self.trainer_busy_until = self.now + busy
            for srv in self.servers:
                srv.advance(self.now)
                srv.stall_until = max(srv.stall_until, self.trainer_busy_until)
                self._schedule(srv)
        self._push(self.now + busy, "trainer_optimised")
        self._wake()

    def _on_trainer_optimised(self) -> None:
        tr = self.cfg.trainer
        groups = [g for g, _ in self.batch]
        self.buf.acknowledge(groups)
        self._wake()
        pub = tr.publish if tr.tick is None else 0.0
        self.phase_t["publish"] = pub
        self._push(self.now + pub, "trainer_published")

    def _on_trainer_published(self) -> None:
        tr = self.cfg.trainer
        self.buf.publish()
        for srv in self.servers:
            self._push(self.now + self.cfg.notice, "notice", srv.idx)
        ck = tr.checkpoint if (tr.tick is None and tr.checkpoint_interval and (self.step + 1) % tr.checkpoint_interval == 0) else 0.0
        self.phase_t["checkpoint"] = ck
        self._push(self.now + ck, "trainer_step_end")
        self._wake()

    def _on_trainer_step_end(self) -> None:
        tr = self.cfg.trainer
        self.step += 1
        batch = self.batch
        samples = sum(len(g.samples) for g, _ in batch)
        tokens = sum(s.length for g, _ in batch for s in g.samples)
        rec = StepRecord(self.step, self.step_start, self.phase_t["wait"], self.phase_t["forward_backward"],
                         self.phase_t["optim"], self.phase_t["publish"], self.phase_t["checkpoint"],
                         [st for _, st in batch], samples, tokens)
        rec_time = self.now if tr.tick is None else self.step_start + self.phase_t["wait"]
        self.records.append((rec_time, rec))
        self.trained.extend(g for g, _ in batch)
        self.batch = None
        if self.cfg.steps and self.cfg.warmup_steps and self.step == self.cfg.warmup_steps:
            self.snap0 = self._snapshot(self.now)
        if self.cfg.steps and self.step >= self.cfg.steps:
            self.done = True
            return
        if tr.tick is not None:
            # the benchmark trainer sleeps to the next tick of its grid
            nxt = (math.floor(self.now / tr.tick + 1e-9) + 1) * tr.tick
            self.step_start = self.now
            self._push(nxt, "trainer_poll")
        else:
            self.step_start = self.now
            self._push(self.now, "trainer_poll")

    # -------------------------------------------------------------------------------- summary
    def _snapshot(self, t: float) -> tuple[float, float, float, float]:
        for srv in self.servers:
            srv.advance(t)
        return (t, sum(s.idle_time for s in self.servers), sum(s.row_time for s in self.servers),
                sum(s.tokens for s in self.servers))

    def _on_snapshot(self) -> None:
        self.snap0 = self._snapshot(self.now)

    def _summarise(self) -> SimResult:
        cfg = self.cfg
        end = self.now if cfg.steps else self.end_time
        snap1 = self._snapshot(end)
        lo = self.snap0[0]
        if cfg.steps:
            recs = [r for _, r in self.records[cfg.warmup_steps:]]
        else:
            recs = [r for t, r in self.records if lo <= t <= end]
        span = max(1e-9, end - lo)
        samples = sum(r.samples for r in recs)
        tokens = sum(r.response_tokens for r in recs)
        stal = [x for r in recs for x in r.staleness]
        steps = len(recs)
        phases = {k: (sum(getattr(r, k) for r in recs) / steps if steps else 0.0)
                  for k in ("wait", "forward_backward", "optim", "publish", "checkpoint")}
        idle_tr = [r.wait / r.total for r in recs if r.total > 0]
        gen_tokens = snap1[3]
        win_tokens = snap1[3] - self.snap0[3]
        n = max(1, len(self.servers))
        return SimResult(
            name=cfg.name, window_seconds=span, steps=steps,
            seconds_per_step=span / steps if steps else INF,
            samples_per_second=samples / span, tokens_per_second=tokens / span,
            engine_tokens_per_second=gen_tokens / max(1e-9, end),
            engine_tokens_per_second_window=win_tokens / span,
            trainer_idle=sum(idle_tr) / len(idle_tr) if idle_tr else 1.0,
            rollout_idle=(snap1[1] - self.snap0[1]) / (span * n),
            running_requests=(snap1[2] - self.snap0[2]) / (span * n),
            staleness_mean=sum(stal) / len(stal) if stal else 0.0,
            staleness_max=max(stal) if stal else 0,
            phases=phases, buffer=dict(self.buf.stats), books=self.buf.books(),
            trained_samples=samples, trained_tokens=tokens)


def simulate(cfg: SimConfig) -> SimResult:
    """Run one configuration."""
    return Simulator(cfg).run()


# ==============================================================================================
# Inputs measured on this machine (docs/ files)

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


# ==============================================================================================
# Published results next to which the predictions are tabulated

PUBLISHED = [
    {"system": "AReaL (arXiv:2505.24298; blog/AReaL_v0_3.md)", "setup": "R1-Distill-Qwen-1.5B, math, 16 nodes, 1000 PPO steps",
     "sync_hours": 41.0, "async_hours": 14.8, "speedup": 41.0 / 14.8},
    {"system": "AReaL (arXiv:2505.24298; blog/AReaL_v0_3.md)", "setup": "R1-Distill-Qwen-7B, math, 24 nodes, 1000 PPO steps",
     "sync_hours": 57.7, "async_hours": 25.4, "speedup": 57.7 / 25.4},
    {"system": "verl fully_async_policy (docs/advance/fully_async.md)", "setup": "Qwen2.5-Math-7B, DAPO, 28K response, H20, 32 GPUs (16:16), 400 steps",
     "speedup": 2.66},
    {"system": "verl fully_async_policy", "setup": "same, 64 GPUs (32:32), 400 steps", "speedup": 1.92},
    {"system": "verl fully_async_policy", "setup": "same, 128 GPUs (64:64), 400 steps (2.67x at 100 steps)", "speedup": 2.35},
    {"system": "Kimi k1.5 (arXiv:2501.12599, section 2.6.2)", "setup": "partial rollouts, 128k context",
     "speedup": None},
]


# ==============================================================================================
# Tables


def _err(pred: float, meas: float) -> str:
    """Relative error, or the absolute difference when the measured value is 0."""
    if meas == 0:
        return f"{pred - meas:+.2f} abs"
    return f"{(pred - meas) / abs(meas) * 100:+.0f}%"


def _fmt(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def validation(seed: int = 0, bench_dir: str = "docs/bench") -> dict[str, Any]:
    """Predicted vs measured for the runs of docs/results.md and docs/rollout.md benchmark (b)."""
    import glob
    import os

    rows: list[dict[str, Any]] = []
    main = [("async", main_job_config("async", admission_counts_ready=True, seed=seed), MAIN_MEASURED["async"]),
            ("sync", main_job_config("sync", seed=seed), MAIN_MEASURED["sync"]),
            ("async_after_change", main_job_config("async", admission_counts_ready=False, duration=1228.0, seed=seed),
             MAIN_MEASURED["async_after_change"])]
    for key, cfg, meas in main:
        r = simulate(cfg)
        for q, m in meas.items():
            p = getattr(r, q)
            rows.append({"run": f"main job {key.replace('_', ' ')}", "quantity": q, "measured": m, "predicted": p,
                         "error": _err(p, m), "within_20pct": (abs(p - m) <= 0.2 * abs(m)) if m else abs(p - m) <= 0.1})
    bench = []
    for path in sorted(glob.glob(os.path.join(bench_dir, "partial_*.json"))):
        pair = {}
        for cfg, meas in bench_b_configs(path, seed=seed):
            r = simulate(cfg)
            pred = {"batches": r.steps, "samples": r.trained_samples, "tokens": r.trained_tokens,
                    "tokens_per_second": r.tokens_per_second, "engine_tokens_per_second": r.engine_tokens_per_second,
                    "running_requests": r.running_requests, "staleness_mean": r.staleness_mean}
            mode = "partial" if cfg.partial_percent < 1 else "sync"
            pair[mode] = (meas, pred)
            for q in ("tokens_per_second", "engine_tokens_per_second", "running_requests", "staleness_mean"):
                m, p = meas[q], pred[q]
                rows.append({"run": cfg.name, "quantity": q, "measured": m, "predicted": p, "error": _err(p, m),
                             "within_20pct": (abs(p - m) <= 0.2 * abs(m)) if m else abs(p - m) <= 0.1})
        if "sync" in pair and "partial" in pair:
            ms = pair["partial"][0]["tokens_per_second"] / pair["sync"][0]["tokens_per_second"]
            ps = pair["partial"][1]["tokens_per_second"] / pair["sync"][1]["tokens_per_second"]
            bench.append({"setup": os.path.basename(path), "measured_speedup": ms, "predicted_speedup": ps,
                          "error": _err(ps, ms)})
    return {"rows": rows, "bench_b_speedups": bench}


def print_validation(res: dict[str, Any]) -> None:
    """The validation table (markdown)."""
    print("| run | quantity | measured | predicted | error |")
    print("|---|---|---:|---:|---:|")
    for r in res["rows"]:
        flag = "" if r["within_20pct"] else " ✗"
        print(f"| {r['run']} | {r['quantity']} | {_fmt(r['measured'])} | {_fmt(r['predicted'])} | {r['error']}{flag} |")
    print()
    print("| benchmark (b) setup | measured partial/sync | predicted | error |")
    print("|---|---:|---:|---:|")
    for b in res["bench_b_speedups"]:
        print(f"| {b['setup']} | {b['measured_speedup']:.2f}x | {b['predicted_speedup']:.2f}x | {b['error']} |")
    n = len(res["rows"])
    ok = sum(r["within_20pct"] for r in res["rows"])
    print(f"\n{ok} of {n} quantities within 20% (staleness and idle ratios measured at 0: within 0.1 absolute).")


#: The asynchronous settings tried at every scale: (label, partial_percent, budget (None: the
#: workload's), max_staleness, pause_mode).
ASYNC_SETTINGS = [
    ("overlap, eta 1", 1.0, "L", 1, "in_place"),
    ("partial, eta 4", 0.5, None, 4, "in_place"),
    ("partial, eta 4, abort", 0.5, None, 4, "abort"),
]
#: Fractions of the GPUs given to rollout in asynchronous mode.
ROLLOUT_FRACTIONS = (0.25, 0.375, 0.5, 0.625, 0.75)


def scaling(scales: Iterable[int] = (8, 64, 512), workloads: Iterable[str] = ("long-tail", "short"),
            seed: int = 0, quick: bool = False, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Predicted sync and async throughput for every scale, workload, setting and split."""
    out: dict[str, Any] = {"runs": [], "best": []}
    for wl in workloads:
        for G in scales:
            steps_sync, steps_async = (3, 8) if quick else (5, 12)
            sync = simulate(gpu_config(G, wl, "sync", steps=steps_sync, seed=seed))
            runs = [("sync", None, sync)]
            if log:
                log(f"{sync.name}: {sync.seconds_per_step:.0f} s/step, {sync.samples_per_second:.2f} samples/s")
            for label, p, budget, eta, pause in ASYNC_SETTINGS:
                for frac in ROLLOUT_FRACTIONS:
                    M = WORKLOADS[wl]["L"] if budget == "L" else budget
                    cfg = gpu_config(G, wl, "async", rollout_gpus=max(1, int(round(G * frac))), partial_percent=p,
                                     max_staleness=eta, budget=M, pause_mode=pause, steps=steps_async, seed=seed)
                    r = simulate(cfg)
                    runs.append((label, frac, r))
                    if log:
                        log(f"{r.name} ({pause}): {r.seconds_per_step:.0f} s/step, {r.samples_per_second:.2f} samples/s, "
                            f"x{r.samples_per_second / sync.samples_per_second:.2f}")
            for label, frac, r in runs:
                d = r.row()
                d.update({"workload": wl, "gpus": G, "setting": label, "rollout_fraction": frac,
                          "speedup": r.samples_per_second / sync.samples_per_second})
                out["runs"].append(d)
            asyn = [(label, frac, r) for label, frac, r in runs if label != "sync"]
            best = max(asyn, key=lambda x: x[2].samples_per_second)
            default = max((x for x in asyn if "abort" in x[0]), key=lambda x: x[2].samples_per_second)
            out["best"].append({"workload": wl, "gpus": G, "sync": sync.row(), "best_setting": best[0],
                                "best_rollout_fraction": best[1], "best": best[2].row(),
                                "speedup": best[2].samples_per_second / sync.samples_per_second,
                                "abort_setting": default[0], "abort_rollout_fraction": default[1],
                                "abort_speedup": default[2].samples_per_second / sync.samples_per_second})
    return out


def print_scaling(res: dict[str, Any]) -> None:
    """The scaling tables (markdown)."""
    for wl in dict.fromkeys(b["workload"] for b in res["best"]):
        print(f"\n{wl}: {WORKLOADS[wl]['lengths'].describe()}, prompt {WORKLOADS[wl]['prompt']}, n {WORKLOADS[wl]['n']}, "
              f"B {GLOBAL_BATCH_GROUPS} groups per step, Qwen2.5-7B on H100\n")
        print("| GPUs | sync s/step | sync samples/s | sync idle (rollout / trainer) | best async setting | async s/step | "
              "async samples/s | async idle (rollout / trainer) | staleness mean / max | restarts | speed-up | "
              "speed-up, pause abort |")
        print("|---:|---:|---:|---|---|---:|---:|---|---|---:|---:|---:|")
        for b in res["best"]:
            if b["workload"] != wl:
                continue
            s, a = b["sync"], b["best"]
            G = b["gpus"]
            nr = int(round(G * b["best_rollout_fraction"]))
            print(f"| {G} | {s['seconds_per_step']:.0f} | {s['samples_per_second']:.1f} | {s['rollout_idle']:.2f} / {s['trainer_idle']:.2f} | "
                  f"{b['best_setting']}, {nr}:{G - nr} | {a['seconds_per_step']:.0f} | {a['samples_per_second']:.1f} | "
                  f"{a['rollout_idle']:.2f} / {a['trainer_idle']:.2f} | {a['staleness_mean']:.2f} / {a['staleness_max']} | "
                  f"{a['buffer']['restarted_samples']} | **{b['speedup']:.2f}x** | {b['abort_speedup']:.2f}x |")
    print("\nPublished (measured on their clusters, not predictions):\n")
    print("| system | setup | speed-up over synchronous |")
    print("|---|---|---:|")
    for p in PUBLISHED:
        sp = f"{p['speedup']:.2f}x" if p["speedup"] else "no figure published"
        print(f"| {p['system']} | {p['setup']} | {sp} |")


# ==============================================================================================
# Command line


def _length_model(spec: str) -> LengthModel:
    kind, _, rest = spec.partition(":")
    args = [float(x) for x in rest.split(",")] if rest else []
    if kind == "fixed":
        return FixedLength(int(args[0]))
    if kind == "uniform":
        return UniformLength(int(args[0]), int(args[1]))
    if kind == "lognormal":
        return LogNormalLength(args[0], args[1], int(args[2]))
    if kind == "pareto":
        return BenchParetoLength(args[0], args[1], int(args[2]))
    if kind in WORKLOADS:
        return WORKLOADS[kind]["lengths"]
    raise argparse.ArgumentTypeError(f"unknown length model {spec!r}")


def main(argv: list[str] | None = None) -> int:
    """``validate`` | ``scaling`` | ``run`` (see ``--help``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The model and its sources: the module docstring and docs/scaling.md.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="predicted vs measured for this machine's runs (docs/results.md, docs/rollout.md)")
    s = sub.add_parser("scaling", help="predicted async/sync speed-up on 8, 64, 512 H100s (7B model)")
    s.add_argument("--scales", type=int, nargs="+", default=[8, 64, 512])
    s.add_argument("--workloads", nargs="+", default=["long-tail", "short"], choices=sorted(WORKLOADS))
    s.add_argument("--quick", action="store_true", help="fewer train steps per run")
    r = sub.add_parser("run", help="simulate one configuration (GPU cluster, Qwen2.5-7B on H100)")
    r.add_argument("--rollout-gpus", type=int, required=True, help="N: rollout GPUs (SGLang servers, TP 1)")
    r.add_argument("--trainer-gpus", type=int, required=True, help="M: trainer GPUs")
    r.add_argument("--sync", action="store_true", help="synchronous, colocated on N + M GPUs")
    r.add_argument("--workload", default="long-tail", choices=sorted(WORKLOADS))
    r.add_argument("--partial-percent", type=float, default=0.5)
    r.add_argument("--max-budget", type=int, default=None)
    r.add_argument("--max-staleness", type=int, default=4)
    r.add_argument("--pause-mode", default="in_place", choices=["abort", "in_place"])
    r.add_argument("--groups", type=int, default=GLOBAL_BATCH_GROUPS, help="B: prompt groups per train step")
    r.add_argument("--steps", type=int, default=12)
    for p in (v, s, r):
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", default=None, help="write the raw results to this file")
    a = ap.parse_args(argv)
    if a.cmd == "validate":
        res = validation(seed=a.seed)
        print_validation(res)
    elif a.cmd == "scaling":
        res = scaling(a.scales, a.workloads, seed=a.seed, quick=a.quick, log=lambda m: print(m, file=sys.stderr, flush=True))
        print_scaling(res)
    else:
        total = a.rollout_gpus + a.trainer_gpus
        cfg = gpu_config(total, a.workload, "sync" if a.sync else "async", rollout_gpus=None if a.sync else a.rollout_gpus,
                         partial_percent=a.partial_percent, max_staleness=a.max_staleness, budget=a.max_budget,
                         pause_mode=a.pause_mode, steps=a.steps, groups=a.groups, seed=a.seed)
        result = simulate(cfg)
        res = {"config": {k: (v if isinstance(v, (int, float, str, bool)) else repr(v)) for k, v in cfg.__dict__.items()},
               "result": result.row()}
        for k, val in result.row().items():
            print(f"{k:32s} {val}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=lambda o: o if not isinstance(o, float) or math.isfinite(o) else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
