"""The simulator's tables, as the command prints them and as docs/scaling.md shows them.

``print_validation`` and ``print_scaling`` are the raw tables of ``python -m bench.simulate
validate`` / ``scaling``. The ``*_table`` functions render the tables of docs/scaling.md. In that
page, each generated table sits between two HTML comments (invisible on GitHub)::

    <!-- bench.simulate: validation-main -->
    | run | quantity | ... |
    <!-- /bench.simulate -->

:func:`doc_blocks` renders every block from the code, :func:`read_blocks` reads them from the
page and :func:`write_blocks` puts new ones in; ``python -m bench.simulate doc --write`` does
both, and ``tests/test_simulate_doc.py`` checks that the page holds what the code prints. The
full scaling tables take ~15 minutes of one core and are not generated blocks; the reduced one
(:data:`REDUCED_SCALING`: the same code on a smaller job, seconds) is.
"""

from __future__ import annotations

import re
from typing import Any

from .calibration import GLOBAL_BATCH_GROUPS, WORKLOADS
from .scaling import PUBLISHED, scaling
from .validation import BENCH_B_QUANTITIES, within_bound

__all__ = ["print_validation", "print_scaling", "validation_main_table", "validation_bench_table",
           "validation_speedup_table", "validation_summary", "scaling_table", "REDUCED_SCALING", "BLOCKS",
           "doc_blocks", "read_blocks", "write_blocks"]

MINUS = "\u2212"


