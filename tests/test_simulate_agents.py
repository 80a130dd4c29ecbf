"""The simulator's agent episodes (bench/simulate/agents.py) and the slow-tool check (agent_check.py).

Fast: tiny configurations whose times can be computed by hand, timelines written here, and the
check run on the records shipped in docs/bench.
"""

from __future__ import annotations

import json
import random

import pytest

import bench.simulate as S
from bench.simulate.agent_check import (
    CALC_ARMS,
    agent_validation,
    extract_episodes,
    format_agent_validation,
    measured_runs,
)
from bench.simulate.agents import _episode_of


def agent_cfg(calls=(10, 10), obs=(5,), latency=3.0, **kw) -> "S.SimConfig":
    """One sample per step, decode 0.1 s per token, no prefill cost, a tool of ``latency`` seconds."""
    eps = S.Episodes({0: [S.Episode(tuple(calls), tuple(obs))]})
    base = dict(name="agent", rollout_batch_size=1, partial_percent=1.0, n_samples=1, max_budget=100,
                max_response_len=100, max_staleness=0, prompt_tokens=4, lengths=S.FixedLength(1), servers=1,
                engine=S.EngineModel("e", alpha=0.1, beta=0.0), max_inflight=8, pause_mode="abort", load=0.0,
                trainer=S.TrainerModel(tokens_per_second=1e12, overhead=1.0, poll=0.05), steps=3,
                agent=S.AgentModel(eps, S.ToolLatency(latency)))
    base.update(kw)
    return S.SimConfig(**base)


# ----------------------------------------------------------------------------------------------
# episodes


def test_episode_shape_and_its_errors():
    ep = S.Episode((10, 7, 3), (5, 2))
    assert ep.model_tokens == 20 and ep.stops() == [10, 17]
    assert [ep.observation_tokens_before(x) for x in (0, 9, 10, 16, 17, 20)] == [0, 0, 5, 5, 7, 7]
    with pytest.raises(ValueError, match="observations"):
        S.Episode((10, 7), ())
    with pytest.raises(ValueError, match=">= 1 call"):
        S.Episode((), ())
    with pytest.raises(ValueError, match=">= 1 call"):
        S.Episode((0,), ())
    with pytest.raises(ValueError, match="at least one"):
        S.Episodes({})


def test_episodes_draw_by_version_and_round_trip_json():
    a, b = S.Episode((1,), ()), S.Episode((2, 3), (4,))
    eps = S.Episodes({0: [a], 5: [b, b]}, source="x")
    rng = random.Random(0)
    assert eps.draw(rng, 0) == a and eps.draw(rng, 4) == a  # the newest version <= 4 with episodes is 0
    assert eps.draw(rng, 5) == b and eps.draw(rng, 99) == b
    assert eps.draw(rng, -1) == a  # older than every version: the oldest
    back = S.Episodes.from_json(json.loads(json.dumps(eps.to_json())))
    assert back.all() == eps.all() and back.source == "x"
    assert eps.to_json()["by_version"]["5"] == [[[2, 3], [4], 2]]  # equal episodes are counted, not repeated


def test_timeline_parsing_follows_calls_parks_restarts_and_empty_calls():
    tl = ("claim 1 r len=0 max_new=64 from=fresh\ngen 2 r len=0\nturn 3 r len=48\ngen 4 r len=67\n"
          "park 5 r reason=budget len=83 v=0\nresume 6 r len=83\ngen 7 r len=83\nturn 8 r len=115\n"
          "complete 9 r reason=stop len=115\nscore 10 r reward=0.0\n")
    assert _episode_of(tl) == S.Episode((48, 48), (19,))  # the resumed call is one call of 16 + 32
    assert _episode_of("gen 1 r len=0\nturn 2 r len=9\nrestart 3 r\ngen 4 r len=0\ncomplete 5 r len=12\n") == \
        S.Episode((12,), ())
    # an empty call (nothing generated) folds its observation into the next call's
    assert _episode_of("gen 1 r len=0\nturn 2 r len=5\ngen 3 r len=8\nturn 4 r len=8\ngen 5 r len=10\n"
                       "complete 6 r len=14\n") == S.Episode((5, 4), (5,))
    assert _episode_of("score 1 r reward=0\n") is None


