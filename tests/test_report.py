"""``asyncrl report`` on synthetic runs written with the real MetricsLogger."""

from __future__ import annotations

import math
import struct
import subprocess
import sys

import pytest

from asyncrl.core.config import dump_config, load_config
from asyncrl.metrics.report import load_run, main, panels_with_data, plot_runs, series, summarize, time_to_reach
from asyncrl.metrics.tracking import MetricsLogger


def make_run(run_dir, speed: float = 1.0, staleness: int = 2, partial: float = 1.0, critic: bool = False,
             episodes: bool = False, trainer_idle: float = 0.3, ages: dict[str, float] | None = None):
    """A 40-step run: accuracy rises 0.1 -> 0.5 over 40 steps taking 30 s / speed each.

    ``ages``: the trainer's per-step token-age histogram (``{"tokens_1": n, ...}``), logged every step."""
    cfg = load_config(["--max_staleness", str(staleness), "--partial_percent", str(partial),
                       "--max_budget", "32", "--max_response_len", "64"])
    dump_config(cfg, run_dir / "config.yaml")
    trainer = MetricsLogger(run_dir, role="trainer")
    rollouts = [MetricsLogger(run_dir, role=f"rollout-{i}") for i in range(2)]
    controller = MetricsLogger(run_dir, role="controller")
    for step in range(1, 41):
        wall = step * 30.0 / speed
        trainer.log(step, {"reward/mean": 0.1 + 0.01 * step, "staleness/max": min(staleness, step % 3),
                           "staleness/mean": 0.5, "idle_ratio/trainer": trainer_idle,
                           **{f"staleness/{k}": v for k, v in (ages or {}).items()},
                           "time/forward_backward_seconds": 10.0,
                           **({"train/value_loss": 1.0 / step, "train/explained_variance": 1 - 1.0 / step}
                              if critic else {}),
                           **({"train/episode_turns_mean": 3.0 - step / 20, "train/episode_tool_calls_mean": step / 40}
                              if episodes else {})}, wall_seconds=wall)
        for i, r in enumerate(rollouts):
            r.log(step, {"rollout/tokens_per_second": 100.0 + i, "idle_ratio/rollout-" + str(i): 0.1},
                  wall_seconds=wall + 1)
        if step % 10 == 0 or step == 1:
            acc = 0.1 + 0.01 * step
            half = 1.96 * math.sqrt(acc * (1 - acc) / 400)
            controller.log(step, {"eval/accuracy_sampled": acc, "eval/accuracy_greedy": acc + 0.05,
                                  "eval/ci95_low": acc - half, "eval/ci95_high": acc + half,
                                  "eval/num_problems": 400, "time/eval_seconds": 20.0 * step},
                           wall_seconds=wall + 2)
        controller.log(step, {"buffer/partial_ratio": 0.25, "buffer/drops": 1, "buffer/restarts": 3,
                              "buffer/appended_tokens": 1000 * step, "buffer/restart_discarded_tokens": 50 * step,
                              "supervisor/restarts": 0, "cpu_share/trainer": 0.2 + 0.02 * (step % 2),
                              "cpu_share/rollout-0": 0.4}, wall_seconds=wall + 2)
    for lg in (trainer, *rollouts, controller):
        lg.close()
    return run_dir


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_series_sums_roles_and_prefers_controller():
    recs = [
        {"step": 1, "wall_seconds": 1, "role": "rollout-0", "rollout/tokens_per_second": 10.0},
        {"step": 1, "wall_seconds": 2, "role": "rollout-1", "rollout/tokens_per_second": 5.0},
        {"step": 2, "wall_seconds": 3, "role": "rollout-0", "rollout/tokens_per_second": 12.0},
    ]
    assert series(recs, "rollout/tokens_per_second") == ([1.0, 2.0, 3.0], [10.0, 15.0, 17.0])
    recs.append({"step": 2, "wall_seconds": 4, "role": "controller", "rollout/tokens_per_second": 30.0})
    assert series(recs, "rollout/tokens_per_second") == ([4.0], [30.0])
    assert series(recs, "missing/metric") == ([], [])


def test_summary_numbers(tmp_path):
    run = load_run(make_run(tmp_path / "async"))
    s = summarize(run)
    assert s["steps"] == 40 and s["wall_seconds"] == pytest.approx(40 * 30 + 2)
    assert s["accuracy_first"] == pytest.approx(0.11) and s["accuracy_final"] == pytest.approx(0.5)
    assert s["accuracy_best"] == pytest.approx(0.5) and s["accuracy_best_wall_seconds"] == pytest.approx(1202)
    assert s["tokens_per_second_mean"] == pytest.approx(200.5, rel=0.01)
    assert s["staleness_max"] == 2 and s["max_staleness_bound"] == 2
    assert s["partial_ratio_mean"] == pytest.approx(0.25)
    assert s["idle_ratios"] == {"trainer": pytest.approx(0.3), "rollout-0": pytest.approx(0.1),
                                "rollout-1": pytest.approx(0.1)}
    assert s["cpu_shares"] == {"trainer": pytest.approx(0.21), "rollout-0": pytest.approx(0.4)}
    assert s["drops"] == 1 and s["restarts"] == 3 and s["eval_seconds"] == 800
    assert s["seconds_per_step"] == pytest.approx((40 * 30 + 2) / 40)
    assert s["phase_seconds"] == {"forward_backward": pytest.approx(10.0)}  # phases never logged are left out
    assert time_to_reach(run, 0.3) == pytest.approx(20 * 30 + 2)
    assert time_to_reach(run, 0.9) is None


