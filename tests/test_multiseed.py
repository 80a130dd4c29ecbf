"""The multi-seed benchmark harness (bench/multiseed.py): statistics, interleaving, append/skip,
and the seed plumbing it relies on (``run.seed`` varies sampling, ``data.seed`` fixes the prompts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_bench



@pytest.fixture(scope="module")
def ms():
    return load_bench("multiseed")


def _curve(points):
    return [{"step": s, "minutes": m, "accuracy": a, "ci95_low": a - 0.04, "ci95_high": a + 0.04} for s, m, a in points]


def test_time_to_first_evaluation_at_or_above(ms):
    c = _curve([(0, 0.0, 0.18), (25, 4.0, 0.65), (50, 7.0, 0.59), (75, 10.0, 0.81)])
    assert ms.time_to(c, 0.6) == 4.0
    assert ms.time_to(c, 0.65) == 4.0  # "at or above"
    assert ms.time_to(c, 0.8) == 10.0
    assert ms.time_to(c, 0.8, key="step") == 75
    assert ms.time_to(c, 0.9) is None


def test_curve_band_mean_spread_and_common_steps(ms):
    a = _curve([(0, 0.0, 0.2), (25, 4.0, 0.6), (50, 8.0, 0.9)])
    b = _curve([(0, 0.0, 0.1), (25, 5.0, 0.8)])  # stopped early: step 50 is not common
    band = ms.curve_band([a, b])
    assert [p["step"] for p in band] == [0, 25]
    p25 = band[1]
    assert p25["mean"] == pytest.approx(0.7) and p25["min"] == 0.6 and p25["max"] == 0.8
    assert p25["sd"] == pytest.approx(0.1414213, rel=1e-5)  # sample sd of {0.6, 0.8}
    assert p25["values"] == [0.6, 0.8] and p25["n"] == 2 and p25["minutes_mean"] == pytest.approx(4.5)
    assert ms.curve_band([]) == []


def test_bootstrap_ratio_point_and_interval(ms):
    # every paired seed has the same ratio 2: the interval collapses onto it
    r = ms.bootstrap_ratio([4.0, 6.0, 8.0], [2.0, 3.0, 4.0], n_boot=500)
    assert r["ratio"] == pytest.approx(2.0) and r["ci_low"] == pytest.approx(2.0) and r["ci_high"] == pytest.approx(2.0)
    # spread: the interval contains the point estimate and is wider than zero
    r = ms.bootstrap_ratio([4.0, 9.0, 5.0, 7.0], [4.0, 3.0, 5.0, 2.0], n_boot=2000, seed=1)
    assert r["ci_low"] < r["ratio"] < r["ci_high"]
    assert r["ratio"] == pytest.approx(25.0 / 14.0)
    again = ms.bootstrap_ratio([4.0, 9.0, 5.0, 7.0], [4.0, 3.0, 5.0, 2.0], n_boot=2000, seed=1)
    assert again == r  # deterministic given its seed
    unpaired = ms.bootstrap_ratio([4.0, 9.0], [4.0, 3.0, 5.0], n_boot=500, paired=False)
    assert unpaired["n"] == 2


@pytest.mark.parametrize("num, den, msg", [([], [1.0], "at least one"), ([1.0], [0.0], "positive"),
                                           ([1.0, 2.0], [1.0], "equal lengths")])
def test_bootstrap_ratio_rejects_bad_input(ms, num, den, msg):
    with pytest.raises(ValueError, match=msg):
        ms.bootstrap_ratio(num, den)


def _run(arm, seed, points, train_minutes=10.0):
    return {"arm": arm, "seed": seed, "curve": _curve(points), "train_minutes": train_minutes}


def test_time_ratio_pairs_seeds_and_marks_censoring(ms):
    ref = [_run("sync", s, [(0, 0, 0.2), (25, 4.0, 0.6), (50, 8.0, 0.85)]) for s in (1, 2, 3)]
    arm = [_run("async", s, [(0, 0, 0.2), (25, 2.0, 0.7), (50, 4.0, 0.82)]) for s in (1, 2, 3)]
    r = ms.time_ratio(ref, arm, 0.8)
    assert r["ratio"] == pytest.approx(2.0) and not r["censored"] and r["seeds"] == [1, 2, 3]
    # one async seed never reaches 80%: its whole training time stands in, and the ratio says so
    arm[2] = _run("async", 3, [(0, 0, 0.2), (25, 2.0, 0.7)], train_minutes=5.0)
    r = ms.time_ratio(ref, arm, 0.8)
    assert r["censored"] and r["ratio"] == pytest.approx(24.0 / 13.0)
    assert ms.time_ratio(ref, arm, 0.95) is None  # nobody reached it
    assert ms.time_ratio(ref, [_run("async", 9, [(0, 0, 0.9)])], 0.8) is None  # no common seed


def test_plan_interleaves_seeds_and_skips_recorded_runs(ms):
    todo = ms.plan(["async", "sync"], range(1, 4), done={("async", 1), ("sync", 2)})
    assert todo == [("sync", 1), ("async", 2), ("async", 3), ("sync", 3)]


def test_parse_arms(ms):
    arms = ms.parse_arms("async,sync,abort,trl", ["abort=--rollout.pause_mode abort"])
    assert arms["async"] == [] and arms["sync"] == ms.SYNC_ARGS and arms["trl"] is None
    assert arms["abort"] == ["--rollout.pause_mode", "abort"]
    # TRL's arm takes the config's task and reward: only --data.* overrides, which it reads
    assert ms.parse_arms("trl", ["trl=--data.reward chain_partial_matched"])["trl"] == [
        "--data.reward", "chain_partial_matched"]
    with pytest.raises(ValueError, match="only --data.* overrides.*--max_staleness"):
        ms.parse_arms("trl", ["trl=--data.reward chain_partial_matched --max_staleness 4"])
    with pytest.raises(ValueError, match="unknown arm 'nope'"):
        ms.parse_arms("async,nope", [])
    with pytest.raises(ValueError, match="NAME=FLAGS"):
        ms.parse_arms("async", ["no equals sign"])
    with pytest.raises(ValueError, match="names no arm"):
        ms.parse_arms(" , ", [])


def test_time_to_ref_best_uses_each_reference_seeds_best_as_the_level(ms):
    # sync seed 1 peaks at 0.85 (step 50, minute 8), seed 2 at 0.80 (minute 4, before a dip)
    ref = [_run("sync", 1, [(0, 0, 0.2), (25, 4.0, 0.6), (50, 8.0, 0.85)]),
           _run("sync", 2, [(0, 0, 0.2), (25, 4.0, 0.80), (50, 8.0, 0.7)])]
    arm = [_run("async", 1, [(0, 0, 0.2), (25, 2.0, 0.86), (50, 4.0, 0.9)]),
           _run("async", 2, [(0, 0, 0.2), (25, 2.0, 0.79), (50, 4.0, 0.80)])]
    r = ms.time_to_ref_best(ref, arm)
    assert r["levels"] == [0.85, 0.80] and r["seeds"] == [1, 2] and not r["censored"]
    assert r["ratio"] == pytest.approx((8.0 + 4.0) / (2.0 + 4.0))  # at or above the level, 0.79 is not
    # an arm seed that never gets there stands in with its training minutes, and says so
    arm[1] = _run("async", 2, [(0, 0, 0.2), (25, 2.0, 0.79)], train_minutes=5.0)
    r = ms.time_to_ref_best(ref, arm)
    assert r["censored"] and r["ratio"] == pytest.approx(12.0 / 7.0)
    assert ms.time_to_ref_best(ref, [_run("async", 9, [(0, 0, 0.9)])]) is None  # no common seed


def test_a_reference_seed_that_never_rose_above_its_base_is_left_out_and_named(ms):
    # sync seed 2 is best at its base (0.11 at step 0, then 0.08, 0.03): every arm is "at its best" at
    # minute 0, so the pair has no time to compare; seed 1 is compared as usual
    ref = [_run("sync", 1, [(0, 0, 0.10), (4, 11.6, 0.15), (8, 19.0, 0.21)]),
           _run("sync", 2, [(0, 0, 0.11), (4, 6.6, 0.08), (8, 13.3, 0.03)])]
    arm = [_run("eta4", 1, [(0, 0, 0.10), (4, 9.5, 0.24)]), _run("eta4", 2, [(0, 0, 0.11), (4, 9.8, 0.30)])]
    r = ms.time_to_ref_best(ref, arm)
    assert r["seeds"] == [1] and r["levels"] == [0.21] and r["n"] == 1
    assert r["ratio"] == pytest.approx(19.0 / 9.5)
    assert r["no_gain"] == [{"seed": 2, "ref_base": 0.11, "ref_best_trained": 0.08, "arm_best": 0.30}]
    # only such seeds: no ratio at all, and the table says why
    r = ms.time_to_ref_best(ref[1:], arm[1:])
    assert r["ratio"] is None and r["n"] == 0 and r["seeds"] == [] and len(r["no_gain"]) == 1
    report = ms.compute_stats({"settings": {"steps": None, "minutes": 30, "eval_every": 4},
                               "arms": ["sync", "eta4"], "runs": ref + arm})
    md = ms.markdown(report)
    assert "2.00 [2.00, 2.00] (21.0); s2 left out: sync never rose above its base (11.0; best trained 8.0; eta4's best 30.0)" in md


def test_run_costs_and_their_table(ms):
    run = {**_run("async", 1, [(0, 0, 0.2), (50, 10.0, 0.8)]), "final_step": 50,
           "idle": {"rollout-0": 0.05, "trainer": 0.4},
           "steps": [{"step": 1, "time/publish_seconds": 1.0, "train/publish_bytes": 2e6},
                     {"step": 2, "time/publish_seconds": 2.0, "train/publish_bytes": 4e6}]}
    c = ms.run_costs(run)
    assert c == {"idle": {"rollout-0": 0.05, "trainer": 0.4}, "seconds_per_step": pytest.approx(12.0),
                 "publish_seconds": pytest.approx(1.5), "publish_megabytes": pytest.approx(3.0)}
    trl = {**_run("trl", 1, [(0, 0, 0.2)]), "final_step": 0, "steps": []}
    assert ms.run_costs(trl) == {}
    lines = ms.run_costs_markdown({"runs": [run, trl]}, ["async", "trl"])
    assert lines[1] == "| run | s per step | idle rollout-0 | idle trainer | publish s per step | publish MB per step |"
    assert lines[3] == "| async s1 | 12.0 | 0.05 | 0.40 | 1.50 | 3.0 |" and len(lines) == 4  # TRL has no row
    assert ms.run_costs_markdown({"runs": [trl]}, ["trl"]) == []
    # token books: appended by the rollout servers, trained, discarded by restarts
    booked = {**run, "seed": 2, "books": {"buffer/appended_tokens": 1000, "buffer/restart_discarded_tokens": 150},
              "steps": [{**s, "train/response_tokens": n} for s, n in zip(run["steps"], (400, 400))]}
    c = ms.run_costs(booked)
    assert c["appended_tokens"] == 1000 and c["trained_tokens"] == 800
    assert c["restart_discarded_share"] == pytest.approx(0.15) and c["untrained_share"] == pytest.approx(0.2)
    lines = ms.run_costs_markdown({"runs": [run, booked]}, ["async"])
    assert lines[1].endswith("| publish MB per step | appended tokens | trained tokens | discarded by restarts | never trained |")
    assert lines[2].count("---") == 10
    assert lines[3].endswith("| 3.0 | — | — | — | — |")  # a run recorded before the books: dashes
    assert lines[4] == "| async s2 | 12.0 | 0.05 | 0.40 | 1.50 | 3.0 | 1,000 | 800 | 15.0% | 20.0% |"
    # a step without its token count leaves the trained total out rather than undercount it
    partial = {**booked, "steps": [booked["steps"][0], run["steps"][1]]}
    assert "trained_tokens" not in ms.run_costs(partial) and "untrained_share" not in ms.run_costs(partial)


def _timed_steps(ms_per_token_by_step):
    """Step records whose trainer cost is the given ms per processed token (1000 tokens a step)."""
    return [{"step": st, "time/forward_backward_seconds": 0.75 * v, "time/optim_step_seconds": 0.25 * v,
             "train/processed_tokens": 1000, "time/publish_seconds": 1.0, "train/publish_bytes": 1e6}
            for st, v in ms_per_token_by_step]


def test_trainer_cost_per_token_and_the_slow_machine_flag(ms):
    """The trainer's ms per processed token is the median of steps 2.., and a run at >= 1.5x its arm's
    cheapest is named under the costs table; another arm's runs are not compared with it."""
    runs = [{**_run("sync", 1, [(0, 0, 0.2)]), "final_step": 4, "train_minutes": 2.0,
             "steps": _timed_steps([(1, 40.0), (2, 4.0), (3, 5.0), (4, 6.0)])},  # step 1 (warm-up) left out
            {**_run("sync", 2, [(0, 0, 0.2)]), "final_step": 2, "train_minutes": 2.0,
             "steps": _timed_steps([(1, 9.0), (2, 9.0)])},
            {**_run("overlap", 1, [(0, 0, 0.2)]), "final_step": 2, "train_minutes": 1.0,
             "steps": _timed_steps([(1, 8.0), (2, 8.0)])},  # alone in its arm: never flagged
            {**_run("sync", 3, [(0, 0, 0.2)]), "final_step": 1, "train_minutes": 1.0,
             "steps": _timed_steps([(1, 7.0)])}]  # only step 1: it counts
    assert ms.run_costs(runs[0])["trainer_ms_per_token"] == pytest.approx(5.0)
    assert ms.run_costs(runs[3])["trainer_ms_per_token"] == pytest.approx(7.0)
    assert "trainer_ms_per_token" not in ms.run_costs({**runs[0], "steps": [{"step": 2, "time/publish_seconds": 1.0}]})
    slow = ms.slow_runs({"runs": runs})
    assert [(s["arm"], s["seed"]) for s in slow] == [("sync", 2)]
    assert slow[0]["factor"] == pytest.approx(1.8) and slow[0]["arm_lowest_ms_per_token"] == pytest.approx(5.0)
    assert ms.slow_runs({"runs": runs}, factor=1.3) == [slow[0], {"arm": "sync", "seed": 3, "ms_per_token": 7.0,
                                                                  "arm_lowest_ms_per_token": 5.0, "factor": 1.4}]
    lines = ms.run_costs_markdown({"runs": runs}, ["sync", "overlap"])
    assert lines[1].startswith("| run | s per step | trainer ms per token | publish s per step |")
    assert lines[2].count("---") == 5 and lines[3] == "| sync s1 | 30.0 | 5.0 | 1.00 | 1.0 |"
    assert lines[-1].startswith("Slower machine (trainer ms per token >= 1.5x its arm's cheapest run): "
                                "sync s2 9.0 ms against 5.0 (1.8x).")
    with pytest.raises(ValueError, match="factor above 1"):
        ms.slow_runs({"runs": runs}, factor=1.0)


