"""``asyncrl trace RUN_DIR [--sample ID | --step N | --minutes A-B] [--png]``: the life of every sample.

Reads the timelines the buffer exported to ``<run_dir>/trace/`` (:mod:`buffers.timeline`,
docs/buffer.md#timeline) and writes a trace in the Chrome/Perfetto **trace-event JSON** format
(the "JSON Object Format" of the Trace Event Format specification,
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU, as Perfetto imports
it: https://perfetto.dev/docs/getting-started/other-formats). It opens in https://ui.perfetto.dev
(or ``chrome://tracing``) with no plugin:

* one process per rollout server (the worker id its claims carry), its threads being lanes so that
  the segments it generated concurrently do not overlap on one track; one process for the trainer;
* each segment of a sample is a complete event (``ph: X``) on the server that generated it, from the
  claim (or resume) to its end (complete, parked with its reason, requeued, a lost lease), with the
  first flushed tokens as an instant; scoring is a slice of its own;
* a sample's segments are linked by flow events (``ph: s``/``t``/``f``, one id per sample) across
  parks and resumes, ending in the train step that consumed it;
* the trainer's steps are slices from the batch's hand-out to its acknowledgement, with the policy
  publishes and recoveries as instants;
* each slice carries the sample's ``staleness`` (the batch's version minus the oldest version of
  its tokens), ``reward``, tokens, finish reason, resumes and restarts as ``args``.

Only the groups that left Redis (committed after a checkpoint, or dropped) are in the files; the
samples still live in the buffer appear after the next commit. ``--png`` draws the same timeline with
matplotlib (one row per server lane and the trainer, samples as bars coloured by policy version) for a
quick look without a browser. The format is written by hand because the ``perfetto`` Python package's
trace builder writes protobuf traces and needs its protobuf stack; JSON needs nothing, and
:func:`validate_trace` checks a written file against the specification's rules (tests/test_trace.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from buffers.timeline import TimelineEvent, parse_events, read_records

__all__ = ["Segment", "SampleLife", "load_lives", "first_event_ms", "build_trace", "validate_trace", "plot_timeline",
           "timeline_setting", "main"]

#: events that end an open segment, with the status they leave the sample in
_SEGMENT_END = {"complete", "park", "requeue", "turn", "restart", "drop", "discard"}


@dataclass
class Segment:
    """One engine call of a sample (or its scoring): on ``worker`` from ``start_ms`` to ``end_ms``."""

    worker: str
    start_ms: int
    end_ms: int
    kind: str  # "generate" or "score"
    end: str  # the event that ended it: complete, park, requeue, turn, score, fail, ...
    reason: str = ""
    version: int = -1  # the clock when it was claimed
    first_tokens_ms: int | None = None
    tokens: int = 0  # response length when it ended


@dataclass
class SampleLife:
    """A sample's timeline (its group's events merged in) and what the buffer knew when it left Redis."""

    sample_id: str
    group_id: str
    events: list[TimelineEvent]
    how: str  # committed | dropped
    step: int | None = None
    version: int | None = None  # the policy version it was trained under (the batch's)
    minv: int = -1
    reward: float | None = None
    status: str = ""
    finish: str = ""
    tokens: int = 0
    resumes: int = 0
    restarts: int = 0
    segments: list[Segment] = field(default_factory=list)

    @property
    def staleness(self) -> int | None:
        """Trained version minus the oldest version of its tokens (None when not trained)."""
        if self.version is None or self.minv < 0:
            return None
        return max(0, self.version - self.minv)


def _segments(events: list[TimelineEvent]) -> list[Segment]:
    segs: list[Segment] = []
    open_seg: Segment | None = None
    for e in events:
        if e.name in ("claim", "resume", "claim_score"):
            if open_seg is not None:  # a claim without an end (cannot happen for a live lease): close it here
                open_seg.end_ms, open_seg.end = e.t_ms, "reclaimed"
                segs.append(open_seg)
            open_seg = Segment(e.args.get("w", e.origin), e.t_ms, e.t_ms,
                               "score" if e.name == "claim_score" else "generate", "",
                               version=int(e.args.get("v", -1)), tokens=int(e.args.get("len", 0)))
        elif e.name == "gen" and open_seg is not None and open_seg.first_tokens_ms is None:
            open_seg.first_tokens_ms = e.t_ms
        elif open_seg is not None and (e.name in _SEGMENT_END or e.name in ("score", "fail", "unscored")):
            if open_seg.kind == "score" and e.name not in ("score", "fail", "unscored", "restart", "drop"):
                continue
            open_seg.end_ms, open_seg.end = e.t_ms, e.name
            open_seg.reason = e.args.get("reason", "")
            open_seg.tokens = int(e.args.get("len", open_seg.tokens))
            segs.append(open_seg)
            if e.name == "complete":  # the same worker scores it next (it keeps the lease)
                open_seg = Segment(open_seg.worker, e.t_ms, e.t_ms, "score", "", version=open_seg.version,
                                   tokens=open_seg.tokens)
            elif e.name == "turn":  # an episode's next model call starts at once, same lease
                open_seg = Segment(open_seg.worker, e.t_ms, e.t_ms, "generate", "", version=open_seg.version,
                                   tokens=open_seg.tokens)
            else:
                open_seg = None
    return segs


def load_lives(records: Iterable[dict[str, Any]]) -> tuple[list[SampleLife], list[dict[str, Any]]]:
    """The sample lives in ``records`` (group records expanded to their samples, the last export of
    a group winning) and the other records (batches, publishes, recoveries), both in time order."""
    lives: dict[str, SampleLife] = {}
    other = []
    for rec in records:
        if rec.get("kind") != "group":
            other.append(rec)
            continue
        gid = str(rec.get("gid"))
        gevents = list(parse_events(rec.get("tl", "")))
        samples = rec.get("samples") or []
        if isinstance(samples, dict):  # Lua's cjson writes an empty table as {}
            samples = list(samples.values())
        for s in samples:
            sid = f"{gid}/{s.get('i')}"
            # one script may record a group's and a sample's event at the same ms (a claim admits the group
            # it then claims from; a score makes the group READY): admission first, then the sample's, then
            # the group's later events
            tagged = [(e.t_ms, 0 if e.name in ("fed", "admit") else 2, e) for e in gevents]
            tagged += [(e.t_ms, 1, e) for e in parse_events(s.get("tl", ""))]
            events = [e for *_, e in sorted(tagged, key=lambda x: (x[0], x[1]))]
            life = SampleLife(sid, gid, events, str(rec.get("how", "")),
                              step=rec.get("step") if rec.get("how") == "committed" else None,
                              version=rec.get("version") if rec.get("how") == "committed" else None,
                              minv=int(s.get("minv", -1) if s.get("minv") is not None else -1),
                              reward=s.get("reward"), status=str(s.get("status", "")),
                              finish=str(s.get("finish", "")), tokens=int(s.get("tokens", 0) or 0),
                              resumes=int(s.get("resumes", 0) or 0), restarts=int(s.get("restarts", 0) or 0))
            life.segments = _segments(events)
            lives[sid] = life
    ordered = sorted(lives.values(), key=lambda lf: (lf.events[0].t_ms if lf.events else 0, lf.sample_id))
    other.sort(key=lambda r: r.get("t", r.get("created", 0)) or 0)
    return ordered, other


def _lanes(intervals: list[tuple[int, int, Any]]) -> dict[int, int]:
    """Greedy interval partitioning: index of each interval -> the first lane free at its start."""
    lanes_end: list[int] = []
    out = {}
    for idx, (start, end, _) in sorted(enumerate(intervals), key=lambda x: (x[1][0], x[1][1])):
        for lane, busy_until in enumerate(lanes_end):
            if busy_until <= start:
                lanes_end[lane] = max(end, start + 1)
                out[idx] = lane
                break
        else:
            lanes_end.append(max(end, start + 1))
            out[idx] = len(lanes_end) - 1
    return out


def _flow_id(sample_id: str) -> int:
    return zlib.crc32(sample_id.encode()) & 0x7FFFFFFF


def first_event_ms(lives: list[SampleLife], other: list[dict[str, Any]]) -> int:
    """The earliest time (Redis server clock, ms since the epoch) among these lives' events and these
    other records; 0 when there is none. A run's first recorded event is the origin of its trace."""
    times = [e.t_ms for lf in lives for e in lf.events] + [int(r.get("t") or r.get("created") or 0) for r in other]
    return min([t for t in times if t] or [0])


