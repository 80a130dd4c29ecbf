"""``asyncrl report RUN_DIR [--compare RUN_B]``: curves (PNG) and a markdown summary of a run.

Reads the run's ``metrics-*.jsonl`` (every role, see :mod:`asyncrl.metrics.tracking`) and its resolved
``config.yaml``, and writes into the run directory (or ``--out``):

* ``report.png`` — up to nine panels over training wall time (minutes; held-out evaluation
  pauses excluded), each drawn only when the run logged its metrics (:data:`PANELS`): train
  reward, held-out accuracy (sampled at T = 1 with its 95% interval, and greedy), rollout
  tokens/s, staleness (max and mean, with the ``max_staleness`` bound), partial ratio, each
  role's idle ratio, each role's CPU share (``cpu_share/<role>``: its CPU seconds per wall
  second over all the run's cores, from :mod:`asyncrl.controller.cpu_share`), and, for PPO
  with a critic, the value loss and the critic's explained variance, and for agent episodes
  (docs/agents.md) the turns and tool calls per episode (train and held-out);
* ``report.md`` — steps, wall time, final and best held-out accuracy, tokens/s, max staleness,
  the trained tokens' mean age, partial ratio, idle ratios, CPU shares, the critic's value loss
  (first and last step) and explained variance, drops and restarts; and, when a trainer-bound
  run's staleness bound above 1 aged its samples, a note that says so (:func:`pace_note`).

With ``--compare RUN_B`` both runs are overlaid (the sync-vs-async comparison of
``docs/results.md``) and the summary adds the wall time each run needs to reach the best
held-out accuracy that RUN_B reaches, and their ratio.

When a metric is logged by several roles (``rollout/tokens_per_second`` by each rollout
server) the controller's aggregate is used if it logged one, else the latest values of the
roles are summed (tokens/s) at each record. Simplified: no smoothing beyond a moving average of
the reward curve.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.metrics.tracking import TrackingError, read_metrics

__all__ = ["Run", "Panel", "PANELS", "TRAINER_BOUND_IDLE", "load_run", "series", "summarize", "time_to_reach",
           "token_ages", "pace_note", "panels_with_data", "plot_runs", "write_markdown", "main"]


@dataclass
class Run:
    """A run directory's metrics and config.

    Attributes:
        run_dir: the directory.
        name: label in plots (the directory's name).
        records: every metrics record, sorted by ``wall_seconds``.
        config: the resolved config as a dict (empty if ``config.yaml`` is missing).
    """

    run_dir: Path
    name: str
    records: list[dict[str, Any]]
    config: dict[str, Any]


def load_run(run_dir: Path | str) -> Run:
    """Read a run directory.

    Raises:
        TrackingError: the directory has no metrics files or a corrupt one.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise TrackingError(f"{run_dir} is not a directory (give the run directory, e.g. runs/asyncrl)")
    records = read_metrics(run_dir)
    config: dict[str, Any] = {}
    cfg_path = run_dir / "config.yaml"
    if cfg_path.exists():
        import yaml

        config = yaml.safe_load(cfg_path.read_text()) or {}
    return Run(run_dir=run_dir, name=run_dir.resolve().name, records=records, config=config)


def series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """``(wall_seconds, values)`` of one metric over the run.

    With several roles logging ``key``: the controller's records if it logged any, else at
    each record the sum of every role's latest value (additive rates such as tokens/s).
    """
    having = [r for r in records if r.get(key) is not None]
    roles = {r.get("role") for r in having}
    if len(roles) > 1 and "controller" in roles:
        having = [r for r in having if r.get("role") == "controller"]
        roles = {"controller"}
    xs: list[float] = []
    ys: list[float] = []
    if len(roles) <= 1:
        for r in having:
            xs.append(float(r["wall_seconds"]))
            ys.append(float(r[key]))
        return xs, ys
    latest: dict[str, float] = {}
    for r in having:
        latest[r.get("role")] = float(r[key])
        xs.append(float(r["wall_seconds"]))
        ys.append(sum(latest.values()))
    return xs, ys


def _last(records: list[dict[str, Any]], key: str) -> float | None:
    _, ys = series(records, key)
    return ys[-1] if ys else None


def _first(records: list[dict[str, Any]], key: str) -> float | None:
    _, ys = series(records, key)
    return ys[0] if ys else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def time_to_reach(run: Run, accuracy: float, key: str = "eval/accuracy_sampled") -> float | None:
    """Training wall seconds at the first held-out evaluation with ``key >= accuracy`` (None: never)."""
    for x, y in zip(*series(run.records, key)):
        if y >= accuracy - 1e-12:
            return x
    return None


def _idle_keys(records: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in records for k in r if k.startswith("idle_ratio/")})