def test_the_machine_probe_columns_in_the_costs_table(ms):
    """``--machine_probe`` readings (tokens/s before and after a run) become one column; a run without
    them, or whose probe failed, shows dashes rather than a speed."""
    base = {**_run("sync", 1, [(0, 0, 0.2)]), "final_step": 2, "train_minutes": 1.0,
            "steps": [{"step": 1, "time/publish_seconds": 1.0, "train/publish_bytes": 1e6}]}
    probed = {**base, "seed": 2, "machine_before": {"tokens_per_second": 150.25, "utc": "t"},
              "machine_after": {"error": "bench/rollout_bench.py exited 1: boom", "utc": "t"}}
    c = ms.run_costs(probed)
    assert c["machine_before"] == pytest.approx(150.25) and "machine_after" not in c
    assert "machine_before" not in ms.run_costs(base)
    lines = ms.run_costs_markdown({"runs": [base, probed]}, ["sync"])
    assert lines[1].endswith("| publish MB per step | machine tok/s before / after |")
    assert lines[3].endswith("| 1.0 | — / — |") and lines[4].endswith("| 1.0 | 150.2 / — |")
    assert ms.run_costs_markdown({"runs": [base]}, ["sync"])[1].endswith("| publish MB per step |")


@pytest.mark.slow
def test_machine_probe_runs_the_plain_decode_loop_and_reports_a_failure(ms, tiny_model_dir):
    """The probe runs bench/rollout_bench.py's plain loop in a child process and returns its tokens/s;
    a loop that cannot start comes back as an error naming why, not as a speed."""
    got = ms.machine_probe(model=str(tiny_model_dir), concurrency=2, threads=1, gen_tokens=4)
    assert got["tokens_per_second"] > 0 and (got["concurrency"], got["threads"], got["gen_tokens"]) == (2, 1, 4)
    assert len(got["load_average"]) == 3 and got["utc"].endswith("Z")
    bad = ms.machine_probe(model=str(tiny_model_dir / "missing"), concurrency=2, threads=1, gen_tokens=4)
    assert "tokens_per_second" not in bad and "exited 1" in bad["error"] and "does not exist" in bad["error"]


