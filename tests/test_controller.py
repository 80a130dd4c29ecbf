"""``asyncrl train``: flags, run directories, core assignment, trainer metric names, failure handling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.core.config import ConfigError, dump_config, load_config
from asyncrl.controller.errors import ControllerError
from asyncrl.controller.train import parse_controller_flags, resolve_run
from asyncrl.controller.resources import assign_resources
from asyncrl.controller.run_watch import normalize_trainer_record

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"


def test_parse_controller_flags():
    assert parse_controller_flags(["--config", "c.yaml", "--max_budget", "8"]) == (None, False, ["--config", "c.yaml", "--max_budget", "8"])
    assert parse_controller_flags(["--resume", "runs/x", "--total_steps", "9"]) == (Path("runs/x"), False, ["--total_steps", "9"])
    assert parse_controller_flags(["--resume=runs/x"])[0] == Path("runs/x")
    assert parse_controller_flags(["--overwrite", "--config", "c"])[1] is True
    with pytest.raises(ControllerError, match="needs the run directory"):
        parse_controller_flags(["--resume"])
    with pytest.raises(ControllerError, match="needs the run directory"):
        parse_controller_flags(["--resume", "--total_steps", "3"])
    with pytest.raises(ControllerError, match="contradict"):
        parse_controller_flags(["--resume", "r", "--overwrite"])


def test_resolve_run_new_existing_resume(tmp_path, capsys):
    args = ["--config", str(TINY), "--output_dir", str(tmp_path)]
    cfg, resumed = resolve_run(args)
    assert not resumed and cfg.run.run_dir == tmp_path / "tiny"
    run_dir = cfg.run.run_dir
    dump_config(cfg, run_dir / "config.yaml")
    (run_dir / "marker").write_text("old")
    assert resolve_run(args) == 2
    assert f"--resume {run_dir}" in capsys.readouterr().err
    cfg2, resumed = resolve_run([*args, "--overwrite"])
    assert not resumed and not run_dir.exists()  # replaced
    dump_config(cfg, run_dir / "config.yaml")
    cfg3, resumed = resolve_run(["--resume", str(run_dir), "--total_steps", "9"])
    assert resumed and cfg3.run.total_steps == 9 and cfg3.run.run_dir == run_dir
    assert cfg3.rollout.max_budget == cfg.rollout.max_budget
    assert resolve_run(["--resume", str(run_dir), "--config", str(TINY)]) == 2
    assert "drop --config" in capsys.readouterr().err
    assert resolve_run(["--resume", str(tmp_path / "nope")]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    assert resolve_run(["--config", str(TINY), "--max_budgett", "3"]) == 2
    assert "unknown flag --max_budgett" in capsys.readouterr().err
    assert resolve_run(["--help"]) == 0
    assert "--resume RUN_DIR" in capsys.readouterr().out


def test_resume_moved_run_dir_uses_its_new_place(tmp_path):
    cfg = load_config(["--config", str(TINY), "--output_dir", str(tmp_path / "a")])
    dump_config(cfg, tmp_path / "b" / "renamed" / "config.yaml")
    cfg2, _ = resolve_run(["--resume", str(tmp_path / "b" / "renamed")])
    assert cfg2.run.run_dir == tmp_path / "b" / "renamed" and cfg2.run.name == "renamed"


def test_assign_resources_defaults_and_overrides():
    async_cfg = load_config(["--config", str(TINY)])
    a = assign_resources(async_cfg, available=[0, 1])
    assert a.rollout_cores == [[0]] and a.trainer_cores == [1] and a.eval_threads == 2
    assert "rollout-0 cores [0]; trainer cores [1]" == a.describe()
    a = assign_resources(async_cfg, available=[0, 1, 2, 3, 4, 5], num_rollout=2)
    assert a.trainer_cores == [3, 4, 5] and a.rollout_cores == [[0, 1], [2]]
    a = assign_resources(async_cfg, available=[0])
    assert a.trainer_cores == [0] and a.rollout_cores == [[0]]
    sync_cfg = load_config(["--config", str(TINY), "--partial_percent", "1", "--max_budget", "48",
                            "--max_staleness", "0"])
    assert sync_cfg.is_synchronous
    a = assign_resources(sync_cfg, available=[0, 1])
    assert a.trainer_cores == [0, 1] and a.rollout_cores == [[0, 1]]
    over = load_config(["--config", str(TINY), "--resources.trainer_cores", "[0]", "--resources.rollout_cores", "[0, 1]",
                        "--resources.rollout_gpus", "[0, 1]", "--resources.trainer_gpus", "[2]"])
    a = assign_resources(over, available=[0, 1])
    assert a.trainer_cores == [0] and a.rollout_cores == [[0, 1]]
    assert a.rollout_gpus == [[0, 1]] and a.trainer_gpus == [2]
    for mode, nice in (("shared", (0, 0)), ("trainer_first", (19, 0)), ("rollout_first", (0, 19))):
        shared = load_config(["--config", str(TINY), "--resources.core_sharing", mode])
        a = assign_resources(shared, available=[0, 1])
        assert a.trainer_cores == [0, 1] and a.rollout_cores == [[0, 1]]
        assert (a.rollout_nice, a.trainer_nice) == nice
    assert a.describe() == "rollout-0 cores [0, 1]; trainer cores [0, 1], nice 19"
    a = assign_resources(shared, available=[0, 1, 2, 3], num_rollout=2)  # servers still split their cores
    assert a.rollout_cores == [[0, 1], [2, 3]] and a.trainer_cores == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="core_sharing"):
        load_config(["--config", str(TINY), "--resources.core_sharing", "halves"])
    bad = load_config(["--config", str(TINY), "--resources.trainer_cores", "[7]"])
    with pytest.raises(ControllerError, match=r"resources.trainer_cores=\[7\].*offers \[0, 1\]"):
        assign_resources(bad, available=[0, 1])


def test_normalize_trainer_record():
    step, m = normalize_trainer_record({
        "step": 3.0, "reward_mean": 0.5, "reward_std": 0.1, "staleness_max": 2.0, "staleness_tokens_1": 10.0,
        "loss": 0.25, "grad_norm": 1.5, "lr": 1e-4, "version": 3.0, "processed_tokens": 300.0,
        "wait_batch_seconds": 1.0, "forward_backward_seconds": 2.0, "optim_step_seconds": 0.5,
        "publish_weights_seconds": 0.5, "uri": "/x", "early_stopped": False,
    })
    assert step == 3
    assert m["reward/mean"] == 0.5 and m["reward/std"] == 0.1
    assert m["staleness/max"] == 2.0 and m["staleness/tokens_1"] == 10.0
    assert m["train/loss"] == 0.25 and m["train/grad_norm"] == 1.5 and m["policy/version"] == 3.0
    assert m["time/wait_batch_seconds"] == 1.0 and m["time/step_seconds"] == 4.0
    assert m["idle_ratio/trainer"] == 0.25 and m["train/tokens_per_second"] == 100.0
    assert "train/uri" not in m and "train/early_stopped" not in m


@pytest.mark.integration
@pytest.mark.slow
def test_a_failing_role_stops_the_run_with_its_last_log_lines(tmp_path, tiny_model_dir):
    """A feeder whose dataset file is missing exits 2 (not restartable): the run stops, exit 1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "--config", str(TINY), "--output_dir", str(tmp_path),
           "--model_path", str(tiny_model_dir), "--data.task", "jsonl", "--data.path", str(tmp_path / "missing.jsonl"),
           "--monitoring.progress", "false"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "role 'feeder' exited with status 2; not restarted. Last log lines:" in err
    assert "missing.jsonl" in err  # the feeder's own message, from its log
    run_dir = tmp_path / "tiny"
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] == "failed"
    assert (run_dir / "logs" / "feeder.log").exists() and (run_dir / "config.yaml").exists()
    assert _no_children_left(str(run_dir))


