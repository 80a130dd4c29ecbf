"""Where the trainer's memory goes, full fine-tuning against LoRA, on the main job's step.

Workload: the real :class:`trainer.trainer.Trainer` on ``configs/smollm2_arith.yaml``
(SmolLM2-135M-Instruct fp32, DeepSpeed ZeRO-0 on CPU with gloo, one rank, decoupled PPO,
shared prompts and block attention), one arm with ``trainer.lora: {rank: 16, alpha: 32}`` (as in
docs/results.md section E). Batches are the main job's (6 prompt groups x 8 samples, the job's own
prompts; ``bench/trainer_profile.py``'s :func:`main_job_batch`): first ``--early_steps`` steps
with ``U[--early]`` response tokens (the main job's first steps: 1,300-1,700 processed tokens),
then ``--late_steps`` with ``U[--late]`` (its later steps: ~400 processed tokens). Each step is
``begin_step``, ``forward_backward``, ``optim_step`` and ``publish_weights`` (disk), as the
training loop calls them.

Each arm runs in its own process (clean counters), once per allocator setting (``--allocators``):

* ``glibc``: ``trainer.heap_mmap_threshold_bytes: null``, glibc's dynamic mmap threshold, as the
  main job ran before trainer/memory.py;
* ``trim``: the same, with ``malloc_trim(0)`` after each stage (what the heap holds free versus
  what is live);
* ``fixed``: ``trainer.heap_mmap_threshold_bytes: 1048576``, a fixed 1 MiB threshold
  (trainer/memory.py; off by default): every block of
  1 MiB or more is its own mapping, returned to the system when freed.

Recorded after each stage (model load, LoRA wrap, ``Trainer`` construction = ``deepspeed.initialize``,
``begin_step``, forward, backward, optimizer step, publish): resident memory (psutil), the peak
resident memory *within* the stage (``VmHWM`` after resetting it through ``/proc/self/clear_refs``,
proc(5)), and glibc's ``mallinfo2`` (mallinfo(3)): bytes in use through malloc and bytes it holds
free. Tensor accounting from the engine: parameters (trainable, frozen), gradients, the
optimizer's state, the bytes the forward pass saves for backward (``saved_tensors_hooks``, unique
storages) and the logits of the step. Printed: the peak resident memory per arm and allocator, its
breakdown, and the ratios LoRA/full.

Memory figures do not depend on the machine's load (timings are not reported).

Usage: ``python bench/trainer_memory.py [--arms full,lora] [--allocators glibc,trim,fixed]
[--early 16,48] [--late 3,10] [--early_steps 2] [--late_steps 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import emit, record_path  # bench/_report.py (the script's folder is on sys.path)

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.memory import malloc_stats, reset_peak_resident, resident_memory  # noqa: E402

GB = 1e9
ARMS = {"full": {}, "lora": {"trainer": {"lora": {"rank": 16, "alpha": 32}}}}
#: allocator setting -> trainer config overrides
ALLOCATORS = {"glibc": {"heap_mmap_threshold_bytes": None}, "trim": {"heap_mmap_threshold_bytes": None}, "fixed": {"heap_mmap_threshold_bytes": 1 << 20}}


class Probe:
    """Resident memory, its per-stage peak and glibc's view of the heap, recorded by stage name."""

    def __init__(self, trim: bool):
        import psutil

        self.proc = psutil.Process()
        self.libc = ctypes.CDLL("libc.so.6")  # malloc_trim
        self.trim = trim
        self.stages: list[dict] = []
        self._t = time.perf_counter()
        reset_peak_resident()

    def mark(self, stage: str, **extra: float) -> None:
        """Record ``stage`` (just finished): RSS now, peak RSS since the previous mark, malloc's bytes."""
        mi = malloc_stats()
        row = {"stage": stage, "rss_gb": self.proc.memory_info().rss / GB, "peak_rss_gb": resident_memory()[1],
               "malloc_in_use_gb": (mi.uordblks + mi.hblkhd) / GB, "malloc_free_held_gb": mi.fordblks / GB,
               "malloc_mmapped_gb": mi.hblkhd / GB, "seconds": time.perf_counter() - self._t, **extra}
        if self.trim:
            self.libc.malloc_trim(0)
            row["rss_after_trim_gb"] = self.proc.memory_info().rss / GB
        self.stages.append(row)
        reset_peak_resident()
        self._t = time.perf_counter()


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def tensor_accounting(tr) -> dict[str, float]:
    """Bytes of the engine's parameters (trainable / frozen), gradients and optimizer state, in GB."""
    import torch

    params = list(tr.module.parameters())
    opt = tr.engine.optimizer
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params_trainable_gb": _nbytes(p for p in params if p.requires_grad) / GB,
            "params_frozen_gb": _nbytes(p for p in params if not p.requires_grad) / GB,
            "grads_gb": _nbytes(p.grad for p in params if p.grad is not None) / GB,
            "optimizer_params": float(len(opt_params)), "optimizer_param_gb": _nbytes(opt_params) / GB,
            "optimizer_state_gb": _nbytes(state) / GB,
            "models_in_process": float(sum(1 for o in _live_modules() if o.__class__.__name__.endswith("ForCausalLM")))}