def test_an_arm_can_turn_a_bool_field_off(ms, tmp_path):
    """``--arm notl="--buffer.timeline false"`` reaches the run's config as asyncrl train resolves it (the
    timeline's cost on the main job's step, issue 30)."""
    from asyncrl.controller.train import resolve_run

    arms = ms.parse_arms("async,notl", ['notl=--buffer.timeline false'])
    config = Path(__file__).resolve().parent.parent / "configs" / "smollm2_arith.yaml"
    base = ["--config", str(config), "--run.output_dir", str(tmp_path), "--overwrite"]
    off, resumed = resolve_run([*base, *arms["notl"]])
    assert off.buffer.timeline is False and not resumed
    on, _ = resolve_run([*base, *arms["async"]])
    assert on.buffer.timeline is True


def test_compute_stats_and_replot_from_json(ms, tmp_path):
    runs = [_run("async", s, [(0, 0, 0.2), (25, 3.0, 0.7 + 0.02 * s), (50, 6.0, 0.85)]) for s in (1, 2, 3)]
    runs += [_run("sync", s, [(0, 0, 0.2), (25, 4.0, 0.75), (50, 8.0, 0.8 + 0.01 * s)]) for s in (1, 2, 3)]
    report = {"title": "t", "settings": {"steps": 50, "minutes": None, "config": "c", "eval_every": 25,
                                         "num_problems": 400},
              "arms": ["sync", "async"], "arm_flags": {"sync": [], "async": []}, "runs": runs}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    png = tmp_path / "r.png"
    assert ms.main(["--replot", "--json", str(path), "--plot", str(png)]) == 0
    out = json.loads(path.read_text())
    assert out["title"] == "t"  # kept when --title is not given
    st = out["stats"]
    assert st["ratios_vs"] == "sync"
    assert st["arms"]["async"]["time_to"]["80%"] == [6.0, 6.0, 6.0]
    assert st["arms"]["sync"]["time_to"]["80%"] == [8.0, 8.0, 8.0]
    assert st["ratios"]["async"]["80%"]["ratio"] == pytest.approx(8.0 / 6.0)
    # --title with --replot renames the report (an arm added later changes what it compares)
    assert ms.main(["--replot", "--json", str(path), "--title", "t2"]) == 0
    assert json.loads(path.read_text())["title"] == "t2"
    assert st["arms"]["async"]["band"][1]["mean"] == pytest.approx(0.74)
    assert png.stat().st_size > 10_000
    md = ms.markdown(out)
    assert "| async (1, 2, 3) | 20.0 [20.0, 20.0]" in md and "74.0 [72.0, 76.0] (72.0, 74.0, 76.0)" in md
    assert "| async | 3.0, 3.0, 3.0 | 3.0, 3.0, 3.0 | 6.0, 6.0, 6.0 |" in md
    assert "| async | 1.33 [1.33, 1.33] | 1.33 [1.33, 1.33] | 1.33 [1.33, 1.33] |" in md


