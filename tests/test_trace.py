"""The timeline of a sample's life (issue 30 items 4-6): recorded by the buffer's scripts, exported to
rotated files on commit, turned into a valid Perfetto trace by ``asyncrl trace``.

Real redis-server (tests/conftest.py), real buffer clients, one per role, as the processes open them.
"""

from __future__ import annotations

import asyncio
import json

from asyncrl.core.types import WorkKind
from asyncrl.metrics.trace import build_trace, first_event_ms, load_lives, main as trace_main, validate_trace
from buffers import BufferSettings, ReplayBuffer
from buffers.timeline import TimelineWriter, read_records, trace_files


def _settings(**kw) -> BufferSettings:
    base = dict(rollout_batch_size=2, train_batch_groups=1, n_samples_per_prompt=2, max_budget=4,
                max_response_len=16, max_staleness=1, stale_policy="restart", lease_seconds=0.4)
    base.update(kw)
    return BufferSettings(**base)


async def _gen(buf, item, n, version, finish=None):
    base = item.length_tokens
    ids = [(base + j) % 50 + 10 for j in range(n)]
    args = (ids, [-0.1] * n, [version] * n)
    if finish is None:
        return await buf.append(item, *args)
    return await buf.end_segment(item, finish, *args)


def _names(life):
    return [e.name for e in life.events]


def _in_order(names, wanted):
    """``wanted`` appears in ``names`` as a subsequence."""
    it = iter(names)
    return all(any(n == w for n in it) for w in wanted)


async def _first_life(url, trace_dir, run="tl"):
    """Park, resume on another server, a dead server's lease, a restart by the staleness bound, score,
    batch, acknowledge, commit, export: the transitions of one run, by role."""
    s = _settings()
    feeder = await ReplayBuffer.open(url, run, s, role="feeder")
    srv_a = await ReplayBuffer.open(url, run, s, role="rollout")
    srv_b = await ReplayBuffer.open(url, run, s, role="rollout")
    trainer = await ReplayBuffer.open(url, run, s, role="trainer")
    try:
        await feeder.feed([feeder.make_group("g0", [1, 2, 3])], 0)
        a_items = await srv_a.claim("srvA", 2)
        assert [it.sample_id for it in a_items] == ["g0/0", "g0/1"]
        for it in a_items:  # the budget M = 4 under version 0 runs out: parked
            await _gen(srv_a, it, 2, 0)
            await _gen(srv_a, it, 2, 0, "budget")
        await trainer.clock.publish(1, "/w/v1", "sha256:1")
        b_items = await srv_b.claim("srvB", 2)  # resumed on the other server under version 1
        assert sorted(it.sample_id for it in b_items) == ["g0/0", "g0/1"] and all(it.num_resumes == 1 for it in b_items)
        for it in b_items:
            await _gen(srv_b, it, 2, 1)
        by_id = {it.sample_id: it for it in b_items}
        await _gen(srv_b, by_id["g0/1"], 0, 1, "abort")  # a weight update aborts it: resumable
        # server B is killed holding g0/0 (no renew): its lease runs out
        await trainer.clock.publish(2, "/w/v2", "sha256:2")
        await asyncio.sleep(0.6)
        # both carry version-0 tokens, clock 2 > eta 1: the claim restarts them (stale_resume) and hands them out fresh
        items = await srv_a.claim("srvA", 2)
        assert sorted(it.sample_id for it in items) == ["g0/0", "g0/1"] and all(it.length_tokens == 0 for it in items)
        for it in items:
            await _gen(srv_a, it, 3, 2, "stop")
            await srv_a.score(it, reward=1.0 if it.index == 0 else 0.0)
        batch = await trainer.next_batch(3)
        assert batch is not None and batch.step == 3
        assert await trainer.acknowledge(batch, 3)
        assert await trainer.commit(3) == 1
        assert await trainer.export_timeline(trace_dir) > 0
    finally:
        for b in (feeder, srv_a, srv_b, trainer):
            await b.close()