def _cpu_keys(records: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in records for k in r if k.startswith("cpu_share/")})


def token_ages(records: list[dict[str, Any]]) -> dict[int, float]:
    """Response tokens trained per age over the run: ``{age in policy versions: tokens}``.

    Sums the trainer's per-step histograms ``staleness/tokens_<k>`` (``trainer/batch.py``; the
    ``8plus`` bin counts as 8). A step logged twice (replayed after a trainer restart from a
    checkpoint) counts once, with its last record. Empty when the run logged no histogram.
    """
    per_step: dict[int, dict[int, float]] = {}
    for r in records:
        hist = {(8 if k.endswith("8plus") else int(k.rsplit("_", 1)[1])): float(v)
                for k, v in r.items() if k.startswith("staleness/tokens_")}
        if hist:
            per_step[int(r.get("step", 0))] = hist
    ages: dict[int, float] = {}
    for hist in per_step.values():
        for age, n in hist.items():
            ages[age] = ages.get(age, 0.0) + n
    return ages


#: A trainer that waited for its batch less than this share of its wall time set the run's pace
#: (see :func:`pace_note`).
TRAINER_BOUND_IDLE = 0.15


def pace_note(s: dict[str, Any]) -> str | None:
    """A sentence for ``report.md`` when a staleness bound above 1 aged the samples of a trainer-bound run.

    The condition: the trainer's mean idle ratio (its ``wait_batch`` share) is below
    :data:`TRAINER_BOUND_IDLE`, the bound ``buffer.max_staleness`` is ≥ 2, and the trained tokens'
    mean age is above 1 version, which a bound of 1 would not allow. When the trainer hardly
    waits, it sets the pace; a larger bound cannot give it more batches, only older ones (AReaL's
    admission, eq. 3, caps the rollout's lead at η + 1 batches). docs/results.md section P saw the
    older samples go with less learning per step over three runs of the long-tail task: a pointer,
    not a rule, and the note says so.

    Args:
        s: a :func:`summarize` result.

    Returns:
        The sentence, or None when the condition does not hold or a metric is missing.
    """
    bound, idle, age = s.get("max_staleness_bound"), s["idle_ratios"].get("trainer"), s.get("token_age_mean")
    if bound is None or idle is None or age is None or bound < 2 or idle >= TRAINER_BOUND_IDLE or age <= 1.0:
        return None
    at_bound = s.get("token_age_at_bound_share")
    share = f", {at_bound:.0%} of them at the bound" if at_bound is not None else ""
    return (f"Pace: the trainer waited for a batch {idle:.0%} of its time, so it set this run's pace. "
            f"A staleness bound of {bound} cannot give such a trainer more batches, only older ones: "
            f"its trained tokens were {age:.2f} policy versions old on the mean{share}, where a bound of 1 "
            f"keeps them at 1 or less (`--max_staleness 1`). Over three runs of the long-tail task older "
            f"samples went with less learning per step (docs/results.md section P): a pointer, not a rule.")


#: The trainer's step phases (``time/<phase>_seconds`` in the step records).
_PHASES = ("wait_batch", "forward_backward", "optim_step", "publish_weights", "checkpoint")


