"""The long-tail check (bench/simulate/longtail_check.py) and what it added to the simulator.

Fast: recorded group lengths, the ``follow`` engine and the trace readers on cases computed by
hand, and the check run on the records shipped in docs/bench.
"""

from __future__ import annotations

import json
import random

import pytest

import bench.simulate as S
from bench.simulate.buffer import Buffer
from bench.simulate.calibration import cpu_engine
from bench.simulate.longtail_check import (
    DERIVED_DECODE,
    DERIVED_LENGTHS,
    LT_ARMS,
    LT_RUNS,
    decode_slowdown,
    extract_runs,
    format_longtail_validation,
    groups_from_trace,
    longtail_validation,
    measured_summary,
    run_record,
)

# ----------------------------------------------------------------------------------------------
# recorded group lengths


def test_recorded_groups_are_drawn_whole_by_version_and_scaled():
    a, b, c = (5, 7), (100, 300), (1, 2)
    lengths = S.RecordedGroupLengths({0: [a], 4: [b, c]}, scale=2.0, source="x")
    rng = random.Random(0)
    assert lengths.lengths(rng, 0, 0, 2) == [10, 14] and lengths.lengths(rng, 1, 3, 2) == [10, 14]
    later = {tuple(lengths.lengths(rng, i, 9, 2)) for i in range(2, 40)}
    assert later == {(200, 600), (2, 4)}  # a group's samples stay together
    assert lengths.lengths(rng, 50, -1, 2) == [10, 14]  # older than every version: the oldest
    assert all(x in (10, 14) for x in lengths.lengths(rng, 60, 0, 5))  # other n: drawn from the group
    # a restart draws a new answer to the same prompt: a length of its own group
    fed = lengths.lengths(rng, 70, 9, 2)
    assert {lengths.redraw(rng, 70, 0) for _ in range(50)} == set(fed)
    assert "3 recorded groups of x" in lengths.describe()
    for bad in ({}, {0: [()]}, {0: [(0, 3)]}):
        with pytest.raises(ValueError):
            S.RecordedGroupLengths(bad)
    with pytest.raises(ValueError, match="scale"):
        S.RecordedGroupLengths({0: [a]}, scale=0)


def test_a_restarted_sample_takes_a_length_of_its_own_group():
    lengths = S.RecordedGroupLengths({0: [(7, 9), (100, 200)]})
    buf = Buffer(R=2, B=1, n=2, M=64, L=512, eta=1, stale_policy="restart", lengths=lengths, rng=random.Random(1))
    assert buf.admit() == 2
    admitted = [g for g in buf.groups_live.values() if g.samples]
    assert len(admitted) == 2
    for g in admitted:
        own = {s.target for s in g.samples}
        assert own in ({7, 9}, {100, 200})
        for _ in range(20):
            buf._reset_sample(g.samples[0], "test")
            assert g.samples[0].target in own
    # the per-sample models still redraw independently of the group
    assert S.FixedLength(4).redraw(random.Random(0), 3, 0) == 4
    with pytest.raises(NotImplementedError):
        S.BenchParetoLength(1.0, 1.0, 8, count=4).redraw(random.Random(0), 0, 0)


# ----------------------------------------------------------------------------------------------
# resources.core_sharing: follow


def follow_cfg(**kw) -> "S.SimConfig":
    """One 20-token sample per group, R 1, eta 1: the next group decodes while the trainer trains 1 s."""
    base = dict(name="follow", rollout_batch_size=1, partial_percent=1.0, n_samples=1, max_budget=64,
                max_response_len=64, max_staleness=1, prompt_tokens=4, lengths=S.FixedLength(20), servers=1,
                engine=S.EngineModel("narrow", alpha=0.2, beta=0.0), max_inflight=4, pause_mode="in_place",
                load=0.0, trainer=S.TrainerModel(tokens_per_second=1e12, overhead=1.0, poll=0.05), steps=2)
    base.update(kw)
    return S.SimConfig(**base)