def _no_children_left(run_dir: str) -> bool:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if run_dir in cmdline.read_bytes().decode(errors="replace"):
                return False
        except OSError:
            continue
    return True


def test_role_specs_wire_each_role(tmp_path):
    import socket

    from asyncrl.controller.controller import Controller

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        cfg = load_config(["--config", str(TINY), "--output_dir", str(tmp_path), "--rollout.num_servers", "2",
                           "--rollout.base_port", str(port), "--trainer.world_size", "2"])
        ctl = Controller(cfg, resumed=False)
        ctl.redis_url = "redis://:pw@127.0.0.1:1/0"
        specs = {s.name: s for s in ctl.role_specs(assign_resources(cfg, available=[0, 1, 2, 3]))}
    finally:
        busy.close()
    assert list(specs) == ["feeder", "rollout-0", "rollout-1", "trainer"]
    cfg_path = str(tmp_path / "tiny" / "config.yaml")
    assert specs["feeder"].argv[1:] == ["-m", "asyncrl.feeder", "--config", cfg_path]
    assert specs["rollout-1"].argv[-5:] == ["rollout-server", "--config", cfg_path, "--server_index", "1"]
    assert specs["rollout-0"].cores == [0] and specs["rollout-1"].cores == [1] and specs["trainer"].cores == [2, 3]
    # the configured port was busy: both servers moved to a free range, announced through the environment
    moved = int(specs["rollout-0"].env["ASYNCRL_ROLLOUT__BASE_PORT"])
    assert moved != port and ctl.rollout_urls == [f"http://127.0.0.1:{moved}", f"http://127.0.0.1:{moved + 1}"]
    assert specs["rollout-0"].env["ASYNCRL_ROLLOUT__ENGINE_THREADS"] == "1"
    assert "-m torch.distributed.run --standalone --nproc_per_node=2 -m asyncrl.cli trainer" in " ".join(specs["trainer"].argv)
    assert specs["trainer"].env["OMP_NUM_THREADS"] == "1"  # 2 cores shared by 2 ranks
    for s in specs.values():
        assert s.env["ASYNCRL_BUFFER__REDIS_URL"] == "redis://:pw@127.0.0.1:1/0"
        assert s.env["ASYNCRL_TRACKING_SINKS"] == "jsonl" and s.restart and s.fatal_exit_codes == (2,)
    assert [s.stop_order for s in specs.values()] == [0, 1, 1, 2]
    ctl._prepare_run_dir()  # the resolved config on disk never holds the Redis password
    assert "redis_url: null" in (tmp_path / "tiny" / "config.yaml").read_text()