async def test_a_samples_life_is_recorded_in_order_and_exported(redis_url, tmp_path):
    trace_dir = tmp_path / "run" / "trace"
    await _first_life(redis_url, trace_dir)
    lives, other = load_lives(read_records(trace_dir))
    assert {lf.sample_id for lf in lives} == {"g0/0", "g0/1"}
    life = next(lf for lf in lives if lf.sample_id == "g0/0")
    names = _names(life)
    assert _in_order(names, ["fed", "admit", "claim", "gen", "park", "promote", "resume", "gen", "park",
                             "restart", "claim", "gen", "complete", "score", "ready", "batch", "ack", "commit"]), names
    times = [e.t_ms for e in life.events]
    assert times == sorted(times) and times[-1] - times[0] >= 600  # monotone, server clock (the 0.6 s wait)
    ev = {e.name: e for e in life.events}
    assert ev["fed"].role == "feeder" and ev["claim"].role == "rollout" and ev["ack"].role == "trainer"
    parks = [e for e in life.events if e.name == "park"]
    assert [p.args["reason"] for p in parks] == ["budget", "lease"]
    assert next(e for e in life.events if e.name == "restart").args["reason"] == "stale_resume"
    assert next(e for e in life.events if e.name == "resume").args["w"] == "srvB"
    other_life = next(lf for lf in lives if lf.sample_id == "g0/1")
    assert [p.args["reason"] for p in other_life.events if p.name == "park"] == ["budget", "abort"]
    # segments on the servers that generated them; trained at step 3 under version 2, staleness 0
    assert [(sg.worker, sg.kind, sg.end) for sg in life.segments] == [
        ("srvA", "generate", "park"), ("srvB", "generate", "park"), ("srvA", "generate", "complete"),
        ("srvA", "score", "score")]
    assert life.step == 3 and life.version == 2 and life.staleness == 0 and life.reward == 1.0
    assert {r["kind"] for r in other} == {"batch", "publish"}
    # the trace: valid against the format's rules, one process per server and the trainer, a flow per sample
    trace = build_trace(lives, other)
    assert validate_trace(trace) == []
    procs = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {"trainer", "rollout srvA", "rollout srvB"}
    flow = [e["ph"] for e in trace["traceEvents"] if e["ph"] in "stf" and e["cat"] == "sample" and e["id"] == trace_flow_id("g0/0")]
    assert flow == ["s", "t", "t", "f"]  # three segments, then the train step
    seg = next(e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "g0/0")
    assert seg["args"]["staleness"] == 0 and seg["args"]["reward"] == 1.0


def trace_flow_id(sid):
    from asyncrl.metrics.trace import _flow_id

    return _flow_id(sid)


async def test_redis_keeps_nothing_after_commit_and_a_resumed_run_continues_the_trace(redis_url, tmp_path):
    import redis.asyncio as aioredis

    trace_dir = tmp_path / "run" / "trace"
    await _first_life(redis_url, trace_dir)
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert await r.llen("asyncrl:{tl}:timeline") == 0  # exported: Redis holds no timeline of committed work
        assert not [k async for k in r.scan_iter(match="asyncrl:{tl}:sample:*")]
    finally:
        await r.aclose()
    first = read_records(trace_dir)
    # the trainer restarts from its checkpoint of step 3 (recover) and trains one more group
    s = _settings()
    trainer = await ReplayBuffer.open(redis_url, "tl", s, role="trainer")
    feeder = await ReplayBuffer.open(redis_url, "tl", s, role="feeder")
    try:
        await trainer.recover(3, 2)
        await feeder.feed([feeder.make_group("g1", [4, 5])], 1)
        for it in await feeder.claim("srvC", 2):
            await _gen(feeder, it, 2, 2, "stop")
            await feeder.score(it, reward=float(it.index))
        batch = await trainer.next_batch(4)
        await trainer.acknowledge(batch, 4)
        await trainer.commit(4)
        await trainer.export_timeline(trace_dir)
    finally:
        await trainer.close()
        await feeder.close()
    records = read_records(trace_dir)
    assert records[: len(first)] == first  # the second session appends: the first run's records stay
    lives, other = load_lives(records)
    assert [lf.group_id for lf in lives] == ["g0", "g0", "g1", "g1"]
    assert lives[0].events[0].t_ms <= lives[-1].events[0].t_ms
    assert any(r["kind"] == "recover" and r["step"] == 3 for r in other)
    steps = [r["step"] for r in other if r["kind"] == "batch"]
    assert steps == [3, 4]
    assert validate_trace(build_trace(lives, other)) == []


async def test_timeline_off_records_nothing(redis_url):
    import redis.asyncio as aioredis

    buf = await ReplayBuffer.open(redis_url, "off", _settings(), timeline=False)
    try:
        await buf.feed([buf.make_group("g0", [1])], 0)
        for it in await buf.claim("w", 2):
            await _gen(buf, it, 2, 0, "stop")
            await buf.score(it, reward=0.5 * it.index)
        b = await buf.next_batch(0)
        await buf.acknowledge(b, 0)
        await buf.commit(0)
    finally:
        await buf.close()
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert await r.llen("asyncrl:{off}:timeline") == 0
    finally:
        await r.aclose()