def test_dry_run_lists_only_missing_runs_and_refuses_other_settings(ms, tmp_path, capsys):
    path = tmp_path / "r.json"
    settings = {"config": "configs/smollm2_arith.yaml", "steps": 50, "minutes": None, "eval_every": 25,
                "num_problems": 400, "config_sha256": ms.config_digest("configs/smollm2_arith.yaml")}
    path.write_text(json.dumps({"title": None, "settings": settings, "arms": ["async"], "arm_flags": {"async": []},
                                "runs": [_run("async", 1, [(0, 0, 0.2)])]}))
    assert ms.main(["--arms", "async,sync", "--seeds", "2", "--steps", "50", "--json", str(path), "--dry_run"]) == 0
    todo = json.loads(capsys.readouterr().out)["todo"]
    assert todo == [["sync", 1], ["async", 2], ["sync", 2]]
    with pytest.raises(SystemExit):
        ms.main(["--arms", "async", "--seeds", "2", "--steps", "100", "--json", str(path), "--dry_run"])
    assert "other settings" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an arm recorded with other flags must get another name
        ms.main(["--arms", "async", "--arm", "async=--trainer.optimizer.lr 1e-5", "--seeds", "1", "--steps", "50",
                 "--json", str(path), "--dry_run"])
    assert "another name" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # TRL trains for a time: a step-count comparison cannot hold it
        ms.main(["--arms", "async,trl", "--seeds", "1", "--steps", "50", "--json", str(path), "--dry_run"])
    assert "use --minutes" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a snapshot spacing of 0 s would snapshot after every step, forever
        ms.main(["--arms", "trl", "--seeds", "1", "--minutes", "1", "--trl_save_every", "0", "--json", str(path),
                 "--dry_run"])
    assert "--trl_save_every must be > 0" in capsys.readouterr().err
    # Runs of an older content of the same config file: "async" (no flags) would mean another recipe.
    path.write_text(json.dumps({"title": None, "settings": {**settings, "config_sha256": "0" * 64}, "arms": ["async"],
                                "arm_flags": {"async": []}, "runs": [_run("async", 1, [(0, 0, 0.2)])]}))
    with pytest.raises(SystemExit):
        ms.main(["--arms", "async", "--seeds", "2", "--steps", "50", "--json", str(path), "--dry_run"])
    assert "another version of configs/smollm2_arith.yaml" in capsys.readouterr().err