def summarize(run: Run) -> dict[str, Any]:
    """Headline numbers of a run (None where the run did not log the metric)."""
    recs = run.records
    steps = max((int(r["step"]) for r in recs), default=0)
    wall = max((float(r["wall_seconds"]) for r in recs), default=0.0)
    acc_x, acc = series(recs, "eval/accuracy_sampled")
    best_i = max(range(len(acc)), key=lambda i: acc[i]) if acc else None
    _, tps = series(recs, "rollout/tokens_per_second")
    _, stale = series(recs, "staleness/max")
    _, partial = series(recs, "buffer/partial_ratio")

    def at(key: str, x: float | None) -> float | None:
        if x is None:
            return None
        for xx, yy in zip(*series(recs, key)):
            if xx == x:
                return yy
        return None

    final_x = acc_x[-1] if acc else None
    ages = token_ages(recs)
    trained = sum(ages.values())
    bound = (run.config.get("buffer") or {}).get("max_staleness")
    return {
        "name": run.name,
        "steps": steps,
        "wall_seconds": wall,
        "eval_seconds": _last(recs, "time/eval_seconds"),
        "accuracy_first": acc[0] if acc else None,
        "accuracy_final": acc[-1] if acc else None,
        "accuracy_final_ci95": (at("eval/ci95_low", final_x), at("eval/ci95_high", final_x)),
        "accuracy_best": acc[best_i] if best_i is not None else None,
        "accuracy_best_wall_seconds": acc_x[best_i] if best_i is not None else None,
        "accuracy_greedy_final": _last(recs, "eval/accuracy_greedy"),
        "eval_num_problems": _last(recs, "eval/num_problems"),
        "reward_final": _last(recs, "reward/mean"),
        "tokens_per_second_mean": _mean(tps),
        "staleness_max": max(stale) if stale else None,
        "max_staleness_bound": bound,
        "token_age_mean": sum(a * n for a, n in ages.items()) / trained if trained else None,
        "token_age_at_bound_share": (sum(n for a, n in ages.items() if a >= bound) / trained
                                     if trained and bound is not None else None),
        "partial_ratio_mean": _mean(partial),
        "idle_ratios": {k.split("/", 1)[1]: _mean(series(recs, k)[1]) for k in _idle_keys(recs)},
        "cpu_shares": {k.split("/", 1)[1]: _mean(series(recs, k)[1]) for k in _cpu_keys(recs)},
        "seconds_per_step": (wall / steps) if steps else None,
        # medians: a step that an evaluation paused (SIGSTOP) counts the pause in its phase
        "phase_seconds": {ph: statistics.median(series(recs, f"time/{ph}_seconds")[1]) for ph in _PHASES
                          if series(recs, f"time/{ph}_seconds")[1]},
        "value_loss_first": _first(recs, "train/value_loss"),
        "value_loss_final": _last(recs, "train/value_loss"),
        "explained_variance_final": _last(recs, "train/explained_variance"),
        "episode_turns_first": _first(recs, "train/episode_turns_mean"),
        "episode_turns_final": _last(recs, "train/episode_turns_mean"),
        "episode_tool_calls_first": _first(recs, "train/episode_tool_calls_mean"),
        "episode_tool_calls_final": _last(recs, "train/episode_tool_calls_mean"),
        "drops": _last(recs, "buffer/drops"),
        "restarts": _last(recs, "buffer/restarts"),
        "appended_tokens": _last(recs, "buffer/appended_tokens"),
        "restart_discarded_tokens": _last(recs, "buffer/restart_discarded_tokens"),
        "role_restarts": _last(recs, "supervisor/restarts"),
    }


def _fmt(v: Any, spec: str = ".3g", unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:{spec}}{unit}"
    return f"{v}{unit}"


def _discarded_cell(s: dict[str, Any]) -> str:
    """``"<appended> / <discarded> (<share>)"``: the model tokens appended to the buffer and those restarts threw away."""
    app, lost = s.get("appended_tokens"), s.get("restart_discarded_tokens")
    if not app:
        return "—"
    if lost is None:
        return f"{int(app):,} / —"
    return f"{int(app):,} / {int(lost):,} ({lost / app:.1%})"


def _knobs(run: Run) -> str:
    r, b = run.config.get("rollout") or {}, run.config.get("buffer") or {}
    if not r:
        return "—"
    return (f"p={r.get('partial_percent')}, M={r.get('max_budget')}, η={b.get('max_staleness')}, "
            f"R={r.get('rollout_batch_size')}, n={r.get('n_samples_per_prompt')}, "
            f"max_response_len={r.get('max_response_len')}")