async def _one_step_by_role(cfg):
    """The roles as they open the run (``ReplayBuffer.open_for``, the trainer's ``BufferBatchSource.open``):
    a group fed, generated, scored, batched, acknowledged and committed (exported), a version published.
    Returns the live ``|tl`` keys seen before the commit and the four clients' origins."""
    import redis.asyncio as aioredis

    from trainer.sources import BufferBatchSource

    controller = await ReplayBuffer.open_for(cfg, "controller")
    feeder = await ReplayBuffer.open_for(cfg, "feeder")
    rollout = await ReplayBuffer.open_for(cfg, "rollout")
    src = await BufferBatchSource.open(cfg)
    r = aioredis.Redis.from_url(cfg.buffer.redis_url.get_secret_value())
    try:
        await feeder.feed([feeder.make_group("g0", [1, 2])], 0)
        for it in await rollout.claim("w", 2):
            await _gen(rollout, it, 2, 0, "stop")
            await rollout.score(it, reward=float(it.index))
        await controller.stats()
        live = [k async for k in r.scan_iter(match="asyncrl:{sw}:*|tl")]
        assert await src.next_batch(1) is not None
        await src.acknowledge(1)
        await src.buf.clock.publish(1, "/w/v1", "sha256:1")
        await src.commit(1)
        return live, [b.origin for b in (controller, feeder, rollout, src.buf)], await r.llen("asyncrl:{sw}:timeline")
    finally:
        await r.aclose()
        for b in (controller, feeder, rollout, src.buf):
            await b.close()


def _switch_cfg(redis_url, tmp_path, monkeypatch, *flags):
    from asyncrl.core.config import load_config

    monkeypatch.setenv("ASYNCRL_BUFFER__REDIS_URL", redis_url)
    return load_config(["--run.output_dir", str(tmp_path), "--run.name", "sw", "--rollout.rollout_batch_size", "1",
                        "--rollout.n_samples_per_prompt", "2", *flags])


async def test_buffer_timeline_on_every_role_records_and_the_trainer_exports(redis_url, tmp_path, monkeypatch):
    from asyncrl.core.config import dump_config

    cfg = _switch_cfg(redis_url, tmp_path, monkeypatch)  # the default: on
    live, origins, left = await _one_step_by_role(cfg)
    assert live and left == 0  # recorded while live; exported at the commit
    assert [o.split("@")[0] for o in origins] == ["controller", "feeder", "rollout", "trainer"]
    lives, other = load_lives(read_records(cfg.run.run_dir / "trace"))
    roles = {e.role for lf in lives for e in lf.events}
    assert {"feeder", "rollout", "trainer"} <= roles and {r["kind"] for r in other} == {"batch", "publish"}
    dump_config(cfg, cfg.run.run_dir / "config.yaml")
    assert trace_main([str(cfg.run.run_dir)]) == 0


async def test_buffer_timeline_off_no_role_records_and_no_trace_is_written(redis_url, tmp_path, monkeypatch, capsys):
    from asyncrl.core.config import dump_config

    cfg = _switch_cfg(redis_url, tmp_path, monkeypatch, "--buffer.timeline", "false")
    live, origins, left = await _one_step_by_role(cfg)
    assert live == [] and left == 0 and origins == ["", "", "", ""]
    assert not (cfg.run.run_dir / "trace").exists()
    # asyncrl trace on such a run says so, and how to record one
    dump_config(cfg, cfg.run.run_dir / "config.yaml")
    capsys.readouterr()
    assert trace_main([str(cfg.run.run_dir)]) == 2
    err = capsys.readouterr().err
    assert "recorded no timeline" in err and "buffer.timeline false" in err and "--buffer.timeline true" in err
    # a run without config.yaml (or made before the switch) keeps the plain message
    (cfg.run.run_dir / "config.yaml").unlink()
    assert trace_main([str(cfg.run.run_dir)]) == 2
    assert "no timeline records under" in capsys.readouterr().err


def test_trace_reads_the_switch_from_the_newest_checkpoint_without_config_yaml(tmp_path, capsys):
    from asyncrl.core.config import AsyncRLConfig, dump_config

    for step, on in ((2, True), (4, False)):
        d = tmp_path / "checkpoints" / f"step{step:08d}"
        d.mkdir(parents=True)
        dump_config(AsyncRLConfig(buffer={"timeline": on}), d / "config.yaml")
    assert trace_main([str(tmp_path)]) == 2
    assert "recorded no timeline" in capsys.readouterr().err