def test_cli_writes_png_and_markdown(tmp_path):
    run_dir = make_run(tmp_path / "async")
    assert main([str(run_dir)]) == 0
    md = (run_dir / "report.md").read_text()
    assert "![curves](report.png)" in md
    assert "| train steps | 40 |" in md
    assert "| max staleness seen / bound | 2 / 2 |" in md
    assert "| tokens generated / discarded by restarts | 40,000 / 2,000 (5.0%) |" in md
    assert "| CPU share of the run's cores (mean) by role | rollout-0 0.40, trainer 0.21 |" in md
    assert "0.5 [0.451, 0.549]" in md
    assert "trainer 0.30" in md and "rollout-0 0.10" in md
    w, h = _png_size(run_dir / "report.png")
    assert w > 1000 and h > 600


def test_critic_panel_and_rows(tmp_path):
    run_dir = make_run(tmp_path / "ppo", critic=True)
    s = summarize(load_run(run_dir))
    assert s["value_loss_first"] == pytest.approx(1.0) and s["value_loss_final"] == pytest.approx(1 / 40)
    assert s["explained_variance_final"] == pytest.approx(1 - 1 / 40)
    assert main([str(run_dir)]) == 0
    md = (run_dir / "report.md").read_text()
    assert "| critic value loss, first / last step | 1 / 0.025 |" in md
    assert "| critic explained variance, last step | 0.97 |" in md
    plain = summarize(load_run(make_run(tmp_path / "grpo")))
    assert plain["value_loss_final"] is None and plain["explained_variance_final"] is None


def test_episode_rows(tmp_path):
    run_dir = make_run(tmp_path / "agents", episodes=True)
    s = summarize(load_run(run_dir))
    assert s["episode_turns_first"] == pytest.approx(2.95) and s["episode_turns_final"] == pytest.approx(1.0)
    assert main([str(run_dir)]) == 0
    md = (run_dir / "report.md").read_text()
    assert "| episode turns, first / last step | 2.95 / 1 |" in md
    assert "| episode tool calls, first / last step | 0.025 / 1 |" in md
    assert summarize(load_run(make_run(tmp_path / "plain")))["episode_turns_final"] is None


def test_only_the_panels_a_run_has_data_for_are_drawn(tmp_path):
    """A GRPO run gets no critic panel and a single-turn run no episode panel; PPO and agent runs get theirs;
    overlaid runs get a panel when either has its data; a run that logged only rewards gets one panel."""
    base = ["reward", "accuracy", "throughput", "staleness", "partial", "idle", "cpu"]
    grpo = load_run(make_run(tmp_path / "grpo"))
    ppo = load_run(make_run(tmp_path / "ppo", critic=True))
    agents = load_run(make_run(tmp_path / "agents", episodes=True))
    assert [p.name for p in panels_with_data([grpo])] == base
    assert plot_runs([grpo], tmp_path / "grpo.png") == base
    assert plot_runs([ppo], tmp_path / "ppo.png") == base + ["critic"]
    assert plot_runs([agents], tmp_path / "agents.png") == base + ["episodes"]
    assert plot_runs([grpo, ppo], tmp_path / "both.png") == base + ["critic"]
    three_rows = _png_size(tmp_path / "grpo.png")
    assert _png_size(tmp_path / "ppo.png") == three_rows  # 8 panels still fit 3 rows of 3
    logger = MetricsLogger(tmp_path / "rewards", role="trainer")
    for step in range(1, 6):
        logger.log(step, {"reward/mean": 0.1 * step}, wall_seconds=10.0 * step)
    logger.close()
    assert plot_runs([load_run(tmp_path / "rewards")], tmp_path / "rewards.png") == ["reward"]
    w, h = _png_size(tmp_path / "rewards.png")
    assert h < three_rows[1] / 2 and w < three_rows[0] / 2  # one panel, not nine with eight empty
    # through the CLI: the GRPO run's report.png is the seven-panel figure
    assert main([str(grpo.run_dir)]) == 0
    assert _png_size(grpo.run_dir / "report.png") == three_rows