def test_the_trl_arm_gets_its_snapshot_spacing(ms, tmp_path, capsys, monkeypatch):
    # run_trl_seed needs trl importable (not in CI): here the spacing main hands it is what is checked
    seen = []

    def fake_trl_seed(out_dir, seed, settings):
        seen.append((seed, settings["save_every"], settings["minutes"]))
        return {"curve": [{"minutes": 0.0, "step": 0, "accuracy": 0.1, "ci95_low": 0.05, "ci95_high": 0.2}],
                "steps": [], "train_minutes": 0.0, "final_step": 0, "save_every_seconds": settings["save_every"]}

    monkeypatch.setattr(ms, "run_trl_seed", fake_trl_seed)
    path = tmp_path / "r.json"
    assert ms.main(["--arms", "trl", "--seeds", "1", "--minutes", "30", "--trl_save_every", "360",
                    "--json", str(path), "--out_dir", str(tmp_path / "runs")]) == 0
    assert seen == [(1, 360.0, 30.0)]
    report = json.loads(path.read_text())
    assert report["runs"][0]["save_every_seconds"] == 360.0
    assert "save_every" not in report["settings"]  # a spacing is per run: it does not split the comparison's JSON
    # the arm's --data.* overrides reach run_trl; a JSON holding plain trl runs refuses trl with overrides
    seen.clear()
    monkeypatch.setattr(ms, "run_trl_seed", lambda out_dir, seed, settings: (
        seen.append(settings["overrides"]), fake_trl_seed(out_dir, seed, settings))[1])
    with pytest.raises(SystemExit):
        ms.main(["--arms", "trl", "--arm", "trl=--data.reward chain_partial_matched", "--seeds", "2",
                 "--minutes", "30", "--json", str(path), "--out_dir", str(tmp_path / "runs")])
    assert "another name" in capsys.readouterr().err and seen == []
    path2 = tmp_path / "r2.json"
    assert ms.main(["--arms", "trl", "--arm", "trl=--data.reward chain_partial_matched", "--seeds", "1",
                    "--minutes", "30", "--json", str(path2), "--out_dir", str(tmp_path / "runs2")]) == 0
    assert seen[0] == ["--data.reward", "chain_partial_matched"]  # then fake_trl_seed's own record
    assert json.loads(path2.read_text())["arm_flags"]["trl"] == ["--data.reward", "chain_partial_matched"]


def test_no_run_starts_when_an_arm_cannot(ms, tmp_path, capsys, monkeypatch):
    """A model that is not prepared (a fresh machine) or an arm flag ``asyncrl train`` would refuse
    stops the harness before its first run, naming the arm and the fix; nothing is written."""
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path / "empty-cache"))
    path, out = tmp_path / "r.json", tmp_path / "runs"
    argv = ["--arms", "async", "--seeds", "1", "--steps", "2", "--json", str(path), "--out_dir", str(out)]
    with pytest.raises(SystemExit):
        ms.main(argv)
    err = capsys.readouterr().err
    assert "no run started" in err and "arm 'async'" in err and "asyncrl models prepare smollm2-135m-instruct" in err
    assert not path.exists() and not out.exists()
    assert ms.preflight("configs/smollm2_arith.yaml", {"t": ["--model.path", "tiny"]}) == []
    bad = ms.preflight("configs/smollm2_arith.yaml", {"t": ["--model.path", "tiny", "--rollout.temprature", "1"]})
    assert len(bad) == 1 and bad[0].startswith("arm 't': ") and "temprature" in bad[0]


