"""``python -m bench.simulate validate | agents | longtail | scaling | run | doc``: the simulator's command line (see ``--help``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from . import __doc__ as package_doc
from .agent_check import agent_validation, extract_episodes, format_agent_validation
from .calibration import GLOBAL_BATCH_GROUPS, WORKLOADS, gpu_config
from .longtail_check import (
    extract_runs,
    format_longtail_forecast,
    format_longtail_validation,
    longtail_forecast,
    longtail_validation,
)
from .model import simulate
from .scaling import scaling
from .tables import doc_blocks, print_scaling, print_validation, read_blocks, write_blocks
from .validation import validation

__all__ = ["main", "DOC"]

#: The page whose generated tables ``doc`` renders.
DOC = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"


def _doc(path: Path, write: bool, check: bool) -> int:
    """Render the generated tables of ``path``; write them in, check them, or print them."""
    blocks = doc_blocks()
    text = path.read_text()
    if write:
        path.write_text(write_blocks(text, blocks))
        print(f"wrote {len(blocks)} tables into {path}", file=sys.stderr)
        return 0
    if check:
        stale = [name for name, body in blocks.items() if read_blocks(text).get(name) != body]
        for name in stale:
            print(f"{path}: table {name!r} differs from what the code prints "
                  "(python -m bench.simulate doc --write)", file=sys.stderr)
        return 1 if stale else 0
    for name, body in blocks.items():
        print(f"<!-- bench.simulate: {name} -->\n{body}\n<!-- /bench.simulate -->\n")
    return 0


def _extract(fn, pairs: list[str], noun: str, cmd: str) -> bool:
    """Run an ``--extract KEY=RUN_DIR`` reader ``fn``; print what it wrote, or the error (False)."""
    try:
        print(f"{noun} " + ", ".join(fn(pairs)) + " written", file=sys.stderr)
    except (ValueError, OSError) as exc:
        print(f"python -m bench.simulate {cmd}: {exc}", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """``validate`` | ``agents`` | ``longtail`` | ``scaling`` | ``run`` | ``doc`` (see ``--help``); returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m bench.simulate", description=package_doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The model and its sources: the package docstring and docs/scaling.md.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="predicted vs measured for this machine's runs (docs/results.md, docs/rollout.md)")
    g = sub.add_parser("agents", help="predicted vs measured for the slow-tool agent's runs (docs/results.md section G)")
    g.add_argument("--extract", nargs="+", metavar="KEY=RUN_DIR", default=None,
                   help="first add these runs' episodes (their trace/) to docs/bench/calculator_episodes.json")
    g.add_argument("--prefill-scale", type=float, default=1.0,
                   help="divide the engine's derived prefill cost by this (a sensitivity check, docs/scaling.md)")
    lt = sub.add_parser("longtail", help="predicted vs measured for the long-tail task's runs (docs/results.md section H)")
    lt.add_argument("--extract", nargs="+", metavar="KEY=RUN_DIR", default=None,
                    help="first add these runs' lengths, records and decode rates (their trace/ and metrics) "
                         "to docs/bench/longtail_lengths.json; KEY is <arm>-s<seed>")
    lt.add_argument("--prefill-scale", type=float, default=1.0,
                    help="divide the engine's derived prefill cost by this (a sensitivity check, docs/scaling.md)")
    lt.add_argument("--seeds", type=int, default=20, help="simulations per prediction (their mean is printed)")
    lt.add_argument("--forecast", action="store_true",
                    help="also every arm on the synchronous run's lengths, 15 steps (~30 s): what the model "
                         "attributes the step times to")
    s = sub.add_parser("scaling", help="predicted async/sync speed-up on 8, 64, 512 H100s (7B model)")
    s.add_argument("--scales", type=int, nargs="+", default=[8, 64, 512])
    s.add_argument("--workloads", nargs="+", default=["long-tail", "short"], choices=sorted(WORKLOADS))
    s.add_argument("--quick", action="store_true", help="fewer train steps per run")
    s.add_argument("--groups", type=int, default=GLOBAL_BATCH_GROUPS, help="B: prompt groups per train step")
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
    d = sub.add_parser("doc", help="the generated tables of docs/scaling.md (validation, reduced scaling): "
                                   "print them, --check them against the page, or --write them into it")
    d.add_argument("--path", type=Path, default=DOC, help="the page (default: docs/scaling.md)")
    mode = d.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the tables in the page")
    mode.add_argument("--check", action="store_true", help="exit 1 when the page's tables differ from the code's")
    for p in (v, g, lt, s, r):
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", default=None, help="write the raw results to this file")
    a = ap.parse_args(argv)
    if a.cmd == "doc":
        return _doc(a.path, a.write, a.check)
    if a.cmd == "validate":
        res = validation(seed=a.seed)
        print_validation(res)
    elif a.cmd == "agents":
        if not a.prefill_scale > 0:  # before --extract writes anything
            ap.error("--prefill-scale must be > 0")
        if a.extract and not _extract(extract_episodes, a.extract, "episodes of", "agents"):
            return 2
        res = agent_validation(seed=a.seed, prefill_scale=a.prefill_scale)
        print(format_agent_validation(res))
    elif a.cmd == "longtail":
        if not a.prefill_scale > 0 or a.seeds < 1:  # before --extract writes anything
            ap.error("--prefill-scale must be > 0 and --seeds >= 1")
        if a.extract and not _extract(extract_runs, a.extract, "runs", "longtail"):
            return 2
        res = longtail_validation(seed=a.seed, prefill_scale=a.prefill_scale, seeds=a.seeds)
        print(format_longtail_validation(res))
        if a.forecast:
            res["forecast"] = longtail_forecast(res, seed=a.seed, seeds=a.seeds, prefill_scale=a.prefill_scale)
            print("\n" + format_longtail_forecast(res["forecast"]))
    elif a.cmd == "scaling":
        res = scaling(a.scales, a.workloads, seed=a.seed, quick=a.quick, groups=a.groups,
                      log=lambda m: print(m, file=sys.stderr, flush=True))
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