def _fmt(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def print_validation(res: dict[str, Any]) -> None:
    """Print the validation tables of :func:`bench.simulate.validation.validation`'s result (markdown, every row)."""
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


def print_scaling(res: dict[str, Any]) -> None:
    """Print the scaling tables of :func:`bench.simulate.scaling.scaling`'s result and the published results (markdown)."""
    groups = res.get("groups", GLOBAL_BATCH_GROUPS)
    for wl in dict.fromkeys(b["workload"] for b in res["best"]):
        print(f"\n{wl}: {WORKLOADS[wl]['lengths'].describe()}, prompt {WORKLOADS[wl]['prompt']}, n {WORKLOADS[wl]['n']}, "
              f"B {groups} groups per step, Qwen2.5-7B on H100\n")
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


# ----------------------------------------------------------------------------------------------
# the tables of docs/scaling.md


def _num(x: float, decimals: int) -> str:
    """``x`` with ``decimals`` decimals (an int as it is, 0 as ``0``, a value that would print as 0 with one
    significant digit), the minus sign typeset."""
    if isinstance(x, int) and not isinstance(x, bool):
        s = str(x)
    elif x == 0:
        s = "0"
    elif abs(x) < 0.5 * 10 ** -decimals:
        s = f"{x:.1g}"
    else:
        s = f"{x:.{decimals}f}"
    return s.replace("-", MINUS)


def _error(pred: float, meas: float, decimals: int = 2, bold: bool = True) -> str:
    """The error of ``pred``: relative (``+3%``; bold when outside 20%), or, when ``meas`` is 0, the
    absolute difference (``+0.004``; ``0`` when both are 0)."""
    if meas == 0:
        if pred == 0:
            return "0"
        s = ("+" if pred > 0 else "") + _num(pred, decimals)
    else:
        s = f"{(pred - meas) / abs(meas) * 100:+.0f}%".replace("-", MINUS)
    return f"**{s}**" if bold and not within_bound(pred, meas) else s


#: The main job's runs: key -> (label, what the run's cores did).
MAIN_LABELS = {"async": ("async", "1 core each"), "sync": ("sync", "both cores to each phase"),
               "async_after_change": ("async after the admission change", "20-minute check")}
#: The main job's quantities as the page names them: (label, measured keys, decimals).
MAIN_QUANTITIES = [("seconds per step", ("seconds_per_step",), 1), ("samples/s", ("samples_per_second",), 2),
                   ("rollout idle ratio", ("rollout_idle",), 2), ("trainer idle ratio", ("trainer_idle",), 2),
                   ("staleness mean / max", ("staleness_mean", "staleness_max"), 2)]


def validation_main_table(res: dict[str, Any]) -> str:
    """The main job's predicted vs measured figures (markdown table, one row per quantity).

    Args:
        res: :func:`bench.simulate.validation.validation`'s result.
    """
    rows = {(r["key"], r["quantity"]): r for r in res["rows"] if r["mode"] is None}
    lines = ["| run | quantity | measured | predicted | error |", "|---|---|---:|---:|---:|"]
    for key, (name, cores) in MAIN_LABELS.items():
        k = res["main"][key]
        label = f"{name} (p {k['partial_percent']:g}, M {k['max_budget']}, η {k['max_staleness']}; {cores})"
        for quantity, keys, dec in MAIN_QUANTITIES:
            if (key, keys[0]) not in rows:
                continue
            r = rows[(key, keys[0])]
            meas, pred, err = _num(r["measured"], dec), _num(r["predicted"], dec), _error(r["predicted"], r["measured"], dec)
            if len(keys) == 2:  # mean / max: the max is an integer, its error a difference
                m = rows[(key, keys[1])]
                diff = int(m["predicted"]) - int(m["measured"])
                meas += f" / {int(m['measured'])}"
                pred += f" / {int(m['predicted'])}"
                err += f" / {diff:+d}".replace("+0", "0").replace("-", MINUS)
            lines.append(f"| {label} | {quantity} | {meas} | {pred} | {err} |")
            label = ""
    return "\n".join(lines).replace("|  |", "| |")


def _setup(s: dict[str, Any]) -> str:
    threads = s["threads"]
    return (f"{'sequential' if s['sequential'] else 'concurrent'}, {threads} thread{'s' if threads != 1 else ''}, "
            f"L {s['max_response_len']}, R {s['rollout_batch_size']}")


def _setups(res: dict[str, Any]) -> list[str]:
    """The benchmark (b) records in the page's order: concurrent before sequential, then threads, L, R."""
    return sorted(res["bench_b"], key=lambda f: (res["bench_b"][f]["sequential"], res["bench_b"][f]["threads"],
                                                   res["bench_b"][f]["max_response_len"], res["bench_b"][f]["rollout_batch_size"]))


def validation_bench_table(res: dict[str, Any]) -> str:
    """Benchmark (b)'s measured → predicted figures (markdown table, one row per record and mode).

    Args:
        res: :func:`bench.simulate.validation.validation`'s result.
    """
    rows = {(r["key"], r["mode"], r["quantity"]): r for r in res["rows"] if r["mode"] is not None}
    decimals = {"tokens_per_second": 1, "engine_tokens_per_second": 1, "running_requests": 1, "staleness_mean": 2}
    lines = ["| setup | mode | tokens/s to the trainer | engine tokens/s | running requests | mean staleness |",
             "|---|---|---|---|---|---|"]
    for f in _setups(res):
        label = _setup(res["bench_b"][f])
        for mode in ("partial", "sync"):
            cells = []
            for q in BENCH_B_QUANTITIES:
                r = rows.get((f, mode, q))
                if r is None:
                    break
                m, p, dec = r["measured"], r["predicted"], decimals[q]
                cell = f"{_num(m, dec)} → {_num(p, dec)}"
                if not (m == 0 and p == 0):
                    cell += f" ({_error(p, m, dec)})"
                cells.append(cell)
            else:
                lines.append(f"| {label} | {mode} | " + " | ".join(cells) + " |")
                label = ""
    return "\n".join(lines).replace("|  |", "| |")


def validation_speedup_table(res: dict[str, Any]) -> str:
    """Benchmark (b)'s partial / sync speed-up, measured and predicted (markdown table).

    Args:
        res: :func:`bench.simulate.validation.validation`'s result.
    """
    by = {b["setup"]: b for b in res["bench_b_speedups"]}
    lines = ["| setup | measured partial / sync | predicted | error |", "|---|---:|---:|---:|"]
    for f in _setups(res):
        if f in by:
            b = by[f]
            lines.append(f"| {_setup(res['bench_b'][f])} | {b['measured_speedup']:.2f}× | {b['predicted_speedup']:.2f}× | "
                         f"{_error(b['predicted_speedup'], b['measured_speedup'], bold=False)} |")
    return "\n".join(lines)


def validation_summary(res: dict[str, Any]) -> str:
    """One sentence: how many quantities are within 20%, for the main job and for benchmark (b)."""
    rows = res["rows"]
    main = [r for r in rows if r["mode"] is None]
    bench = [r for r in rows if r["mode"] is not None]
    ok = lambda rs: sum(bool(r["within_20pct"]) for r in rs)  # noqa: E731
    return (f"Summary: {ok(rows)} of {len(rows)} quantities within 20% (quantities measured as 0 within 0.1): "
            f"{ok(main)} of the main job's {len(main)} and {ok(bench)} of benchmark (b)'s {len(bench)}.")


def scaling_table(res: dict[str, Any], workload: str) -> str:
    """One workload's scaling table as docs/scaling.md shows them: one row per scale (markdown).

    Args:
        res: :func:`bench.simulate.scaling.scaling`'s result.
        workload: a key of :data:`bench.simulate.calibration.WORKLOADS`.
    """
    lines = ["| GPUs | sync s/step | sync idle (rollout / trainer) | best async (rollout : trainer GPUs) | async s/step | "
             "async idle (rollout / trainer) | staleness mean / max | restarted samples | speed-up | with `abort` |",
             "|---:|---:|---|---|---:|---|---|---:|---:|---:|"]
    for b in res["best"]:
        if b["workload"] != workload:
            continue
        s, a, G = b["sync"], b["best"], b["gpus"]
        nr = int(round(G * b["best_rollout_fraction"]))
        lines.append(f"| {G} | {s['seconds_per_step']:,.0f} | {s['rollout_idle']:.2f} / {s['trainer_idle']:.2f} | "
                     f"{b['best_setting'].split(',')[0]}, {nr}:{G - nr} | {a['seconds_per_step']:,.0f} | "
                     f"{a['rollout_idle']:.2f} / {a['trainer_idle']:.2f} | {a['staleness_mean']:.2f} / {a['staleness_max']} | "
                     f"{a['buffer']['restarted_samples']:,} | **{b['speedup']:.2f}×** | {b['abort_speedup']:.2f}× |")
    return "\n".join(lines)


#: The reduced scaling table of docs/scaling.md: the scaling code on a job small enough for a test
#: (16 prompt groups per step instead of 512, the short run lengths of ``--quick``).
REDUCED_SCALING = {"scales": (8, 16), "workloads": ("long-tail", "short"), "groups": 16, "quick": True, "seed": 0}


def _reduced_scaling_block(res: dict[str, Any]) -> str:
    out = []
    for wl in dict.fromkeys(b["workload"] for b in res["best"]):
        w = WORKLOADS[wl]
        out.append(f"*{wl}* ({w['lengths'].describe()}, prompt {w['prompt']}, n {w['n']}, "
                   f"B {res['groups']} groups per step):")
        out.append("")
        out.append(scaling_table(res, wl))
        out.append("")
    return "\n".join(out).rstrip("\n")


#: The generated blocks of docs/scaling.md, in page order.
BLOCKS = ("validation-main", "validation-bench-b", "validation-speedups", "validation-summary", "validation-agents",
          "validation-agents-prefill3", "validation-longtail", "scaling-reduced")


def doc_blocks(validation_result: dict[str, Any] | None = None,
               reduced_scaling_result: dict[str, Any] | None = None) -> dict[str, str]:
    """Every generated block of docs/scaling.md (:data:`BLOCKS`), rendered from the code.

    Args:
        validation_result: :func:`bench.simulate.validation.validation`'s result (None: computed, ~1 s).
        reduced_scaling_result: :func:`bench.simulate.scaling.scaling` with :data:`REDUCED_SCALING`
            (None: computed, a few seconds).
    """
    from .agent_check import agent_validation, format_agent_validation
    from .longtail_check import format_longtail_validation, longtail_validation
    from .validation import validation

    v = validation_result if validation_result is not None else validation(seed=0)
    s = reduced_scaling_result if reduced_scaling_result is not None else scaling(**REDUCED_SCALING)
    return {"validation-main": validation_main_table(v), "validation-bench-b": validation_bench_table(v),
            "validation-speedups": validation_speedup_table(v), "validation-summary": validation_summary(v),
            "validation-agents": format_agent_validation(agent_validation(seed=0)),
            "validation-agents-prefill3": format_agent_validation(agent_validation(seed=0, prefill_scale=3.0)),
            "validation-longtail": format_longtail_validation(longtail_validation(seed=0)),
            "scaling-reduced": _reduced_scaling_block(s)}


_BLOCK = re.compile(r"<!-- bench\.simulate: ([a-z0-9-]+) -->\n(.*?)\n?<!-- /bench\.simulate -->", re.S)


def read_blocks(text: str) -> dict[str, str]:
    """The generated blocks found in a page's ``text``: name -> content (without the markers).

    Raises:
        ValueError: a block name appears twice.
    """
    out: dict[str, str] = {}
    for m in _BLOCK.finditer(text):
        if m.group(1) in out:
            raise ValueError(f"block {m.group(1)!r} appears twice")
        out[m.group(1)] = m.group(2).strip("\n")
    return out


def write_blocks(text: str, blocks: dict[str, str]) -> str:
    """``text`` with the content of each of ``blocks`` replaced (the markers stay).

    Raises:
        KeyError: a block of ``blocks`` has no markers in ``text``.
    """
    missing = set(blocks) - set(read_blocks(text))
    if missing:
        raise KeyError(f"no markers for {sorted(missing)}: add '<!-- bench.simulate: NAME -->' ... "
                       "'<!-- /bench.simulate -->' to the page")

    def sub(m: re.Match) -> str:
        name = m.group(1)
        body = blocks.get(name, m.group(2).strip("\n"))
        return f"<!-- bench.simulate: {name} -->\n{body}\n<!-- /bench.simulate -->"

    return _BLOCK.sub(sub, text)