def build_trace(lives: list[SampleLife], other: list[dict[str, Any]], t0_ms: int | None = None) -> dict[str, Any]:
    """The trace-event JSON object (``{"traceEvents": [...], "displayTimeUnit": "ms"}``) of these lives.

    ``t0_ms``: the time origin (Redis server clock, ms): ``ts`` values are microseconds since it.
    None: the earliest of these lives' events (:func:`first_event_ms`); ``asyncrl trace`` passes the
    whole run's first event, so that a selection keeps the run's times.
    """
    ev: list[dict[str, Any]] = []
    t0 = first_event_ms(lives, other) if t0_ms is None else int(t0_ms)

    def us(t_ms: int) -> int:
        return (int(t_ms) - t0) * 1000

    trainer_pid = 1
    ev.append({"ph": "M", "name": "process_name", "pid": trainer_pid, "tid": 0, "args": {"name": "trainer"}})
    ev.append({"ph": "M", "name": "process_sort_index", "pid": trainer_pid, "tid": 0, "args": {"sort_index": 0}})
    ev.append({"ph": "M", "name": "thread_name", "pid": trainer_pid, "tid": 1, "args": {"name": "train steps"}})
    # the trainer's steps: batch handed out -> acknowledged
    step_slice: dict[int, tuple[int, int]] = {}
    for r in other:
        if r.get("kind") == "batch" and r.get("created") and r.get("step") is not None:
            start, end = int(r["created"]), int(r.get("acked") or r.get("committed") or r["created"])
            step_slice[int(r["step"])] = (start, end)
            ev.append({"ph": "X", "name": f"step {r['step']}", "cat": "train", "pid": trainer_pid, "tid": 1,
                       "ts": us(start), "dur": max(1, us(end) - us(start)),
                       "args": {"step": r["step"], "version": r.get("version"), "lineage": r.get("lineage"),
                                "batch": r.get("batch"), "deliveries": r.get("deliveries")}})
        elif r.get("kind") == "publish":
            ev.append({"ph": "i", "s": "p", "name": f"publish v{r.get('version')}", "cat": "publish",
                       "pid": trainer_pid, "tid": 1, "ts": us(r["t"]),
                       "args": {"version": r.get("version"), "lineage": r.get("lineage")}})
        elif r.get("kind") == "recover":
            ev.append({"ph": "i", "s": "g", "name": f"recover to step {r.get('step')}", "cat": "recover",
                       "pid": trainer_pid, "tid": 1, "ts": us(r["t"]),
                       "args": {k: r.get(k) for k in ("step", "version", "from_version", "lineage", "replayed", "revoked")}})
    # rollout servers: one process each, lanes as threads
    by_worker: dict[str, list[tuple[SampleLife, Segment]]] = {}
    for lf in lives:
        for sg in lf.segments:
            by_worker.setdefault(sg.worker, []).append((lf, sg))
    seg_place: dict[int, tuple[int, int]] = {}
    for w_index, worker in enumerate(sorted(by_worker)):
        pid = 10 + w_index
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rollout {worker}"}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": 1 + w_index}})
        items = by_worker[worker]
        lanes = _lanes([(sg.start_ms, sg.end_ms, None) for _, sg in items])
        for lane in sorted(set(lanes.values())):
            ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane + 1, "args": {"name": f"lane {lane}"}})
        for idx, (lf, sg) in enumerate(items):
            tid = lanes[idx] + 1
            seg_place[id(sg)] = (pid, tid)
            name = lf.sample_id if sg.kind == "generate" else f"score {lf.sample_id}"
            ev.append({"ph": "X", "name": name, "cat": sg.kind, "pid": pid, "tid": tid, "ts": us(sg.start_ms),
                       "dur": max(1, us(sg.end_ms) - us(sg.start_ms)),
                       "args": {"sample": lf.sample_id, "group": lf.group_id, "end": sg.end, "reason": sg.reason,
                                "tokens": sg.tokens, "claimed_at_version": sg.version, "staleness": lf.staleness,
                                "reward": lf.reward, "trained_step": lf.step, "trained_version": lf.version,
                                "resumes": lf.resumes, "restarts": lf.restarts, "finish": lf.finish, "fate": lf.how}})
            if sg.first_tokens_ms is not None:
                ev.append({"ph": "i", "s": "t", "name": "first tokens", "cat": "generate", "pid": pid, "tid": tid,
                           "ts": us(sg.first_tokens_ms), "args": {"sample": lf.sample_id}})
    # flows: a sample's generate segments, then the train step that consumed it
    for lf in lives:
        gens = [sg for sg in lf.segments if sg.kind == "generate"]
        hops = [(seg_place[id(sg)], us(sg.start_ms), max(1, us(sg.end_ms) - us(sg.start_ms))) for sg in gens]
        if lf.step is not None and lf.step in step_slice:
            s0, s1 = step_slice[lf.step]
            hops.append(((trainer_pid, 1), us(s0), max(1, us(s1) - us(s0))))
        if len(hops) < 2:
            continue
        fid = _flow_id(lf.sample_id)
        for j, ((pid, tid), ts, dur) in enumerate(hops):
            ph = "s" if j == 0 else ("f" if j == len(hops) - 1 else "t")
            e = {"ph": ph, "name": "sample", "cat": "sample", "id": fid, "pid": pid, "tid": tid,
                 "ts": ts + min(dur - 1, dur // 2)}
            if ph == "f":
                e["bp"] = "e"  # bind to the enclosing slice (the spec's binding point), not the next one
            ev.append(e)
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"source": "asyncrl trace", "t0_unix_ms": t0, "samples": len(lives)}}