def test_reconcile_groups_accounts_for_every_fed_group():
    from asyncrl.controller.run_watch import reconcile_groups

    stats = {"dataset_cursor": 52, "counters": {"committed_groups": 30, "acked_groups": 36},
             "groups_by_state": {"acked": 6, "ready": 8, "pending": 6, "generating": 0}, "dropped_by_reason": {"stale": 2}}
    ok, text = reconcile_groups(stats)
    assert ok and text.startswith("fed 52 = trained and committed 30 + in the buffer 20") and "dropped 2" in text
    assert "'generating'" not in text  # empty states are left out
    lost = dict(stats, dataset_cursor=53)  # one group fed that is nowhere: a lost sample
    ok, text = reconcile_groups(lost)
    assert not ok and text.startswith("fed 53 != ")
    assert reconcile_groups({})[0]  # an empty buffer: nothing fed, nothing missing


def _trainer_records(path: Path, steps) -> None:
    with open(path, "a") as f:
        for k in steps:
            f.write(json.dumps({"step": float(k), "loss": 0.1 * k}) + "\n")


def test_trainer_tail_resumes_where_the_killed_controller_left_off(tmp_path):
    from asyncrl.controller.run_watch import TrainerTail

    records = tmp_path / "metrics" / "trainer.jsonl"
    records.parent.mkdir()
    _trainer_records(records, [1, 2, 3])
    old = TrainerTail(tmp_path)
    assert [int(r["step"]) for _, r in old.read_new()] == [1, 2, 3]
    old.save()  # what the controller does right after forwarding
    _trainer_records(records, [4, 5])  # written after the old controller's last read; then it is SIGKILLed
    with open(records, "a") as f:
        f.write('{"step": 6.0, "lo')  # a record being written
    new = TrainerTail(tmp_path)
    assert new.resume() == 5  # the furthest complete step
    assert [int(r["step"]) for _, r in new.read_new()] == [4, 5]  # forwarded now, not skipped
    with open(records, "a") as f:
        f.write('ss": 0.6}\n')
    assert [int(r["step"]) for _, r in new.read_new()] == [6]
    # without a saved state (a run from before tail.json, or a corrupt one): start at the end
    (tmp_path / "metrics" / "tail.json").write_text("{not json")
    other = TrainerTail(tmp_path)
    assert other.resume() == 6 and other.read_new() == []


def test_a_resumed_controller_starts_from_the_trainers_furthest_step(tmp_path):
    """The previous controller was SIGKILLed while its trainer finished the run: run_state.json
    says step 26, the trainer's own records reach 30; the resumed session must report 30 (CI once
    saw "finished" with step 26/30)."""
    from asyncrl.controller.controller import Controller

    cfg = load_config(["--config", str(TINY), "--output_dir", str(tmp_path), "--total_steps", "30"])
    run_dir = tmp_path / "tiny"
    (run_dir / "metrics").mkdir(parents=True)
    _trainer_records(run_dir / "metrics" / "trainer.jsonl", range(1, 31))
    (run_dir / "run_state.json").write_text(json.dumps({"sessions": 1, "status": "running", "step": 26}))
    ctl = Controller(cfg, resumed=True)
    try:
        assert ctl._prepare() is None
        assert ctl.trainer_step == 30
    finally:
        ctl.progress.stop()
        ctl.logger.close()
        ctl.trainer_logger.close()
