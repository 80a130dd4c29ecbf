"""The cluster simulator (bench/simulate/): its semantics, on cases small enough to check by hand.

Fast (the whole file runs in a few seconds): tiny configurations, no Redis, no model.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import bench.simulate as S
from conftest import load_bench


def tiny(**kw) -> "S.SimConfig":
    """One server, one group of one sample, fixed lengths: every time can be computed by hand."""
    base = dict(name="tiny", rollout_batch_size=1, partial_percent=1.0, n_samples=1, max_budget=10,
                max_response_len=10, max_staleness=0, prompt_tokens=4, lengths=S.FixedLength(10), servers=1,
                engine=S.EngineModel("e", alpha=0.1, beta=0.0), max_inflight=8, pause_mode="abort",
                load=0.2, trainer=S.TrainerModel(tokens_per_second=1e12, overhead=1.0, publish=0.5, poll=0.25),
                steps=4)
    base.update(kw)
    return S.SimConfig(**base)


def small(**kw) -> "S.SimConfig":
    """A small but busy asynchronous configuration with heavy-tailed lengths."""
    base = dict(name="small", rollout_batch_size=8, partial_percent=0.75, n_samples=4, max_budget=16,
                max_response_len=64, max_staleness=2, prompt_tokens=8, lengths=S.LogNormalLength(12, 0.9, 64),
                servers=2, engine=S.EngineModel("e", alpha=0.02, beta=0.002, prefill_per_token=0.0005),
                max_inflight=8, pause_mode="abort", load=0.05,
                trainer=S.TrainerModel(tokens_per_second=2000, overhead=0.1, optim=0.05, publish=0.1),
                steps=40, seed=3)
    base.update(kw)
    return S.SimConfig(**base)


# ----------------------------------------------------------------------------------------------
# exact times


def test_hand_computed_synchronous_timeline():
    """t=0: claim, 10 decode steps of 0.1 s -> READY at 1.0; the trainer polls every 0.25 s and
    takes it at 1.0; forward_backward 1.0 (overhead), publish 0.5 -> clock 1 at 2.5; the server
    loads for 0.2 s (2.7), claims the next group, READY at 3.7, taken at the poll at 3.75."""
    sim = S.Simulator(tiny())
    r = sim.run()
    recs = [rec for _, rec in sim.records]
    assert [round(x.wait, 9) for x in recs] == [1.0, 1.25, 1.25, 1.25]
    assert [round(x.total, 9) for x in recs] == [2.5, 2.75, 2.75, 2.75]
    assert [round(t, 9) for t, _ in sim.records] == [2.5, 5.25, 8.0, 10.75]
    assert r.staleness_max == 0 and r.trained_samples == 4 and r.trained_tokens == 40


def test_decode_time_follows_equation_1():
    """Two samples of 10 tokens on one server: steps of alpha + 2 beta, then the batch is empty."""
    eng = S.EngineModel("e", alpha=0.1, beta=0.05)
    sim = S.Simulator(tiny(n_samples=2, engine=eng, steps=1))
    sim.run()
    wait = sim.records[0][1].wait
    assert wait == pytest.approx(10 * (0.1 + 2 * 0.05), abs=1e-9)  # 2.0 s, a multiple of the 0.25 s poll


def test_budget_parks_and_an_idle_server_resumes_under_the_same_version():
    """M = 4 < 10 tokens: the sample is parked at 4 and 8 tokens and, the server having nothing
    else to do, resumed at once under the same version (claim.lua's idle resume)."""
    sim = S.Simulator(tiny(max_budget=4, steps=1))
    r = sim.run()
    assert r.buffer["parked_budget"] == 2 and r.buffer["idle_resumes"] == 2
    group = sim.buf.stats["trained_groups"] == 1 and sim.trained[0]
    assert group.ready_time == pytest.approx(1.0)  # parking costs no decode time here
    assert [s.minv for s in group.samples] == [0]


# ----------------------------------------------------------------------------------------------
# semantics


def test_train_batch_groups_is_asyncrl_config_formula():
    from asyncrl.core.config import train_batch_groups

    for p in (0.1, 0.5, 0.7, 0.75, 0.8, 1.0):
        for R in (1, 3, 6, 8, 10, 16, 64, 683):
            assert S.train_batch_groups(p, R) == train_batch_groups(p, R)


def test_zero_staleness_degenerates_to_synchronous():
    """p = 1, M = L, eta = 0: nothing is ever stale, and the schedule is the one of a colocated
    synchronous run (generation and training never overlap), step for step."""
    cfg = small(partial_percent=1.0, max_staleness=0, max_budget=64, steps=15)
    a, b = S.Simulator(cfg), S.Simulator(replace(cfg, colocated=True))
    ra, rb = a.run(), b.run()
    assert ra.staleness_max == 0 and ra.buffer["parked_budget"] == 0
    assert [round(t, 9) for t, _ in a.records] == [round(t, 9) for t, _ in b.records]
    assert ra.trainer_idle > 0.05  # the trainer waits for every batch
    # with asynchrony on, the same components overlap and the run is faster
    rc = S.simulate(replace(cfg, max_staleness=2, partial_percent=0.75))
    assert rc.samples_per_second > ra.samples_per_second * 0.75 / 1.0


@pytest.mark.parametrize("policy", ["restart", "drop"])
@pytest.mark.parametrize("eta", [1, 2, 3])
def test_staleness_never_exceeds_the_bound(policy, eta):
    r = S.simulate(small(max_staleness=eta, stale_policy=policy, partial_percent=0.5, max_budget=8,
                         trainer=S.TrainerModel(tokens_per_second=400, publish=0.05)))
    assert r.steps > 10
    assert r.staleness_max <= eta


def test_keep_policy_can_exceed_the_bound():
    """The bound is enforced by the stale policy: with ``keep`` a straggler is trained stale."""
    r = S.simulate(small(max_staleness=1, stale_policy="keep", partial_percent=0.25, max_budget=4,
                         lengths=S.LogNormalLength(8, 1.2, 64), steps=60,
                         trainer=S.TrainerModel(tokens_per_second=1e5, publish=0.01)))
    assert r.staleness_max > 1


@pytest.mark.parametrize("policy", ["restart", "drop", "keep"])
def test_books_balance(policy):
    """Groups fed = trained + live + dropped, whatever the stale policy did."""
    r = S.simulate(small(max_staleness=1, stale_policy=policy, partial_percent=0.5, max_budget=6, steps=50,
                         trainer=S.TrainerModel(tokens_per_second=3000, publish=0.02)))
    b = r.books
    assert b["fed"] == b["trained"] + b["live"] + b["dropped"] and b["balanced"] == 1
    assert b["trained"] == r.buffer["trained_groups"]
    if policy == "drop":
        assert b["dropped"] > 0  # the case has teeth: something was dropped and still counted
    if policy == "restart":
        assert r.buffer["restarted_samples"] > 0


def test_ratios_are_in_range_and_runs_are_deterministic():
    for cfg in (small(), small(pause_mode="in_place"), small(partial_percent=1.0, max_staleness=0, max_budget=64)):
        r1, r2 = S.simulate(cfg), S.simulate(cfg)
        assert r1.row() == r2.row()
        assert 0.0 <= r1.rollout_idle <= 1.0 and 0.0 <= r1.trainer_idle <= 1.0
        assert 0.0 <= r1.running_requests <= cfg.max_inflight
    assert S.simulate(small(seed=4)).row() != S.simulate(small(seed=5)).row()


def test_throughput_grows_with_rollout_servers_until_the_trainer_bounds_it():
    trainer = S.TrainerModel(tokens_per_second=1e9, overhead=2.0, publish=0.1)  # ~2.1 s per step
    cfg = small(trainer=trainer, partial_percent=0.25, rollout_batch_size=32, max_staleness=3, max_budget=64,
                lengths=S.LogNormalLength(12, 0.5, 64), engine=S.EngineModel("slow", alpha=0.05, beta=0.02),
                steps=30, warmup_steps=5)
    rates = [S.simulate(replace(cfg, servers=k)).samples_per_second for k in (1, 2, 4, 8, 16)]
    for lo, hi in zip(rates, rates[1:]):
        assert hi >= lo * 0.97
    bound = cfg.train_batch_groups * cfg.n_samples / (2.0 + 0.1)
    assert rates[0] < 0.6 * bound  # rollout-bound at first
    assert rates[-1] == pytest.approx(bound, rel=0.05)  # trainer-bound at the end


def test_old_admission_rule_counts_ready_groups():
    """Before the third session, READY groups held a rollout slot: fewer groups generate at once
    and the rollout runs less far ahead, so batches are fresher (docs/buffer.md)."""
    cfg = small(trainer=S.TrainerModel(tokens_per_second=300, publish=0.05), max_staleness=4, steps=30)
    new, old = S.simulate(cfg), S.simulate(replace(cfg, admission_counts_ready=True))
    assert old.staleness_mean < new.staleness_mean
    assert old.running_requests < new.running_requests


def test_in_place_pause_keeps_requests_abort_parks_them():
    r_abort = S.simulate(small())
    r_in = S.simulate(small(pause_mode="in_place"))
    assert r_abort.buffer["parked_abort"] > 0
    assert r_in.buffer["parked_abort"] == 0


def test_config_rules():
    with pytest.raises(ValueError):
        S.Simulator(small(partial_percent=0.5, max_staleness=0))
    with pytest.raises(ValueError):
        S.Simulator(small(pause_mode="retract"))


# ----------------------------------------------------------------------------------------------
# inputs


def test_bench_lengths_are_the_benchmarks_own():
    bench = load_bench("rollout_partial_bench")
    model = S.BenchParetoLength(8, 1.1, 128, seed=0, count=4000)
    assert model.lengths(None, 0, 0, 4000) == bench.target_lengths(4000, 0, 8, 1.1, 128)


def test_formulas():
    m = S.QWEN25_7B
    assert m.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # 57,344 bytes
    s = 1000
    assert m.train_flops(s) == pytest.approx(6 * m.compute_params * s + 3 * 28 * 3584 * s * s)
    eng = S.EngineModel.fit_cpu([(1, 10.0), (4, 20.0), (8, 25.0)])
    assert eng.tokens_per_second(4, 0) == pytest.approx(20.0, rel=0.1)
    e = S.calibrate_bandwidth_efficiency()
    assert 0.5 < e < 1.0
    g = S.gpu_engine()
    # at the calibration point the A100 engine reproduces SGLang's published inter-token latency
    a100 = S.EngineModel.gpu(S.A100, S.LLAMA31_8B, e, S.GPU_DECODE_COMPUTE_EFFICIENCY)
    b = S.SGLANG_A100_LLAMA8B["rps"] * S.SGLANG_A100_LLAMA8B["e2e_s"]
    assert a100.step_seconds(b, b * 600) == pytest.approx(S.SGLANG_A100_LLAMA8B["itl_s"], rel=1e-6)
    assert g.kv_capacity == pytest.approx((0.88 * 80e9 - 2 * 7.62e9) / 57344)


def test_gpu_scenarios_run_and_async_beats_sync_on_the_long_tail():
    """A 16-GPU, 32-group version of the scaling tables' long-tail case (a few seconds)."""
    sync = S.simulate(S.gpu_config(16, "long-tail", "sync", steps=3, groups=32))
    asyn = S.simulate(S.gpu_config(16, "long-tail", "async", rollout_gpus=12, partial_percent=0.5, max_staleness=4,
                                   pause_mode="in_place", steps=8, groups=32))
    assert sync.staleness_max == 0 and asyn.staleness_max <= 4
    assert asyn.samples_per_second > 1.2 * sync.samples_per_second
    assert sync.books["balanced"] == 1 and asyn.books["balanced"] == 1
    assert math.isfinite(asyn.seconds_per_step)