def _live_modules():
    import gc

    import torch

    return [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]


def child(arm: str, allocator: str, args) -> dict:
    """One arm in this process: load, wrap, build the trainer, run the steps; the stages' records."""
    probe = Probe(trim=allocator == "trim")
    import torch

    torch.set_num_threads(args.threads)
    from asyncrl.core.config import load_config
    from asyncrl.models import load_causal_lm, load_tokenizer, resolve_model_path
    from trainer_profile import main_job_batch
    from trainer.trainer import Trainer

    probe.mark("imports")
    out_dir = Path(tempfile.mkdtemp(prefix="trainer_memory_"))
    base_cfg = load_config(["--config", str(args.config)], environ={})
    model_dir = resolve_model_path(base_cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, "float32")
    probe.mark("model_load")
    overrides = {"model": {"path": str(model_dir)}, "run": {"output_dir": str(out_dir), "name": arm}}
    for key, value in ARMS[arm].items():
        overrides.setdefault(key, {}).update(value)
    overrides.setdefault("trainer", {}).update(ALLOCATORS[allocator])
    cfg = load_config(["--config", str(args.config)], environ={}, overrides=overrides)
    tr = Trainer(cfg, model=model)
    del model
    probe.mark("trainer_init", **tensor_accounting(tr))
    lo, hi = args.early
    early = main_job_batch(cfg, tokenizer, 6, 8, lo, hi, seed=1)
    lo, hi = args.late
    late = main_job_batch(cfg, tokenizer, 6, 8, lo, hi, seed=2)
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    engine_backward = tr.engine.backward

    def backward(*a, **k):
        probe.mark(f"{tag}/forward", saved_for_backward_gb=sum(saved.values()) / GB)
        saved.clear()
        result = engine_backward(*a, **k)
        return result

    tr.engine.backward = backward
    losses = []
    for step in range(args.early_steps + args.late_steps):
        groups = early if step < args.early_steps else late
        tag = f"step{step + 1}_{'early' if step < args.early_steps else 'late'}"
        plan = tr.begin_step(groups)
        rows = sum(len(s.response_ids) for s in plan.batch.samples)
        probe.mark(f"{tag}/begin_step", logit_rows=float(rows),
                   logits_gb=rows * tr.model_config.vocab_size * 4 / GB)
        for mb in plan.minibatches:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                metrics = tr.forward_backward(mb)
            probe.mark(f"{tag}/backward", processed_tokens=metrics["processed_tokens"])
            tr.optim_step(cfg.trainer.optimizer.lr)
            probe.mark(f"{tag}/optim_step")
            losses.append(metrics["loss"])
        tr.publish_weights()
        probe.mark(f"{tag}/publish", **tensor_accounting(tr))
    tr.close()
    return {"arm": arm, "allocator": allocator, "stages": probe.stages, "losses": losses}