def test_read_run_from_a_run_directory(ms, tmp_path):
    run = tmp_path / "async-s1"
    run.mkdir()
    ctl = [{"step": 0, "wall_seconds": 0.3, "eval/accuracy_sampled": 0.18, "eval/ci95_low": 0.14, "eval/ci95_high": 0.22,
            "eval/eval_seconds": 304.5},
           {"step": 3, "wall_seconds": 61.0, "buffer/zero_variance_share": 0.25, "buffer/restarts": 4},
           {"step": 5, "wall_seconds": 90.0, "eval/accuracy_sampled": 0.5, "eval/ci95_low": 0.45, "eval/ci95_high": 0.55,
            "buffer/zero_variance_share": 0.5}]
    (run / "metrics-controller.jsonl").write_text("\n".join(json.dumps(r) for r in ctl) + "\n")
    tr = [{"step": s, "wall_seconds": 18.0 * s, "reward/mean": 0.1 * s, "train/behaviour_kl": 0.01, "other": 1}
          for s in range(1, 6)]
    (run / "metrics-trainer.jsonl").write_text("\n".join(json.dumps(r) for r in tr) + "\n")
    rec = ms.read_run(run)
    assert [p["step"] for p in rec["curve"]] == [0, 5] and rec["curve"][1]["minutes"] == pytest.approx(1.5)
    assert rec["final_step"] == 5 and rec["train_minutes"] == pytest.approx(1.5)
    assert rec["steps"][0] == {"step": 1, "minutes": pytest.approx(0.3), "reward/mean": 0.1, "train/behaviour_kl": 0.01}
    assert rec["books"] == {"buffer/zero_variance_share": 0.5, "buffer/restarts": 4}
    assert rec["idle"] == {}  # these records carry no idle ratios
    # the step-0 evaluation's own seconds (the same work in every arm of a seed): a machine reading
    assert rec["curve"][0]["eval_seconds"] == 304.5 and "eval_seconds" not in rec["curve"][1]
    assert ms.run_costs(rec)["base_eval_seconds"] == 304.5
    lines = ms.run_costs_markdown({"runs": [{**rec, "arm": "async", "seed": 1, "idle": {"trainer": 0.5}}]}, ["async"])
    assert "| step-0 eval s |" in lines[1] and "| 304 |" in lines[3]


def test_read_run_after_a_trainer_restart_keeps_the_replayed_steps(ms, tmp_path):
    """A trainer killed after step 4 (checkpoint at step 2) trains steps 3 and 4 again: each step is
    counted once, from the replay, and the costs table shows the restart and the trainer's peak memory."""
    run = tmp_path / "eta4-s2"
    run.mkdir()
    ctl = [{"step": 0, "wall_seconds": 0.0, "eval/accuracy_sampled": 0.1, "eval/ci95_low": 0.05, "eval/ci95_high": 0.2},
           {"step": 4, "wall_seconds": 50.0, "buffer/appended_tokens": 1000, "supervisor/restarts": 0},
           {"step": 5, "wall_seconds": 90.0, "supervisor/restarts": 1, "idle_ratio/rollout-0": 0.0}]
    (run / "metrics-controller.jsonl").write_text("\n".join(json.dumps(r) for r in ctl) + "\n")
    tokens = {1: 100, 2: 100, 3: 900, 4: 950}  # the lost attempts of steps 3 and 4 (long answers)
    tr = [{"step": s, "wall_seconds": 10.0 * s, "reward/mean": 0.5, "train/response_tokens": tokens[s],
           "train/memory_peak_resident_gb": 4.0 + s} for s in (1, 2, 3, 4)]
    tr += [{"step": s, "wall_seconds": 50.0 + 10.0 * s, "reward/mean": 0.6, "train/response_tokens": 200,
            "train/memory_peak_resident_gb": 5.0} for s in (3, 4, 5)]
    (run / "metrics-trainer.jsonl").write_text("\n".join(json.dumps(r) for r in tr) + "\n")
    rec = ms.read_run(run)
    assert [s["step"] for s in rec["steps"]] == [1, 2, 3, 4, 5] and rec["replayed_steps"] == 2
    assert [s["reward/mean"] for s in rec["steps"]] == [0.5, 0.5, 0.6, 0.6, 0.6]
    assert rec["books"]["supervisor/restarts"] == 1
    c = ms.run_costs(rec)
    assert c["trained_tokens"] == 800 and c["untrained_share"] == pytest.approx(0.2)  # not 2,450 and 0
    assert c["role_restarts"] == 1 and c["replayed_steps"] == 2
    assert c["trainer_peak_gb"] == 8.0  # the lost attempt's peak counts: it is what the machine had to hold
    other = {**{k: v for k, v in rec.items() if k not in ("trainer_peak_gb", "replayed_steps")}, "seed": 1,
             "steps": [{"step": 1, "reward/mean": 0.5}], "books": {"supervisor/restarts": 0}}
    lines = ms.run_costs_markdown({"runs": [{**rec, "arm": "eta4", "seed": 2}, {**other, "arm": "eta4"}]}, ["eta4"])
    assert "| trainer peak GB | role restarts (steps replayed) |" in lines[1]
    assert "| 8.0 | 1 (2) |" in lines[4] and "| — | 0 (0) |" in lines[3]
    # without any restart the column is left out; a run read from its directory without a restart
    # record had none, one recorded before this reading has no count
    lines = ms.run_costs_markdown({"runs": [{**other, "arm": "eta4"}]}, ["eta4"])
    assert "role restarts" not in lines[1]
    assert ms.run_costs({**other, "books": {}, "replayed_steps": 0})["role_restarts"] == 0
    legacy = {k: v for k, v in other.items() if k != "books"}  # no books, no replay count
    assert "role_restarts" not in ms.run_costs(legacy)