_PHASES = {"X", "i", "I", "M", "s", "t", "f", "B", "E", "C"}


def validate_trace(obj: Any) -> list[str]:
    """Problems of a trace-event JSON object against the Trace Event Format's rules (empty: valid).

    Checked: the JSON Object Format (``traceEvents`` a list; ``displayTimeUnit`` ``ms`` or ``ns``);
    every event an object with a known ``ph`` and integer ``pid``/``tid``; ``name`` a string; ``ts`` a
    number (microseconds) on every event but metadata; complete events (``X``) with ``dur`` >= 0;
    instant events' scope ``s`` in g/p/t; metadata (``M``) names among ``process_name``,
    ``process_sort_index``, ``thread_name``, ``thread_sort_index`` with their ``args``; flow events
    (``s``/``t``/``f``) with an ``id`` and ``cat``, each id starting with one ``s`` and ending with one
    ``f``; ``bp`` only ``e``; ``args`` an object; and complete events on one thread properly nested
    (Perfetto drops slices that overlap without nesting).
    """
    errs: list[str] = []
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    if obj.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        errs.append(f"displayTimeUnit {obj.get('displayTimeUnit')!r} is not ms or ns")
    flows: dict[tuple[str, Any], list[str]] = {}
    slices: dict[tuple[int, int], list[tuple[float, float]]] = {}
    meta_names = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index",
                  "thread_sort_index": "sort_index"}
    for n, e in enumerate(obj["traceEvents"]):
        where = f"event {n}"
        if not isinstance(e, dict):
            errs.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if ph not in _PHASES:
            errs.append(f"{where}: unknown ph {ph!r}")
            continue
        if not isinstance(e.get("name"), str):
            errs.append(f"{where}: name must be a string")
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            errs.append(f"{where}: pid and tid must be integers")
        if "args" in e and not isinstance(e["args"], dict):
            errs.append(f"{where}: args must be an object")
        if ph == "M":
            key = meta_names.get(e.get("name"))
            if key is None or not isinstance(e.get("args"), dict) or key not in e["args"]:
                errs.append(f"{where}: metadata event {e.get('name')!r} needs args.{key or 'name'}")
            continue
        if not isinstance(e.get("ts"), (int, float)):
            errs.append(f"{where}: ts (microseconds) must be a number")
            continue
        if ph == "X":
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                errs.append(f"{where}: complete event needs dur >= 0")
            else:
                slices.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], e["ts"] + e["dur"]))
        if ph in ("i", "I") and e.get("s", "t") not in ("g", "p", "t"):
            errs.append(f"{where}: instant scope s must be g, p or t")
        if ph in ("s", "t", "f"):
            if "id" not in e or not isinstance(e.get("cat"), str):
                errs.append(f"{where}: flow event needs id and cat")
            if "bp" in e and e["bp"] != "e":
                errs.append(f"{where}: bp must be 'e'")
            flows.setdefault((e.get("cat"), e.get("id")), []).append(ph)
    for (cat, fid), phs in flows.items():
        if phs[0] != "s" or phs[-1] != "f" or phs.count("s") != 1 or phs.count("f") != 1:
            errs.append(f"flow {cat}/{fid}: phases {''.join(phs)} must be one s, any t, one f")
    for (pid, tid), spans in slices.items():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            if stack and end > stack[-1]:
                errs.append(f"slices on pid {pid} tid {tid} overlap without nesting at ts {start}")
                break
            stack.append(end)
    return errs


