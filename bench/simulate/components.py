"""The rollout server's engine (eq. 1) and the trainer's step phases (eq. 2): time models of the two roles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .hardware import Hardware, ModelShape

if TYPE_CHECKING:
    from .buffer import Group

__all__ = ["INF", "EngineModel", "TrainerModel"]

INF = float("inf")


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
                resp = sum(max(0, s.length - 1) + s.extra for s in g.samples)
                tokens += resp + (prompt_tokens if self.share_prompts else prompt_tokens * len(g.samples))
            return self.overhead + tokens / self.tokens_per_second
        assert self.flops_per_second and self.model is not None, "a trainer needs a token rate or a FLOP rate"
        flops = sum(self.model.train_flops(prompt_tokens + s.length + s.extra) for g in groups for s in g.samples)
        return self.overhead + flops / self.flops_per_second