def test_read_run_idle_ratios_and_reread(ms, tmp_path):
    run = tmp_path / "async-s1"
    run.mkdir()
    ctl = [{"step": 1, "wall_seconds": 10.0, "idle_ratio/rollout-0": 0.0},
           {"step": 2, "wall_seconds": 20.0, "idle_ratio/rollout-0": 0.5, "eval/accuracy_sampled": 0.3,
            "eval/ci95_low": 0.2, "eval/ci95_high": 0.4}]
    (run / "metrics-controller.jsonl").write_text("\n".join(json.dumps(r) for r in ctl) + "\n")
    tr = [{"step": s, "wall_seconds": 10.0 * s, "reward/mean": 0.5, "idle_ratio/trainer": 0.2 * s,
           "time/publish_seconds": 1.5, "train/publish_bytes": 1e6} for s in (1, 2)]
    (run / "metrics-trainer.jsonl").write_text("\n".join(json.dumps(r) for r in tr) + "\n")
    rec = ms.read_run(run)
    assert rec["idle"] == {"rollout-0": pytest.approx(0.25), "trainer": pytest.approx(0.3)}
    assert rec["steps"][0]["time/publish_seconds"] == 1.5 and rec["steps"][0]["train/publish_bytes"] == 1e6
    # --replot --reread refreshes a recorded run from its directory and keeps what the harness added
    old = {**_run("async", 1, [(0, 0, 0.2)]), "commit": "abc", "steps": [], "books": {}}
    trl = _run("trl", 1, [(0, 0, 0.2)])
    report = {"title": "t", "settings": {"steps": 2, "minutes": None, "config": "c", "eval_every": 2, "num_problems": 400},
              "arms": ["async", "trl"], "arm_flags": {"async": [], "trl": None}, "runs": [old, trl]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert ms.main(["--replot", "--json", str(path), "--reread", str(tmp_path)]) == 0
    out = json.loads(path.read_text())["runs"]
    assert out[0]["commit"] == "abc" and out[0]["idle"]["trainer"] == pytest.approx(0.3)
    assert [p["step"] for p in out[0]["curve"]] == [2] and out[1] == trl


def test_run_seed_varies_sampling_while_data_seed_fixes_the_prompts(tiny_model_dir):
    """Two runs that differ only in ``run.seed`` are fed the same prompts in the same order and
    sample differently; ``data.seed`` is what changes the prompts."""
    import torch

    from asyncrl.core.config import load_config
    from asyncrl.models import load_tokenizer
    from asyncrl.tasks.tasks import TrainPromptStream
    from rollout_server.engine import Engine

    tok = load_tokenizer(tiny_model_dir)

    def cfg(*flags):
        return load_config(["--model_path", str(tiny_model_dir), "--data.num_train_prompts", "40", *flags], environ={})

    def prompts(c):
        stream = TrainPromptStream(c.data, tok, seed=c.data.seed)
        return [stream.get(i).prompt_ids for i in range(12)]

    c1, c2, c3 = cfg("--run.seed", "1"), cfg("--run.seed", "2"), cfg("--run.seed", "1", "--data.seed", "7")
    assert prompts(c1) == prompts(c2)
    assert prompts(c1) != prompts(c3)

    import threading

    from transformers import AutoModelForCausalLM

    from rollout_server.engine_sample import EngineGroup, EngineSample
    from rollout_server.sampling import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    def sample(seed):
        """Four rows of the rollout worker's kind (no per-request seed) on an engine seeded like rollout-0."""
        done = threading.Event()
        samples = [EngineSample(rid=f"r{i}", prompt_ids=[1, 2, 3],
                                params=SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=-1,
                                                      stop_token_ids=[], sampling_seed=None)) for i in range(4)]

        def on_update(updated):
            if all(s.published[1] is not None for s in samples):
                done.set()

        eng = Engine(model, tok, context_len=64, max_batch_size=4, seed=seed, on_update=on_update)
        eng.start()
        try:
            eng.submit([EngineGroup([1, 2, 3], samples)])
            assert done.wait(60), "the engine did not finish 4 short rows in 60 s"
        finally:
            eng.stop()
        return [list(s.output_ids) for s in samples]

    assert sample(c1.run.seed) == sample(c1.run.seed)  # the seed fixes the engine's sampling
    assert sample(c1.run.seed) != sample(c2.run.seed)


def test_run_diagnostics_reads_the_step_records(ms):
    steps = [{"step": s, "reward/mean": r, "train/behaviour_kl": kl, "train/entropy": h,
              "train/importance_weight_max": w, "train/clip_fraction": 0.0}
             for s, r, kl, h, w in [(1, 0.1, 0.0, 2.0, 1.0), (9, 0.8, 0.01, 0.2, 2.0), (10, 0.9, 0.3, 0.4, 21.0),
                                    (12, 0.04, 0.05, 0.6, 3.0), (13, 0.5, 0.0, 0.1, 1.0)]]
    d = ms.run_diagnostics({"steps": steps, "books": {"buffer/zero_variance_share": 0.6, "buffer/restarts": 7}})
    assert d["min_reward"] == 0.04 and d["min_reward_step"] == 12  # step 1 (long early answers) does not count
    assert d["max_behaviour_kl"] == 0.3 and d["max_behaviour_kl_step"] == 10
    assert d["entropy_steps_9_12"] == pytest.approx(0.4) and d["max_importance_weight"] == 21.0
    assert d["zero_variance_share"] == 0.6 and d["restarts"] == 7
    assert ms.run_diagnostics({"steps": []}) is None


def test_recipe_check_reach_within_the_time_and_hold_after_70(ms):
    ok = _curve([(0, 0.0, 0.15), (25, 4.0, 0.76), (50, 8.0, 0.83), (67, 10.0, 0.88)])
    assert ms.recipe_check(ok, minutes=10) == {"reached_at": 8.0, "lowest_after": 0.83, "lowest_after_step": 50,
                                               "holds": True, "passes": True}
    fell = _curve([(0, 0.0, 0.15), (25, 4.0, 0.85), (50, 8.0, 0.34)])
    assert ms.recipe_check(fell, minutes=10)["holds"] is False
    assert ms.recipe_check(fell, minutes=10)["passes"] is False
    late = _curve([(0, 0.0, 0.15), (25, 6.0, 0.72), (50, 11.0, 0.85)])  # 80% only after the limit
    assert ms.recipe_check(late, minutes=10)["reached_at"] is None
    assert ms.recipe_check(late)["reached_at"] == 11.0  # no limit: every evaluation counts
    never70 = _curve([(0, 0.0, 0.15), (25, 6.0, 0.55)])
    assert ms.recipe_check(never70, minutes=10) == {"reached_at": None, "lowest_after": None,
                                                    "lowest_after_step": None, "holds": True, "passes": False}