def test_compare_two_runs(tmp_path):
    fast = make_run(tmp_path / "async", speed=1.5, staleness=2, partial=0.75)
    slow = make_run(tmp_path / "sync", speed=1.0, staleness=0, partial=1.0)
    out = tmp_path / "cmp"
    assert main([str(fast), "--compare", str(slow), "--out", str(out)]) == 0
    md = (out / "report-compare.md").read_text()
    assert "| | async | sync |" in md
    # sync's best (0.5) is reached at 40*30/1.5+2 = 802 s by async, 1202 s by sync: 1.50x
    assert "async 13.4 min, sync 20.0 min; async gets there 1.50× sooner" in md
    # the other way round: the first run is the slower one
    assert main([str(slow), "--compare", str(fast), "--out", str(tmp_path / "rev")]) == 0
    md = (tmp_path / "rev" / "report-compare.md").read_text()
    assert "sync 20.0 min, async 13.4 min; sync takes 1.50× as long (speed-up 0.67×)" in md
    assert _png_size(out / "report-compare.png")[0] > 1000


def test_errors(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no metrics" in capsys.readouterr().err


def test_report_through_the_cli(tmp_path):
    run_dir = make_run(tmp_path / "r")
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "report", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "# asyncrl run report: r" in proc.stdout


def test_discarded_tokens_cell_for_runs_before_and_after_the_counter():
    from asyncrl.metrics.report import _discarded_cell

    assert _discarded_cell({"appended_tokens": None, "restart_discarded_tokens": None}) == "—"
    # a run logged before the buffer counted discarded tokens (2026-11-29) has only the appended ones
    assert _discarded_cell({"appended_tokens": 67111.0, "restart_discarded_tokens": None}) == "67,111 / —"
    assert _discarded_cell({"appended_tokens": 200.0, "restart_discarded_tokens": 0.0}) == "200 / 0 (0.0%)"


def test_token_ages_and_the_pace_note(tmp_path):
    """A trainer-bound run (idle 0.08) whose bound 4 let its tokens age past 1 gets the note; a run whose
    trainer waited, whose bound is 1, whose tokens stayed fresh, or that logged no histogram does not."""
    from asyncrl.metrics.report import pace_note, token_ages

    aged = {"tokens_0": 10.0, "tokens_1": 30.0, "tokens_4": 50.0, "tokens_8plus": 10.0}
    run_dir = make_run(tmp_path / "eta4", staleness=4, trainer_idle=0.08, ages=aged)
    # step 40 replayed after a trainer restart: logged again, counted once
    replay = MetricsLogger(run_dir, role="trainer")
    replay.log(40, {"staleness/tokens_4": 50.0, "staleness/tokens_0": 50.0}, wall_seconds=1300.0)
    replay.close()
    run = load_run(run_dir)
    ages = token_ages(run.records)
    assert ages == {0: 39 * 10 + 50, 1: 39 * 30.0, 4: 40 * 50.0, 8: 39 * 10.0}
    s = summarize(run)
    total = sum(ages.values())
    assert s["token_age_mean"] == pytest.approx((39 * 30 + 4 * 40 * 50 + 8 * 39 * 10) / total)
    assert s["token_age_at_bound_share"] == pytest.approx((40 * 50 + 39 * 10) / total)
    note = pace_note(s)
    assert note is not None and "waited for a batch 8%" in note and "bound of 4" in note
    assert f"{s['token_age_mean']:.2f} policy versions old" in note and "section P" in note
    assert main([str(run_dir)]) == 0
    md = (run_dir / "report.md").read_text()
    assert f"| trained tokens' age, mean (share at the bound) | {s['token_age_mean']:.2f} (" in md
    assert "Pace: the trainer waited for a batch 8%" in md

    waited = summarize(load_run(make_run(tmp_path / "fed", staleness=4, trainer_idle=0.3, ages=aged)))
    assert waited["token_age_mean"] == pytest.approx(3.1) and pace_note(waited) is None
    bound1 = summarize(load_run(make_run(tmp_path / "eta1", staleness=1, trainer_idle=0.05, ages={"tokens_1": 5.0})))
    assert bound1["token_age_at_bound_share"] == 1.0 and pace_note(bound1) is None
    fresh = summarize(load_run(make_run(tmp_path / "fresh", staleness=4, trainer_idle=0.05,
                                        ages={"tokens_0": 5.0, "tokens_2": 5.0})))
    assert fresh["token_age_mean"] == pytest.approx(1.0) and pace_note(fresh) is None
    none = summarize(load_run(make_run(tmp_path / "old", staleness=4, trainer_idle=0.05)))
    assert none["token_age_mean"] is None and none["token_age_at_bound_share"] is None and pace_note(none) is None
    assert main([str(tmp_path / "old")]) == 0
    assert "| trained tokens' age, mean (share at the bound) | — |" in (tmp_path / "old" / "report.md").read_text()
    # compared runs: the note names its run
    assert main([str(run_dir), "--compare", str(tmp_path / "fed"), "--out", str(tmp_path / "cmp")]) == 0
    assert "eta4: Pace: the trainer waited" in (tmp_path / "cmp" / "report-compare.md").read_text()