def write_markdown(runs: list[Run], path: Path, png_name: str = "report.png") -> str:
    """Write the summary table (one column per run) to ``path``; returns the text."""
    sums = [summarize(r) for r in runs]
    rows: list[tuple[str, list[str]]] = [
        ("knobs", [_knobs(r) for r in runs]),
        ("train steps", [_fmt(s["steps"]) for s in sums]),
        ("training wall time (eval excluded)", [_fmt(s["wall_seconds"] / 60, ".1f", " min") for s in sums]),
        ("held-out eval time (separate)", [_fmt(None if s["eval_seconds"] is None else s["eval_seconds"] / 60, ".1f", " min") for s in sums]),
        ("held-out accuracy, first eval (sampled T=1)", [_fmt(s["accuracy_first"]) for s in sums]),
        ("held-out accuracy, final (sampled T=1) [95% CI]", [
            _fmt(s["accuracy_final"]) + (f" [{_fmt(s['accuracy_final_ci95'][0])}, {_fmt(s['accuracy_final_ci95'][1])}]"
                                         if s["accuracy_final_ci95"][0] is not None else "") for s in sums]),
        ("held-out accuracy, best (at min)", [
            f"{_fmt(s['accuracy_best'])} (at {_fmt(None if s['accuracy_best_wall_seconds'] is None else s['accuracy_best_wall_seconds'] / 60, '.1f')})"
            for s in sums]),
        ("held-out accuracy, final greedy", [_fmt(s["accuracy_greedy_final"]) for s in sums]),
        ("held-out problems per eval", [_fmt(s["eval_num_problems"]) for s in sums]),
        ("train reward, last batch", [_fmt(s["reward_final"]) for s in sums]),
        ("training wall seconds per step (mean)", [_fmt(s["seconds_per_step"], ".1f") for s in sums]),
        ("trainer phases, median seconds (steps where the phase ran)", [
            ", ".join(f"{k} {_fmt(v, '.1f')}" for k, v in s["phase_seconds"].items()) or "—" for s in sums]),
        ("rollout tokens/s (mean)", [_fmt(s["tokens_per_second_mean"], ".1f") for s in sums]),
        ("max staleness seen / bound", [f"{_fmt(s['staleness_max'])} / {_fmt(s['max_staleness_bound'])}" for s in sums]),
        ("trained tokens' age, mean (share at the bound)", [
            _fmt(s["token_age_mean"], ".2f") + (f" ({s['token_age_at_bound_share']:.0%})"
                                                 if s["token_age_at_bound_share"] is not None else "") for s in sums]),
        ("partial ratio (mean)", [_fmt(s["partial_ratio_mean"], ".2f") for s in sums]),
        ("idle ratio (mean) by role", [
            ", ".join(f"{k} {_fmt(v, '.2f')}" for k, v in s["idle_ratios"].items()) or "—" for s in sums]),
        ("CPU share of the run's cores (mean) by role", [
            ", ".join(f"{k} {_fmt(v, '.2f')}" for k, v in s["cpu_shares"].items()) or "—" for s in sums]),
        ("critic value loss, first / last step", [
            f"{_fmt(s['value_loss_first'])} / {_fmt(s['value_loss_final'])}" for s in sums]),
        ("critic explained variance, last step", [_fmt(s["explained_variance_final"], ".2f") for s in sums]),
        ("episode turns, first / last step", [
            f"{_fmt(s['episode_turns_first'])} / {_fmt(s['episode_turns_final'])}" for s in sums]),
        ("episode tool calls, first / last step", [
            f"{_fmt(s['episode_tool_calls_first'])} / {_fmt(s['episode_tool_calls_final'])}" for s in sums]),
        ("drops / sample restarts (buffer)", [f"{_fmt(s['drops'])} / {_fmt(s['restarts'])}" for s in sums]),
        ("tokens generated / discarded by restarts", [_discarded_cell(s) for s in sums]),
        ("role restarts (supervisor)", [_fmt(s["role_restarts"]) for s in sums]),
    ]
    header = "| | " + " | ".join(s["name"] for s in sums) + " |"
    lines = [f"# asyncrl run report: {' vs '.join(s['name'] for s in sums)}", "", f"![curves]({png_name})", "",
             header, "|---|" + "---|" * len(sums)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    notes = [(s["name"], pace_note(s)) for s in sums]
    lines += [f"\n{name}: {note}" if len(sums) > 1 else f"\n{note}" for name, note in notes if note]
    if len(runs) == 2 and sums[1]["accuracy_best"] is not None:
        target = sums[1]["accuracy_best"]
        ta, tb = time_to_reach(runs[0], target), time_to_reach(runs[1], target)
        when = lambda t: "never" if t is None else f"{t / 60:.1f} min"  # noqa: E731
        line = (f"Wall time to reach {runs[1].name}'s best held-out accuracy ({target:.3f}): "
                f"{runs[0].name} {when(ta)}, {runs[1].name} {when(tb)}")
        if ta and tb:
            ratio = tb / ta
            line += (f"; {runs[0].name} gets there {ratio:.2f}× sooner" if ratio >= 1 else
                     f"; {runs[0].name} takes {ta / tb:.2f}× as long (speed-up {ratio:.2f}×)")
        lines += ["", line + "."]
    text = "\n".join(lines) + "\n"
    Path(path).write_text(text)
    return text


def _moving_average(ys: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


@dataclass(frozen=True)
class Panel:
    """One panel of ``report.png``: drawn when some run logged one of its metrics.

    Attributes:
        name: short name (what :func:`plot_runs` returns).
        title, ylabel: the panel's title and y-axis label.
        keys: metrics that give it data.
        prefixes: metric-name prefixes that give it data (``idle_ratio/`` for every role).
    """

    name: str
    title: str
    ylabel: str
    keys: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()

    def has_data(self, run: Run) -> bool:
        """True when ``run`` logged a value of one of :attr:`keys` or of a metric under :attr:`prefixes`."""
        return any(v is not None and (k in self.keys or any(k.startswith(p) for p in self.prefixes))
                   for r in run.records for k, v in r.items())


#: Every panel, in drawing order (three per row).
PANELS = (
    Panel("reward", "train reward (mean; line: moving average of 10)", "reward", ("reward/mean",)),
    Panel("accuracy", "held-out accuracy (95% interval shaded)", "accuracy",
          ("eval/accuracy_sampled", "eval/accuracy_greedy")),
    Panel("throughput", "rollout throughput", "tokens / s", ("rollout/tokens_per_second",)),
    Panel("staleness", "staleness of train batches", "policy versions", ("staleness/max", "staleness/mean")),
    Panel("partial", "partial ratio (partial samples / samples in flight)", "ratio", ("buffer/partial_ratio",)),
    Panel("idle", "idle ratio by role", "ratio", prefixes=("idle_ratio/",)),
    Panel("cpu", "CPU share by role (of all the run's cores)", "share", prefixes=("cpu_share/",)),
    Panel("critic", "critic (PPO with GAE): value loss, explained variance (dashed)", "value loss",
          ("train/value_loss", "train/explained_variance")),
    Panel("episodes", "agent episodes: turns and tool calls per episode (train: moving average of 10)", "per episode",
          ("train/episode_turns_mean", "train/episode_tool_calls_mean", "eval/turns_mean", "eval/tool_calls_mean")),
)


def panels_with_data(runs: list[Run]) -> list[Panel]:
    """The panels of :data:`PANELS` that at least one of ``runs`` has data for, in drawing order."""
    return [p for p in PANELS if any(p.has_data(run) for run in runs)]


def plot_runs(runs: list[Run], path: Path) -> list[str]:
    """Draw the panels the runs have data for (:func:`panels_with_data`; a GRPO run has no critic
    panel, a single-turn run no episode panel) for one or two runs into ``path`` (PNG, matplotlib
    Agg), three per row.

    Returns:
        the names of the panels drawn, in order (``["reward", "accuracy", ...]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panels_with_data(runs)
    ncols = min(3, max(1, len(panels)))
    nrows = max(1, math.ceil(len(panels) / 3))
    fig, grid = plt.subplots(nrows, ncols, figsize=(6 * ncols, 12.5 / 3 * nrows + 0.4), constrained_layout=True,
                             squeeze=False)
    flat = list(grid.flat)
    ax_of = {p.name: ax for p, ax in zip(panels, flat)}
    for ax in flat[len(panels):]:
        ax.axis("off")
    if not panels:
        flat[0].text(0.5, 0.5, "no curves logged", transform=flat[0].transAxes, ha="center", va="center", color="gray")
    colors = ["tab:blue", "tab:orange"]
    ax_reward, ax_acc, ax_tps, ax_stale, ax_partial, ax_idle, ax_cpu, ax_critic, ax_episodes = (
        ax_of.get(p.name) for p in PANELS)
    ax_ev = ax_critic.twinx() if ax_critic is not None else None
    for run, color in zip(runs, colors):
        recs, label = run.records, run.name
        m = lambda xs: [x / 60 for x in xs]  # noqa: E731 - minutes
        xs, ys = series(recs, "reward/mean")
        if xs and ax_reward is not None:
            ax_reward.plot(m(xs), ys, color=color, alpha=0.25, lw=0.8)
            ax_reward.plot(m(xs), _moving_average(ys, 10), color=color, label=label)
        if ax_acc is not None:
            xs, ys = series(recs, "eval/accuracy_sampled")
            if xs:
                lo = series(recs, "eval/ci95_low")[1]
                hi = series(recs, "eval/ci95_high")[1]
                ax_acc.plot(m(xs), ys, "o-", color=color, label=f"{label} sampled T=1")
                if len(lo) == len(xs) == len(hi):
                    ax_acc.fill_between(m(xs), lo, hi, color=color, alpha=0.15)
            xs, ys = series(recs, "eval/accuracy_greedy")
            if xs:
                ax_acc.plot(m(xs), ys, "s--", color=color, alpha=0.6, label=f"{label} greedy")
        xs, ys = series(recs, "rollout/tokens_per_second")
        if xs and ax_tps is not None:
            ax_tps.plot(m(xs), ys, color=color, label=label)
        if ax_stale is not None:
            xs, ys = series(recs, "staleness/max")
            if xs:
                ax_stale.step(m(xs), ys, where="post", color=color, label=f"{label} max")
            xs, ys = series(recs, "staleness/mean")
            if xs:
                ax_stale.plot(m(xs), ys, color=color, alpha=0.5, ls=":", label=f"{label} mean")
            bound = (run.config.get("buffer") or {}).get("max_staleness")
            if bound is not None:
                ax_stale.axhline(bound, color=color, ls="--", lw=0.8, label=f"{label} bound η={bound}")
        xs, ys = series(recs, "buffer/partial_ratio")
        if xs and ax_partial is not None:
            ax_partial.plot(m(xs), ys, color=color, label=label)
        if ax_idle is not None:
            for key, ls in zip(_idle_keys(recs), ["-", "--", ":", "-."] * 8):
                xs, ys = series(recs, key)
                ax_idle.plot(m(xs), ys, color=color, ls=ls, label=f"{label} {key.split('/', 1)[1]}")
        if ax_cpu is not None:
            for key, ls in zip(_cpu_keys(recs), ["-", "--", ":", "-."] * 8):
                xs, ys = series(recs, key)
                ax_cpu.plot(m(xs), ys, color=color, ls=ls, label=f"{label} {key.split('/', 1)[1]}")
        if ax_critic is not None:
            xs, ys = series(recs, "train/value_loss")
            if xs:
                ax_critic.plot(m(xs), ys, color=color, alpha=0.25, lw=0.8)
                ax_critic.plot(m(xs), _moving_average(ys, 10), color=color, label=f"{label} value loss")
            xs, ys = series(recs, "train/explained_variance")
            if xs:
                ax_ev.plot(m(xs), _moving_average(ys, 10), color=color, ls="--", label=f"{label} explained variance")
        if ax_episodes is not None:
            for key, ls, what in (("train/episode_turns_mean", "-", "turns"),
                                  ("train/episode_tool_calls_mean", "--", "tool calls")):
                xs, ys = series(recs, key)
                if xs:
                    ax_episodes.plot(m(xs), _moving_average(ys, 10), color=color, ls=ls, label=f"{label} {what} (train)")
            for key, mk, what in (("eval/turns_mean", "o", "turns"), ("eval/tool_calls_mean", "s", "tool calls")):
                xs, ys = series(recs, key)
                if xs:
                    ax_episodes.plot(m(xs), ys, mk, color=color, alpha=0.7, label=f"{label} {what} (held-out)")
    for panel in panels:
        ax = ax_of[panel.name]
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("training wall time (min, eval excluded)")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in (ax_acc, ax_partial, ax_idle, ax_cpu):
        if ax is not None:
            ax.set_ylim(-0.02, 1.02)
    if ax_ev is not None:
        ax_ev.set_ylabel("explained variance (moving average of 10)")
        ax_ev.set_ylim(-1.05, 1.05)
        if ax_ev.get_legend_handles_labels()[0]:
            ax_ev.legend(fontsize=7, loc="lower right")
    fig.suptitle("asyncrl: " + " vs ".join(r.name for r in runs))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [p.name for p in panels]


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl report``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="asyncrl report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="run directory (holds metrics-*.jsonl)")
    parser.add_argument("--compare", type=Path, default=None, help="second run directory to overlay (e.g. the synchronous baseline)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: RUN_DIR)")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(args.run_dir)] + ([load_run(args.compare)] if args.compare else [])
    except TrackingError as exc:
        print(f"asyncrl report: {exc}", file=sys.stderr)
        return 2
    if len(runs) == 2 and runs[0].name == runs[1].name:
        runs[1].name = f"{runs[1].name} ({args.compare})"
    out = args.out or args.run_dir
    out.mkdir(parents=True, exist_ok=True)
    stem = "report" if args.compare is None else "report-compare"
    png, md = out / f"{stem}.png", out / f"{stem}.md"
    plot_runs(runs, png)
    text = write_markdown(runs, md, png_name=png.name)
    print(text, end="")
    print(f"asyncrl report: wrote {png} and {md}", file=sys.stderr)
    return 0