def test_follow_decodes_with_the_wide_engine_only_while_the_trainer_waits():
    """Group 1: 20 tokens while the trainer waits, 2.0 s wide (0.1 s/token). Group 2 starts when
    group 1 is READY: 5 tokens narrow (0.2 s/token) during the 1 s of training, 15 wide after
    (1.5 s), so step 2 ends at 2 + 1 + 1.5 + 1 = 5.5 s. Narrow throughout: 4 + 4 + 1 = 9 s (group 2
    decodes 4-8 s); wide throughout: 2 + 2 + 1 = 5 s."""
    wide = S.EngineModel("wide", alpha=0.1, beta=0.0)

    def end(cfg):
        sim = S.Simulator(cfg)
        sim.run()
        return sim.now
    assert end(follow_cfg(engine_wide=wide)) == pytest.approx(5.5, abs=0.06)
    assert end(follow_cfg()) == pytest.approx(9.0, abs=0.06)
    assert end(follow_cfg(engine=wide)) == pytest.approx(5.0, abs=0.06)


def test_longtail_config_sets_the_arms_layouts():
    lengths = S.RecordedGroupLengths({0: [(10,) * 8]})
    sync, split, follow = (S.longtail_config(a, lengths, steps=3) for a in ("sync", "async", "keepfollow"))
    assert sync.engine.beta == pytest.approx(cpu_engine(2).beta) and sync.engine_wide is None
    assert split.engine.beta == pytest.approx(cpu_engine(1).beta) and split.stale_policy == "restart"
    assert follow.engine_wide.beta == pytest.approx(cpu_engine(2).beta) and follow.stale_policy == "keep"
    assert split.train_batch_groups == 6 and split.pause_mode == "in_place" and sync.max_budget == 512
    slow = S.longtail_config("async", lengths, steps=3, decode_scale=2.0, prefill_scale=4.0)
    assert slow.engine.alpha == pytest.approx(2 * split.engine.alpha)
    assert slow.engine.prefill_per_token == pytest.approx(split.engine.prefill_per_token / 4)
    with pytest.raises(KeyError):
        S.longtail_config("nope", lengths, steps=3)
    with pytest.raises(ValueError, match="decode_scale"):
        S.longtail_config("sync", lengths, steps=3, decode_scale=0)


# ----------------------------------------------------------------------------------------------
# reading a run