def test_episodes_from_trace_reads_committed_groups(tmp_path):
    (tmp_path / "trace").mkdir()
    sample = {"tl": "gen 1 r len=0\nturn 2 r len=10\ngen 3 r len=15\ncomplete 4 r len=20\n", "minv": 3}
    rows = [{"kind": "publish", "t": 1}, {"kind": "group", "how": "committed", "samples": [sample, sample]},
            {"kind": "group", "how": "dropped", "samples": [sample]}]
    (tmp_path / "trace" / "timeline-000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    eps = S.episodes_from_trace(tmp_path)
    assert eps.by_version == {3: [S.Episode((10, 5), (5,))] * 2}
    with pytest.raises(FileNotFoundError, match="trace"):
        S.episodes_from_trace(tmp_path / "nothing")
    (tmp_path / "trace" / "timeline-000001.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="no committed sample"):
        S.episodes_from_trace(tmp_path)


# ----------------------------------------------------------------------------------------------
# the simulator with tool calls


def test_a_tool_call_adds_its_latency_and_the_next_call_is_prefilled():
    """10 tokens (1.0 s), the tool (3 s), 10 tokens (1.0 s): READY at 5.0 s against 2.0 s without
    a tool; with prefill the second call stalls for prompt + first call + observation = 19 tokens."""
    def ready(**kw):
        sim = S.Simulator(agent_cfg(steps=1, **kw))
        sim.run()
        return sim.trained[0].ready_time
    assert ready() == pytest.approx(5.0)
    assert ready(latency=0.0) == pytest.approx(2.0)
    eng = S.EngineModel("e", alpha=0.1, beta=0.0, prefill_per_token=0.01)
    assert ready(engine=eng) == pytest.approx(5.0 + 0.04 + 0.19)  # first call: the 4-token prompt


def test_tool_waits_count_as_idle_and_hold_worker_slots():
    """While its only sample waits for the tool the server is idle (no engine request); with one
    worker slot two samples cannot overlap their tool waits."""
    idle = {}
    for latency in (0.0, 3.0):
        sim = S.Simulator(agent_cfg(steps=1, latency=latency))
        sim.run()
        idle[latency] = sim.servers[0].idle_time
    # the tool wait is idle time; the rest is the same up to the trainer's 0.05 s poll grid
    assert idle[3.0] - idle[0.0] == pytest.approx(3.0, abs=0.051)
    two = S.Simulator(agent_cfg(steps=1, n_samples=2, max_inflight=1))
    two.run()
    assert two.trained[0].ready_time == pytest.approx(10.0)  # one after the other: 2 x (1 + 3 + 1)
    overlap = S.Simulator(agent_cfg(steps=1, n_samples=2, max_inflight=2))
    overlap.run()
    assert overlap.trained[0].ready_time == pytest.approx(5.0)  # both decode together, both tools wait together


@pytest.mark.parametrize("pause_mode", ["abort", "in_place"])
def test_agent_tokens_are_conserved_through_parking_aborts_and_restarts(pause_mode):
    """Budget parking, weight-update pauses and stale restarts: every trained sample holds exactly
    its episode's model tokens, credited to versions, and the books balance."""
    eps = S.Episodes({0: [S.Episode((12, 9, 20), (5, 3)), S.Episode((30,), ())], 3: [S.Episode((7, 7), (2,))]})
    cfg = S.SimConfig(name="busy agent", rollout_batch_size=6, partial_percent=0.5, n_samples=4, max_budget=8,
                      max_response_len=64, max_staleness=1, prompt_tokens=6, servers=2,
                      engine=S.EngineModel("e", alpha=0.02, beta=0.002, prefill_per_token=0.001), max_inflight=6,
                      pause_mode=pause_mode, load=0.05,
                      trainer=S.TrainerModel(tokens_per_second=3000, overhead=0.1, optim=0.05, publish=0.1),
                      steps=30, seed=4, agent=S.AgentModel(eps, S.ToolLatency(0.5, 0.3, 2.0)))
    sim = S.Simulator(cfg)
    r = sim.run()
    assert r.steps == 30 and r.books["balanced"] == 1
    assert r.buffer["parked_budget"] > 0 and r.staleness_max <= 1
    for g in sim.trained:
        for s in g.samples:
            ep = sim.agent_episodes[(s.sid, s.restarts)]
            assert s.length == s.target == ep.model_tokens
            assert s.extra == sum(ep.observations)
    assert r.buffer["parked_abort"] > 0 if pause_mode == "abort" else r.buffer["parked_abort"] == 0


# ----------------------------------------------------------------------------------------------
# the check against the measured runs (docs/bench)


def test_agent_check_on_the_shipped_records():
    runs = measured_runs()
    assert {m["arm"] for m in runs} >= {"sync", "async"}
    res = agent_validation()
    keys = {r["key"] for r in res["runs"]}
    assert {"sync-s1", "async-s1"} <= keys
    for r in res["runs"]:
        assert r["arm"] in CALC_ARMS
        for q in ("seconds_per_step", "rollout_idle", "trainer_idle"):
            assert r[q]["predicted"] >= 0 and r[q]["measured"] >= 0
    ratio = {q["arm"]: q for q in res["ratios"]}
    assert ratio["async"]["predicted"] > 1 and ratio["async"]["measured"] > 1  # the sign: async steps are faster
    assert ratio["overlap"]["runs"] == 3 and ratio["overlap"]["measured"] > 1  # the configs' default since 2026-11-29
    table = format_agent_validation(res)
    assert "| sync-s1 |" in table and "| async |" in table


def test_calculator_config_refuses_bad_input_and_scales_prefill():
    eps = S.Episodes({0: [S.Episode((5,), ())]})
    with pytest.raises(KeyError):
        S.calculator_config("nope", eps, steps=2)
    with pytest.raises(ValueError, match="prefill_scale"):
        S.calculator_config("sync", eps, steps=2, prefill_scale=0)
    base = S.calculator_config("async", eps, steps=2)
    assert S.calculator_config("async", eps, steps=2, prefill_scale=4).engine.prefill_per_token == \
        pytest.approx(base.engine.prefill_per_token / 4)
    assert base.train_batch_groups == 6 and base.max_staleness == 2 and base.agent.latency.median == 1.737


def test_extract_episodes_refuses_a_bad_pair(tmp_path):
    with pytest.raises(ValueError, match="KEY=RUN_DIR"):
        extract_episodes(["sync-s1"], path=tmp_path / "e.json")
    with pytest.raises(FileNotFoundError):
        extract_episodes([f"k={tmp_path}"], path=tmp_path / "e.json")
    assert not (tmp_path / "e.json").exists()  # nothing half-written


def test_cli_agents_prints_the_table(capsys):
    assert S.main(["agents"]) == 0
    assert "sync s/step" in capsys.readouterr().out
    assert S.main(["agents", "--extract", "nokey"]) == 2
    assert "KEY=RUN_DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        S.main(["agents", "--prefill-scale", "0"])