def summarise(run: dict) -> dict:
    """Peak RSS of the run, the stage it happened in, and what each stage added (GB)."""
    stages = run["stages"]
    peak = max(stages, key=lambda s: s["peak_rss_gb"])
    init = next(s for s in stages if s["stage"] == "trainer_init")
    last = stages[-1]
    return {
        "peak_rss_gb": peak["peak_rss_gb"], "peak_stage": peak["stage"],
        "rss_end_gb": last["rss_gb"], "rss_after_imports_gb": stages[0]["rss_gb"],
        "rss_after_model_load_gb": next(s for s in stages if s["stage"] == "model_load")["rss_gb"],
        "rss_after_trainer_init_gb": init["rss_gb"],
        "malloc_in_use_end_gb": last["malloc_in_use_gb"], "malloc_free_held_end_gb": last["malloc_free_held_gb"],
        "params_gb": last["params_trainable_gb"] + last["params_frozen_gb"],
        "params_trainable_gb": last["params_trainable_gb"], "grads_gb": last["grads_gb"],
        "optimizer_state_gb": last["optimizer_state_gb"],
        "saved_for_backward_gb_max": max(s.get("saved_for_backward_gb", 0.0) for s in stages),
        "logits_gb_max": max(s.get("logits_gb", 0.0) for s in stages),
        "models_in_process": last["models_in_process"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2_arith.yaml")
    ap.add_argument("--arms", default="full,lora")
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--early", type=lambda s: tuple(int(x) for x in s.split(",")), default=(16, 48))
    ap.add_argument("--late", type=lambda s: tuple(int(x) for x in s.split(",")), default=(3, 10))
    ap.add_argument("--early_steps", type=int, default=2)
    ap.add_argument("--late_steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        arm, allocator = args.child.split(":")
        print("RESULT " + json.dumps(child(arm, allocator, args)))
        return 0
    arms = [a for a in args.arms.split(",") if a]
    allocators = [a for a in args.allocators.split(",") if a]
    for name, known in (("arms", ARMS), ("allocators", ALLOCATORS)):
        bad = [x for x in (arms if name == "arms" else allocators) if x not in known]
        if bad:
            raise SystemExit(f"--{name}: unknown {bad}; choose from {', '.join(known)}")
    runs = []
    for allocator in allocators:
        for arm in arms:
            cmd = [sys.executable, __file__, "--child", f"{arm}:{allocator}", "--config", str(args.config),
                   "--early", ",".join(map(str, args.early)), "--late", ",".join(map(str, args.late)),
                   "--early_steps", str(args.early_steps), "--late_steps", str(args.late_steps),
                   "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{arm}/{allocator} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
            run = json.loads(lines[-1][len("RESULT "):])
            run["summary"] = summarise(run)
            runs.append(run)
            print(f"{arm}/{allocator}: {json.dumps(run['summary'])}", file=sys.stderr)
    result: dict = {"config": record_path(args.config), "early_response_tokens": list(args.early),
                    "late_response_tokens": list(args.late), "early_steps": args.early_steps,
                    "late_steps": args.late_steps, "threads": args.threads, "runs": runs, "ratios_lora_over_full": {}}
    by = {(r["arm"], r["allocator"]): r["summary"] for r in runs}
    for allocator in allocators:
        if ("full", allocator) in by and ("lora", allocator) in by:
            f, lo = by[("full", allocator)], by[("lora", allocator)]
            result["ratios_lora_over_full"][allocator] = {
                k: lo[k] / f[k] for k in ("peak_rss_gb", "rss_end_gb", "malloc_in_use_end_gb") if f[k] > 0}
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
