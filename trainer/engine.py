"""The DeepSpeed engine, built from the typed config tree (never from a hand-edited JSON).

:func:`deepspeed_config` turns ``trainer`` / ``trainer.optimizer`` into DeepSpeed's JSON dict;
``configs/deepspeed/*.json`` are its output for a few presets, kept for reference only (the
trainer always regenerates the dict from the config it runs with; a test keeps the presets in
sync). Choices, and why:

- ``managed_gradient_accumulation: false`` (DeepSpeed >= 0.19): the trainer owns accumulation.
  Packed micro-batches vary in number from batch to batch, so there is no fixed
  ``gradient_accumulation_steps``: every ``backward()`` accumulates, every ``step()`` is the
  boundary. Loss scaling for accumulation is done by the loss itself (per-token weights
  normalised over the whole mini-batch), so ``backward(scale_wrt_gas=False)``.
- ``gradient_clipping`` is always written explicitly (its default changed in 0.19.3).
- AdamW with ``torch_adam: true`` (torch's AdamW; no CUDA/JIT op, identical on CPU and GPU) and
  ``fused: true`` (DeepSpeed passes it through to ``torch.optim.AdamW``): one fused kernel over
  all parameters instead of a loop of per-tensor ops, 4.4x faster on this CPU (135M fp32
  parameters, one thread: 0.19 s vs 0.85 s per step; ``bench/trainer_profile.py`` shows the
  optimizer was half of a main-job step once prompts were shared).
- ZeRO stage 0-3; bf16 via ``bf16.enabled`` (DeepSpeed keeps fp32 master weights).
- The learning rate is set by the training loop before each step (no DeepSpeed scheduler).

On CPU set ``DS_ACCELERATOR=cpu``; the process group is gloo.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["deepspeed_config", "init_distributed", "build_engine", "lr_at", "GradNormProbe"]


def deepspeed_config(cfg: Any) -> dict[str, Any]:
    """DeepSpeed's config dict for ``cfg`` (an :class:`asyncrl.core.config.AsyncRLConfig`).

    ``train_micro_batch_size_per_gpu`` is 1 and ``gradient_accumulation_steps`` 1 as DeepSpeed's
    bookkeeping only; the real micro-batch is a packed row of ``trainer.micro_batch_tokens``.
    """
    t, opt = cfg.trainer, cfg.trainer.optimizer
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.zero_stage >= 2:
        zero.update({"overlap_comm": False, "contiguous_gradients": True,
                     "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000})
    if t.zero_stage == 3:
        zero.update({"stage3_gather_16bit_weights_on_model_save": False,
                     "stage3_param_persistence_threshold": 10_000, "stage3_prefetch_bucket_size": 5_000_000})
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(opt.grad_clip),
        "bf16": {"enabled": t.precision == "bf16"},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": opt.lr, "betas": list(opt.betas), "eps": 1e-8,
                       "weight_decay": opt.weight_decay, "torch_adam": True, "fused": True},
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def lr_at(optimizer_step: int, opt_cfg: Any, total_optimizer_steps: int) -> float:
    """Learning rate of optimizer step ``optimizer_step`` (0-based): linear warm-up, then the schedule.

    ``constant``: ``lr``; ``linear``: decays linearly to 0 at ``total_optimizer_steps``;
    ``cosine``: ``lr * 0.5 * (1 + cos(pi * progress))``. Warm-up multiplies by
    ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps.
    """
    import math

    lr = opt_cfg.lr
    if opt_cfg.warmup_steps and optimizer_step < opt_cfg.warmup_steps:
        return lr * (optimizer_step + 1) / opt_cfg.warmup_steps
    if opt_cfg.lr_schedule == "constant":
        return lr
    span = max(1, total_optimizer_steps - opt_cfg.warmup_steps)
    progress = min(1.0, max(0.0, (optimizer_step - opt_cfg.warmup_steps) / span))
    if opt_cfg.lr_schedule == "linear":
        return lr * (1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def init_distributed() -> tuple[int, int]:
    """Initialise torch.distributed from the launcher's environment (torchrun / deepspeed).

    A single process without ``RANK``/``WORLD_SIZE`` gets a one-rank gloo group on a free port
    (picked again, up to 3 times, when another process takes it before the store binds it).
    On CPU, a stale JIT-build lock of DeepSpeed's shm op is removed first
    (:func:`trainer.jit_lock.clear_stale_jit_lock`).

    Returns:
        ``(rank, world_size)``.
    """
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        own_port = "WORLD_SIZE" not in os.environ
        if own_port:
            from asyncrl.core.net import free_port

            port = free_port("127.0.0.1")
            os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        from deepspeed.accelerator import get_accelerator

        backend = "gloo" if get_accelerator().device_name() == "cpu" else None
        if backend == "gloo":
            # DeepSpeed JIT-loads its shm collective op here; a lock left by an interrupted
            # build would make torch wait forever (trainer/jit_lock.py).
            from trainer.jit_lock import clear_stale_jit_lock

            clear_stale_jit_lock("deepspeed_shm_comm")
        for attempt in range(3):
            try:
                deepspeed.init_distributed(dist_backend=backend, verbose=False)
                break
            except RuntimeError as exc:
                # The free port we picked can be taken before the store binds it (another
                # process on the machine): pick another one. A launcher's port is not ours to move.
                taken = "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower()
                if not (own_port and taken) or attempt == 2:
                    raise
                os.environ["MASTER_PORT"] = str(free_port("127.0.0.1"))
    return dist.get_rank(), dist.get_world_size()


def build_engine(model: Any, cfg: Any) -> Any:
    """Wrap ``model`` (a transformers causal LM, fp32 weights) in a DeepSpeed engine per ``cfg``.

    Activation checkpointing uses transformers' ``gradient_checkpointing_enable`` (non-reentrant).

    Returns:
        the ``deepspeed.DeepSpeedEngine``.
    """
    import deepspeed

    if cfg.trainer.activation_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           config=deepspeed_config(cfg))
    return engine


PRESETS: dict[str, tuple[int, str]] = {
    f"zero{stage}_{precision}": (stage, precision) for stage in (0, 2, 3) for precision in ("fp32", "bf16")
}


def preset_configs() -> dict[str, dict[str, Any]]:
    """``configs/deepspeed/<name>.json`` contents: :func:`deepspeed_config` of the default config per preset."""
    from asyncrl.core.config import load_config

    out = {}
    for name, (stage, precision) in PRESETS.items():
        cfg = load_config([], environ={}, overrides={"trainer": {"zero_stage": stage, "precision": precision}})
        out[name] = deepspeed_config(cfg)
    return out


def _write_presets(directory: str) -> None:
    import json
    from pathlib import Path

    for name, data in preset_configs().items():
        (Path(directory) / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":  # python -m trainer.engine configs/deepspeed
    import sys

    _write_presets(sys.argv[1] if len(sys.argv) > 1 else "configs/deepspeed")


class GradNormProbe:
    """The global gradient norm (before clipping) of a DeepSpeed engine's last optimizer step.

    ZeRO and bf16 optimizers report it (``engine.get_global_grad_norm()``); plain stage-0 fp32
    does not, so the probe records the norm DeepSpeed computes when clipping (and computes it
    when clipping is off). Call :meth:`reset` before ``engine.step()`` and :meth:`read` after.
    """

    def __init__(self, engine: Any):
        import torch

        self.engine = engine
        self.value: float | None = None
        opt = engine.optimizer
        if not isinstance(opt, torch.optim.Optimizer) or hasattr(opt, "_global_grad_norm"):
            return
        from deepspeed.runtime.utils import clip_grad_norm_

        def clip_and_record():
            self.value = float(clip_grad_norm_(parameters=engine.module.parameters(),
                                               max_norm=engine.gradient_clipping(), mpu=engine.mpu))

        engine.clip_fp32_gradients = clip_and_record  # DeepSpeed discards the norm it computes

        def pre_hook(optimizer, args, kwargs):
            if engine.gradient_clipping() <= 0:
                norms = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
                self.value = float(torch.stack(norms).norm()) if norms else 0.0

        opt.register_step_pre_hook(pre_hook)

    def reset(self) -> None:
        """Forget the previous step's norm."""
        self.value = None

    def read(self) -> float:
        """The norm of the step just taken (NaN when the engine reported none)."""
        import torch

        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = self.value
        if isinstance(norm, torch.Tensor):
            norm = float(norm)
        return float(norm) if norm is not None else float("nan")