def test_timed_runs_line_up_by_step_and_report_the_recipe(ms, tmp_path):
    runs = [{"arm": "a", "seed": s, "train_minutes": 10.0, "steps": [], "curve": c} for s, c in (
        (1, _curve([(0, 0.0, 0.15), (25, 4.0, 0.76), (50, 8.0, 0.83), (67, 10.0, 0.88)])),
        (2, _curve([(0, 0.0, 0.16), (25, 5.0, 0.85), (50, 10.0, 0.34)])))]
    report = ms.compute_stats({"settings": {"steps": None, "minutes": 10, "eval_every": 25}, "arms": ["a"], "runs": runs})
    a = report["stats"]["arms"]["a"]
    assert [b["step"] for b in a["band"]] == [0, 25, 50]
    assert a["final"] == [{"step": 67, "minutes": 10.0, "accuracy": 0.88}, {"step": 50, "minutes": 10.0, "accuracy": 0.34}]
    assert [r["passes"] for r in a["recipe"]] == [True, False]
    md = ms.markdown(report)
    assert "| step 0 | step 25 | step 50 | end of 10 min" in md
    ms.plot(report, tmp_path / "timed.png")  # timed runs are drawn by minutes (this raised KeyError)
    assert (tmp_path / "timed.png").stat().st_size > 0
    assert "| a | 2 of 2 | 1 of 2 | 83.0 (50), 34.0 (50) |" in md


def test_prune_run_dir_keeps_records_and_the_newest_weights(ms, tmp_path):
    run = tmp_path / "a-s1"
    for rel, size in (("checkpoints/step00000060/mp_rank_00_model_states.pt", 300), ("checkpoints/latest", 4),
                      ("weights/v000065/model.safetensors", 100), ("weights/v000066/model.safetensors", 100),
                      ("weights/v000067/model.safetensors", 100), ("metrics-trainer.jsonl", 7), ("eval/step-50.json", 5)):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(b"x" * size)
    assert ms.prune_run_dir(run) == 300 + 4 + 100 + 100
    assert not (run / "checkpoints").exists()
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v000067"]
    assert (run / "metrics-trainer.jsonl").exists() and (run / "eval/step-50.json").exists()
    assert ms.prune_run_dir(run) == 0  # idempotent


def test_group_books_per_step_and_useful_share_over_a_window(ms, tmp_path):
    run = tmp_path / "selective-s1"
    run.mkdir()
    g = lambda step, fin, zero, skip: {"step": step, "wall_seconds": 10.0 * step, "buffer/finished_groups": fin,  # noqa: E731
                                       "buffer/zero_variance_groups": zero,
                                       "buffer/skipped_zero_variance_predicted": skip}
    # two records of step 2: the last one counts; step 3 has no group books (a record without them)
    ctl = [g(1, 8, 2, 0), g(2, 12, 4, 0), g(2, 16, 6, 1), {"step": 3, "wall_seconds": 30.0}, g(4, 36, 11, 9)]
    (run / "metrics-controller.jsonl").write_text("\n".join(json.dumps(r) for r in ctl) + "\n")
    tr = [{"step": s, "wall_seconds": 10.0 * s, "reward/mean": 0.5} for s in range(1, 5)]
    (run / "metrics-trainer.jsonl").write_text("\n".join(json.dumps(r) for r in tr) + "\n")
    rec = {**ms.read_run(run), "arm": "selective", "seed": 1}
    assert [r["step"] for r in rec["groups"]] == [1, 2, 4] and rec["groups"][1]["buffer/finished_groups"] == 16
    assert rec["books"]["buffer/skipped_zero_variance_predicted"] == 9
    whole = ms.group_shares(rec)
    assert whole["finished"] == 36 and whole["useful_share"] == pytest.approx(1 - 11 / 36)
    assert whole["predicted_skip_share"] == pytest.approx(9 / 45)
    half = ms.group_shares(rec, first_step=2)  # steps 3-4: 20 finished, 5 zero-variance, 8 skipped
    assert (half["first_step"], half["last_step"], half["finished"]) == (2, 4, 20)
    assert half["useful_share"] == pytest.approx(0.75) and half["predicted_skip_share"] == pytest.approx(8 / 28)
    assert ms.group_shares(rec, first_step=1)["finished"] == 28  # from the end of step 1 on
    assert ms.group_shares(rec, first_step=4) is None  # nothing finished after the last record
    assert ms.group_shares({"groups": []}) is None and ms.group_shares({}) is None
    table = ms.group_shares_markdown({"runs": [rec, {"arm": "trl", "seed": 1, "final_step": 0}]}, ["selective"])
    assert len(table) == 4 and table[-1].startswith("| selective s1 | 36 | 69.4 | 3–4: 75.0 | 28.6 | 9 |")
    assert ms.group_shares_markdown({"runs": [{"arm": "trl", "seed": 1}]}, ["trl"]) == []