def write_run(root, samples_tl, version=2):
    """A run directory with one committed group of the given sample timelines, and its metrics."""
    (root / "trace").mkdir(parents=True)
    group = {"kind": "group", "how": "committed", "version": version,
             "samples": [{"i": i, "tl": tl, "tokens": tok, "minv": version - i} for i, (tl, tok) in enumerate(samples_tl)]}
    (root / "trace" / "timeline-000001.jsonl").write_text(
        json.dumps({"kind": "publish", "t": 1}) + "\n" + json.dumps(group) + "\n"
        + json.dumps({"kind": "group", "how": "dropped", "samples": []}) + "\n")
    ctrl = [{"idle_ratio/rollout-0": 0.2, "buffer/restarts": 3}, {"idle_ratio/rollout-0": 0.4, "buffer/restarts": 5}]
    trainer = [{"step": s, "reward/mean": 0.0, "time/step_seconds": 10.0 * s, "time/wait_batch_seconds": 2.0,
                "time/publish_seconds": 1.0, "train/response_tokens": 100.0 * s, "train/samples": 48.0,
                "idle_ratio/trainer": 0.1 * s} for s in (1, 2, 3)]
    (root / "metrics-controller.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ctrl))
    (root / "metrics-trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"step": 0}, *trainer]))


def test_decode_slowdown_integrates_the_models_rate_over_the_measured_rows(tmp_path):
    """A: 0-10 s, 50 tokens; B: 0-4 s (10 tokens), parked, resumed 6-8 s (20 tokens). Rows: 2 in
    [0, 4] and [6, 8], 1 in [4, 6] and [8, 10]; a stretch of 300 s with no event is left out."""
    a = ("claim 0 r len=0\ngen 0 r len=0\ncomplete 10000 r reason=stop len=50\n", 50)
    b = ("gen 0 r len=0\npark 4000 r reason=budget len=10 v=0\nresume 5000 r len=10\ngen 6000 r len=10\n"
         "complete 8000 r len=30\n", 30)
    c = ("gen 10000 r len=0\nrestart 11000 r\ngen 400000 r len=0\ncomplete 401000 r len=8\n", 8)
    write_run(tmp_path, [a, b])
    eng = cpu_engine(1)
    t1, t2 = eng.step_seconds(1, 0), eng.step_seconds(2, 0)
    model = (4 / t2 + 2 / t1 + 2 / t2 + 2 / t1) + (4 / t2 + 2 / t2)
    assert decode_slowdown(tmp_path, 1) == pytest.approx(model / 80)
    other = tmp_path / "gap"
    write_run(other, [a, b, c])  # c: its first attempt is restarted, its second runs alone 390 s after the rest
    assert decode_slowdown(other, 1) == pytest.approx((model + 1 / t1) / 88)
    with pytest.raises(FileNotFoundError):
        decode_slowdown(tmp_path / "none", 1)


def test_groups_and_record_are_read_from_a_run_directory(tmp_path):
    write_run(tmp_path, [("gen 0 r len=0\ncomplete 1 r len=50\n", 50), ("gen 0 r len=0\ncomplete 1 r len=30\n", 30)])
    assert groups_from_trace(tmp_path) == {1: [[50, 30]]}  # the group's oldest token version
    rec = run_record(tmp_path)
    assert rec["final_step"] == 3 and rec["books"] == {"buffer/restarts": 5}
    assert rec["idle"] == {"rollout-0": pytest.approx(0.3), "trainer": pytest.approx(0.2)}
    m = measured_summary("keep-s1", rec)
    assert m["arm"] == "keep" and m["seconds_per_step"] == pytest.approx(25.0)  # steps 2 and 3
    # tokens processed (responses + 6 prompts) per second of step time outside the wait and the publish
    assert m["trainer_tokens_per_second"] == pytest.approx((500 + 2 * 6 * S.longtail_check.LT_PROMPT_TOKENS) / 44)
    assert m["restarted_samples"] == 5 and m["response_tokens"] == pytest.approx(200)
    with pytest.raises(ValueError, match="after step 1"):
        measured_summary("keep-s1", {**rec, "steps": rec["steps"][:1]})
    with pytest.raises(FileNotFoundError):
        groups_from_trace(tmp_path / "none")
    out = tmp_path / "lengths.json"
    assert extract_runs([f"keep-s1={tmp_path}"], path=out) == ["keep-s1"]
    stored = json.loads(out.read_text())["keep-s1"]
    assert stored["groups"] == {"1": [[[50, 30], 1]]} and stored["run"]["final_step"] == 3
    assert set(stored["decode_slowdown"]) == {"1", "2"}


def test_extract_runs_refuses_bad_pairs_before_writing(tmp_path):
    out = tmp_path / "l.json"
    with pytest.raises(ValueError, match="KEY=RUN_DIR"):
        extract_runs(["sync-s1"], path=out)
    with pytest.raises(ValueError, match="arm"):
        extract_runs([f"nosuch-s1={tmp_path}"], path=out)
    with pytest.raises(FileNotFoundError):
        extract_runs([f"keep-s1={tmp_path}"], path=out)
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# the check on the shipped records


@pytest.fixture(scope="module")
def shipped():
    return longtail_validation(seeds=2)


def test_longtail_check_on_the_shipped_records(shipped):
    rows = {r["key"]: r for r in shipped["runs"]}
    assert {"sync-s1", "async-s1"} <= set(rows) <= set(LT_RUNS)
    sync, asyn = rows["sync-s1"], rows["async-s1"]
    # the measured figures of docs/results.md section H
    assert sync["steps"] == 18 and asyn["steps"] == 12
    assert (round(sync["rollout_idle"]["measured"], 2), round(sync["trainer_idle"]["measured"], 2)) == (0.38, 0.59)
    assert (round(asyn["rollout_idle"]["measured"], 2), round(asyn["trainer_idle"]["measured"], 2)) == (0.00, 0.60)
    assert asyn["restarted_samples"]["measured"] == 124 and sync["restarted_samples"]["measured"] == 0
    # the async run's directory is gone: the sync run's groups, scaled to its mean trained length
    assert asyn["lengths"]["run"] == DERIVED_LENGTHS["async-s1"] == "sync-s1"
    assert asyn["lengths"]["scale"] == pytest.approx(2635.75 / 2019.5)
    assert sync["decode_slowdown"] > 1  # the run decoded slower than the model's engine
    for r in rows.values():
        assert r["arm"] in LT_ARMS
        lo, hi = r["seconds_per_step"]["range"]
        assert 0 < lo <= r["seconds_per_step"]["predicted"] <= hi
    assert asyn["decode_run"] == DERIVED_DECODE["async-s1"] and sync["decode_run"] == "sync-s1"
    ratios = {q["arm"]: q for q in shipped["ratios"]}
    # paired by seed: keep has seed 1 only, so its ratio is against sync seed 1 alone; seed 1's
    # asynchronous steps were slower, the sign docs/scaling.md states for the model
    assert ratios["keep"]["runs"] == ratios["keep"]["sync_runs"] == 1
    assert ratios["keep"]["measured"] < 1 and ratios["keep"]["predicted"] < 1
    keep_s1 = rows["keep-s1"]["seconds_per_step"]["measured"]
    assert ratios["keep"]["measured"] == pytest.approx(sync["seconds_per_step"]["measured"] / keep_s1)
    # seed 2 (extracted from its run directory): the async steps were faster than sync's
    sync2, async2 = rows["sync-s2"], rows["async-s2"]
    assert (sync2["steps"], async2["steps"]) == (13, 31) and async2["restarted_samples"]["measured"] == 152
    assert async2["lengths"]["run"] == "async-s2" and async2["decode_run"] == "async-s2"
    assert async2["seconds_per_step"]["measured"] < sync2["seconds_per_step"]["measured"]
    # seed 3: slower async steps again (longer trained answers than sync's), so over the 3 seeds < 1
    sync3, async3 = rows["sync-s3"], rows["async-s3"]
    assert (sync3["steps"], async3["steps"]) == (21, 16) and async3["restarted_samples"]["measured"] == 110
    assert async3["seconds_per_step"]["measured"] > sync3["seconds_per_step"]["measured"]
    assert ratios["async"]["runs"] == ratios["async"]["sync_runs"] == 3
    per = {k: rows[k]["seconds_per_step"]["measured"] for k in rows}
    syncs, asyncs = [per[f"sync-s{i}"] for i in (1, 2, 3)], [per[f"async-s{i}"] for i in (1, 2, 3)]
    assert ratios["async"]["measured"] == pytest.approx(sum(syncs) / sum(asyncs))
    assert ratios["async"]["measured"] < 1 and ratios["async"]["predicted"] < 1  # the sign, measured and predicted
    table = format_longtail_validation(shipped)
    assert "| sync-s1 | 18 | sync-s1 | 93.0 |" in table and "| async-s1 | 12 | sync-s1 × 1.31 | 152.8 |" in table


def test_a_run_without_a_decode_rate_prints_dashes(shipped):
    res = json.loads(json.dumps(shipped))
    for q in ("seconds_per_step", "rollout_idle", "trainer_idle", "restarted_samples"):
        res["runs"][0][q]["predicted_own_rates"] = None
    res["runs"][0]["decode_slowdown"] = None
    for q in res["ratios"]:
        q["predicted_own_rates"] = None
    table = format_longtail_validation(res)
    assert table.splitlines()[2].count("—") == 4 and "decode ×" not in table.splitlines()[2]


def test_cli_longtail_prints_the_table(capsys):
    assert S.main(["longtail", "--seeds", "1"]) == 0
    assert "sync s/step ÷ arm s/step" in capsys.readouterr().out
    assert S.main(["longtail", "--extract", "nokey"]) == 2
    assert "KEY=RUN_DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        S.main(["longtail", "--seeds", "0"])
    with pytest.raises(ValueError, match="seeds"):
        longtail_validation(seeds=0)


def test_the_forecast_runs_every_arm_on_one_runs_lengths(shipped):
    fc = S.longtail_check.longtail_forecast(shipped, steps=3, seeds=1)
    assert [r["arm"] for r in fc["arms"]] == list(LT_ARMS) and fc["lengths"] == "sync-s1"
    sync = fc["arms"][0]
    assert all(sync["ratio" + k[9:]] == pytest.approx(1.0) for k in ("predicted", "predicted_own_trainer",
                                                                      "predicted_own_rates"))
    assert all(r["predicted"] > 0 for r in fc["arms"])
    # without a measured one-thread run there is no own trainer rate for the split arms
    only_sync = {"runs": [r for r in shipped["runs"] if r["arm"] == "sync"]}
    fc = S.longtail_check.longtail_forecast(only_sync, steps=3, seeds=1)
    assert fc["arms"][1]["predicted_own_trainer"] is None and fc["arms"][1]["ratio_own_trainer"] is None
    table = S.longtail_check.format_longtail_forecast(fc)
    assert "| async | " in table and "—" in table
    with pytest.raises(ValueError, match="seeds"):
        S.longtail_check.longtail_forecast(shipped, seeds=0)