def _select(lives: list[SampleLife], other: list[dict[str, Any]], sample: str | None, step: int | None,
            minutes: tuple[float, float] | None, t0_ms: int | None = None) -> tuple[list[SampleLife], list[dict[str, Any]]]:
    if sample:
        lives = [lf for lf in lives if lf.sample_id == sample or lf.group_id == sample]
        steps = {lf.step for lf in lives}
        other = [r for r in other if r.get("kind") == "batch" and r.get("step") in steps]
    if step is not None:
        lives = [lf for lf in lives if lf.step == step]
        other = [r for r in other if r.get("kind") == "batch" and r.get("step") == step]
    if minutes is not None:
        t0 = first_event_ms(lives, other) if t0_ms is None else t0_ms
        lo, hi = t0 + minutes[0] * 60000, t0 + minutes[1] * 60000
        lives = [lf for lf in lives if lf.events and lf.events[0].t_ms <= hi and lf.events[-1].t_ms >= lo]
        for lf in lives:
            lf.segments = [sg for sg in lf.segments if sg.end_ms >= lo and sg.start_ms <= hi]
        other = [r for r in other if lo <= int(r.get("t") or r.get("created") or 0) <= hi]
    return lives, other


def plot_timeline(lives: list[SampleLife], other: list[dict[str, Any]], path: str | Path, t0_ms: int | None = None,
                  window_s: tuple[float, float] | None = None) -> None:
    """Draw the timeline with matplotlib: one row per server lane and the trainer, segments as bars
    coloured by the policy version they were claimed under, train steps as bars on the trainer row.

    ``t0_ms``: the time origin, as :func:`build_trace`'s; ``window_s``: (start, end) seconds since it to
    show (``--minutes``), bars that extend beyond it are cut at its edges; None shows everything."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = build_trace(lives, other, t0_ms)
    names = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "process_name":
            names[(e["pid"], None)] = e["args"]["name"]
    rows: dict[tuple[int, int], int] = {}
    bars = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for e in sorted(bars, key=lambda e: (e["pid"], e["tid"])):
        rows.setdefault((e["pid"], e["tid"]), len(rows))
    versions = [e["args"].get("claimed_at_version", e["args"].get("version")) for e in bars]
    vmax = max([v for v in versions if isinstance(v, int) and v >= 0] or [1])
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(12, 1.5 + 0.35 * max(1, len(rows))))
    for e, v in zip(bars, versions):
        colour = cmap((v if isinstance(v, int) and v >= 0 else 0) / max(1, vmax))
        if e.get("cat") == "score":
            colour = "lightgrey"
        ax.barh(rows[(e["pid"], e["tid"])], e["dur"] / 1e6, left=e["ts"] / 1e6, height=0.8, color=colour,
                edgecolor="black", linewidth=0.3)
    labels = [f"{names.get((pid, None), pid)} / {'steps' if pid == 1 else f'lane {tid - 1}'}" for (pid, tid) in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run's first recorded event (Redis server clock)"
                  if t0_ms is not None else "seconds since the first recorded event (Redis server clock)")
    if window_s is not None:
        ax.set_xlim(*window_s)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, vmax))
    fig.colorbar(sm, ax=ax, label="policy version at claim")
    span = "" if window_s is None else f", alive in minutes {window_s[0] / 60:g}-{window_s[1] / 60:g}"
    ax.set_title(f"sample timeline: {len(lives)} samples{span}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_setting(run_dir: Path) -> bool | None:
    """``buffer.timeline`` of the run in ``run_dir`` as its ``config.yaml`` says (written by ``asyncrl train``
    for its last session; else the newest checkpoint's, ``checkpoints/step*/config.yaml``, as a trainer
    started on its own writes it); None when there is no such file or field (runs made before the switch
    recorded their timeline)."""
    import yaml

    run_dir = Path(run_dir)
    found = [run_dir / "config.yaml"] if (run_dir / "config.yaml").is_file() else \
        sorted(run_dir.glob("checkpoints/step*/config.yaml"))[-1:]
    try:
        cfg = yaml.safe_load(found[0].read_text()) if found else None
    except (OSError, yaml.YAMLError):
        return None
    value = (cfg.get("buffer") or {}).get("timeline") if isinstance(cfg, dict) else None
    return value if isinstance(value, bool) else None


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl trace``; returns the exit code (2: bad arguments, or no timeline to show,
    with the reason: the run recorded none because ``buffer.timeline`` was false, or nothing was exported yet)."""
    parser = argparse.ArgumentParser(prog="asyncrl trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="run directory (holds trace/timeline-*.jsonl)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--sample", default=None, help="one sample (gid/i) or every sample of a group (gid)")
    which.add_argument("--step", type=int, default=None, help="the samples trained at this step")
    which.add_argument("--minutes", default=None, help="A-B: minutes since the run's first recorded event")
    parser.add_argument("--out", type=Path, default=None, help="output file (default RUN_DIR/trace/trace.json)")
    parser.add_argument("--png", action="store_true", help="also draw the timeline to <out>.png with matplotlib")
    args = parser.parse_args(argv)
    minutes = None
    if args.minutes:
        try:
            a, b = (float(x) for x in args.minutes.split("-", 1))
        except ValueError:
            print(f"asyncrl trace: --minutes must be A-B, got {args.minutes!r}", file=sys.stderr)
            return 2
        minutes = (a, b)
    records = read_records(args.run_dir / "trace")
    recorded = timeline_setting(args.run_dir)
    if not records and recorded is False:
        print(f"asyncrl trace: the run in {args.run_dir} recorded no timeline: its config.yaml has buffer.timeline "
              "false, so no transition was recorded and no trace file written; run with --buffer.timeline true "
              "to record one (docs/buffer.md#timeline)", file=sys.stderr)
        return 2
    if recorded is False:
        print("asyncrl trace: note: the last session ran with buffer.timeline false; the trace shows only what the "
              "sessions that recorded exported", file=sys.stderr)
    if not records:
        print(f"asyncrl trace: no timeline records under {args.run_dir / 'trace'} (they are exported after each "
              "commit, i.e. each checkpoint)", file=sys.stderr)
        return 2
    all_lives, all_other = load_lives(records)
    t0 = first_event_ms(all_lives, all_other)  # the run's origin, whatever is selected
    lives, other = _select(all_lives, all_other, args.sample, args.step, minutes, t0)
    trace = build_trace(lives, other, t0)
    out = args.out or args.run_dir / "trace" / "trace.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace))
    print(f"asyncrl trace: {len(lives)} samples, {len(trace['traceEvents'])} events -> {out} "
          "(open in https://ui.perfetto.dev)", file=sys.stderr)
    if args.png:
        png = out.with_suffix(".png")
        plot_timeline(lives, other, png, t0, None if minutes is None else (60.0 * minutes[0], 60.0 * minutes[1]))
        print(f"asyncrl trace: wrote {png}", file=sys.stderr)
    return 0