def test_exported_files_are_bounded(tmp_path):
    w = TimelineWriter(tmp_path, max_file_bytes=2000, max_files=3)
    rec = json.dumps({"kind": "group", "gid": "g", "tl": "x" * 300, "samples": []})
    for i in range(40):
        w.write([rec.replace('"g"', f'"g{i}"')] * 2)
    files = trace_files(tmp_path)
    assert len(files) == 3
    assert all(p.stat().st_size <= 2000 for p in files)
    assert files[-1].name > files[0].name  # the newest kept, the oldest deleted
    assert read_records(tmp_path)[-1]["gid"] == "g39"


def test_duplicate_exports_are_read_once(tmp_path):
    w = TimelineWriter(tmp_path)
    rec = json.dumps({"kind": "publish", "t": 5, "version": 1})
    w.write([rec])
    w.write([rec])  # a crash between the file write and the trim exports it again
    assert len(read_records(tmp_path)) == 1


def test_validator_rejects_what_perfetto_would_not_read():
    ok = {"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 10}]}
    assert validate_trace(ok) == []
    overlap = {"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 10},
                               {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 5, "dur": 10}]}
    assert validate_trace(overlap)
    bad_flow = {"traceEvents": [{"ph": "f", "name": "s", "cat": "c", "id": 1, "pid": 1, "tid": 1, "ts": 0}]}
    assert validate_trace(bad_flow)
    assert validate_trace({"traceEvents": [{"ph": "X", "name": "a", "pid": "1", "tid": 1, "ts": 0, "dur": 1}]})


async def test_cli_writes_json_and_png(redis_url, tmp_path):
    run_dir = tmp_path / "run"
    await _first_life(redis_url, run_dir / "trace")
    assert trace_main([str(run_dir), "--png"]) == 0
    trace = json.loads((run_dir / "trace" / "trace.json").read_text())
    assert validate_trace(trace) == []
    assert (run_dir / "trace" / "trace.png").stat().st_size > 1000
    assert trace_main([str(run_dir), "--sample", "g0/1", "--out", str(tmp_path / "one.json")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())
    assert {e["args"]["sample"] for e in one["traceEvents"] if e["ph"] == "X" and "sample" in e["args"]} == {"g0/1"}
    assert trace_main([str(run_dir), "--step", "3", "--out", str(tmp_path / "s.json")]) == 0
    assert trace_main([str(run_dir), "--minutes", "0-5", "--out", str(tmp_path / "m.json"), "--png"]) == 0
    assert (tmp_path / "m.png").stat().st_size > 1000
    assert trace_main([str(tmp_path / "empty")]) == 2
    # a selection keeps the run's time origin: the same slice has the same ts in both traces
    lives, other = load_lives(read_records(run_dir / "trace"))
    t0 = first_event_ms(lives, other)
    shifted = build_trace(lives, other, t0 - 1000)
    slices = lambda tr: sorted((e["name"], e["ts"]) for e in tr["traceEvents"] if e["ph"] == "X")  # noqa: E731
    assert slices(shifted) == sorted((n, ts + 1_000_000) for n, ts in slices(build_trace(lives, other)))
    assert slices(one) and set(slices(one)) <= set(slices(trace))


async def test_a_timeline_stops_growing_at_its_cap(redis_url):
    import redis.asyncio as aioredis

    buf = await ReplayBuffer.open(redis_url, "cap", _settings(max_budget=100, max_response_len=400, n_samples_per_prompt=1),
                                  role="rollout")
    r = aioredis.Redis.from_url(redis_url)
    try:
        await buf.feed([buf.make_group("g0", [1])], 0)
        key = "asyncrl:{cap}:sample:g0/0|tl"
        for _ in range(400):  # claim, one token, abort: three events a cycle, ~75 bytes each
            [it] = await buf.claim("a-rather-long-worker-name-to-fill-the-timeline", 1)
            await _gen(buf, it, 1, 0, "abort")
            if int((await buf.stats())["counters"].get("timeline_events_truncated", 0)) > 3:
                break
        assert int((await buf.stats())["counters"].get("timeline_events_truncated", 0)) > 3
        text = (await r.get(key)).decode()
        assert len(text) <= 16384 and text.endswith("\n")  # whole lines only: the first events are kept
        from buffers.timeline import parse_events

        events = list(parse_events(text))
        assert events[0].name == "claim" and len(events) == text.count("\n")
    finally:
        await r.aclose()
        await buf.close()
