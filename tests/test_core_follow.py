"""``resources.core_sharing: follow`` (asyncrl/core/core_follow.py): the trainer holds an idle flag
while it waits for a batch, and a rollout engine runs with the trainer's threads too while the
flag exists. Tested with the real pieces: the controller's assignment and role environments,
the trainer's loop on a tiny model, and the embedded engine generating with the flag set."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest

from asyncrl.core.config import load_config
from asyncrl.core.core_follow import (
    FLAG_ENV,
    WIDE_ENV,
    IdleFlag,
    ThreadFollower,
    follower_from_env,
    idle_flag_from_env,
)
from asyncrl.controller.resources import assign_resources
from tests.test_trainer import make_cfg, make_groups, tiny_model  # noqa: F401  (module fixture)

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"


def test_idle_flag_exists_only_inside_the_wait_and_after_an_error_it_is_gone(tmp_path):
    flag = IdleFlag(tmp_path / "cores" / "trainer.idle")
    assert not flag.path.exists()
    with flag.waiting():
        assert flag.path.exists()
    assert not flag.path.exists()
    with pytest.raises(RuntimeError), flag.waiting():
        raise RuntimeError("the source failed")
    assert not flag.path.exists()
    flag.set(True)  # a trainer killed while waiting leaves it behind; the next one clears it
    IdleFlag(flag.path).clear()
    assert not flag.path.exists()


def test_thread_follower_widens_while_the_flag_exists_and_counts_switches(tmp_path):
    calls: list[int] = []
    flag = tmp_path / "trainer.idle"
    f = ThreadFollower(flag, own_threads=1, wide_threads=3, set_threads=calls.append)
    assert f.poll() == 1 and calls == []  # no flag: the own count, nothing to change
    flag.touch()
    assert f.poll() == 3 and f.poll() == 3 and calls == [3]
    flag.unlink()
    assert f.poll() == 1 and calls == [3, 1] and f.switches == 2
    with pytest.raises(ValueError, match="own 2 must be >= 1 and <= wide 1"):
        ThreadFollower(flag, 2, 1, calls.append)
    with pytest.raises(ValueError, match="own 0"):
        ThreadFollower(flag, 0, 2, calls.append)


def test_from_env_reads_the_controller_variables_and_refuses_a_bad_count(tmp_path):
    flag = str(tmp_path / "f")
    assert follower_from_env(1, print, environ={}) is None
    assert follower_from_env(1, print, environ={FLAG_ENV: flag}) is None  # the trainer's variable alone
    f = follower_from_env(None, print, environ={FLAG_ENV: flag, WIDE_ENV: "2"})
    assert (f.own_threads, f.wide_threads, f.flag) == (1, 2, flag)
    with pytest.raises(ValueError, match=f"{WIDE_ENV}='two' must be a whole number"):
        follower_from_env(1, print, environ={FLAG_ENV: flag, WIDE_ENV: "two"})
    assert idle_flag_from_env({}) is None
    assert idle_flag_from_env({FLAG_ENV: flag}).path == Path(flag)


def test_follow_assignment_keeps_split_threads_on_every_core_and_wires_the_roles(tmp_path):
    from asyncrl.controller.controller import Controller

    cfg = load_config(["--config", str(TINY), "--output_dir", str(tmp_path), "--resources.core_sharing", "follow"])
    a = assign_resources(cfg, available=[0, 1])
    assert a.rollout_cores == [[0, 1]] and a.trainer_cores == [0, 1]
    assert (a.rollout_threads, a.trainer_threads, a.rollout_wide_threads) == (1, 1, 2)
    assert a.describe() == "rollout-0 cores [0, 1], 1 threads (2 while the trainer waits); trainer cores [0, 1], 1 threads"
    four = assign_resources(cfg, available=[0, 1, 2, 3], num_rollout=2)
    assert (four.rollout_threads, four.trainer_threads, four.rollout_wide_threads) == (1, 2, 2)
    ctl = Controller(cfg, resumed=False)
    ctl.redis_url = "redis://:pw@127.0.0.1:1/0"
    specs = {s.name: s for s in ctl.role_specs(a)}
    flag = str(tmp_path / "tiny" / "cores" / "trainer.idle")
    rollout, trainer = specs["rollout-0"].env, specs["trainer"].env
    assert rollout["ASYNCRL_ROLLOUT__ENGINE_THREADS"] == "1" and rollout[WIDE_ENV] == "2" and rollout[FLAG_ENV] == flag
    assert trainer["OMP_NUM_THREADS"] == "1" and trainer[FLAG_ENV] == flag and WIDE_ENV not in trainer
    # split (the default) sets none of it
    split_cfg = load_config(["--config", str(TINY), "--output_dir", str(tmp_path / "split")])
    plain = {s.name: s for s in Controller(split_cfg, resumed=False).role_specs(assign_resources(split_cfg, available=[0, 1]))}
    assert FLAG_ENV not in plain["rollout-0"].env and FLAG_ENV not in plain["trainer"].env


def test_the_trainer_holds_the_flag_exactly_while_it_waits_for_a_batch(tmp_path, tiny_model_dir, tiny_model,  # noqa: F811
                                                                        monkeypatch):
    from trainer.loop import ListBatchSource, train_loop
    from trainer.trainer import Trainer

    flag = tmp_path / "cores" / "trainer.idle"
    flag.parent.mkdir()
    flag.touch()  # left behind by a killed trainer: cleared at start
    monkeypatch.setenv(FLAG_ENV, str(flag))
    seen: list[tuple[str, bool]] = []

    class Source(ListBatchSource):
        def next_batch(self, step):
            seen.append(("wait", flag.exists()))
            return super().next_batch(step)

    cfg = make_cfg(tmp_path, tiny_model_dir)
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model))
    try:
        vocab = tiny_model.config.vocab_size
        source = Source([make_groups(2, vocab, seed=s, versions=s) for s in range(2)])
        train_loop(trainer, source, max_steps=2, on_step=lambda m: seen.append(("step", flag.exists())))
    finally:
        trainer.close()
    assert seen == [("wait", True), ("step", False), ("wait", True), ("step", False)]
    assert not flag.exists()


def test_the_engine_generates_with_the_wide_threads_while_the_flag_exists(tmp_path, tiny_model_dir, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_server.engine import Engine
    from rollout_server.engine_sample import EngineGroup, EngineSample
    from rollout_server.sampling import SamplingParams

    flag = tmp_path / "trainer.idle"
    monkeypatch.setenv(FLAG_ENV, str(flag))
    monkeypatch.setenv(WIDE_ENV, "2")
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    eng = Engine(model, None, context_len=256, max_batch_size=4, threads=1).start()

    def generate(rid: str) -> EngineSample:
        s = EngineSample(rid, [5, 6, 7], SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True))
        eng.submit([EngineGroup(s.prompt_ids, [s])])
        deadline = time.monotonic() + 60
        while not s.finished:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        return s

    try:
        assert eng.follower is not None and eng.follower.threads == 1
        generate("narrow")
        assert eng.follower.threads == 1 and eng.stats["follow_switches_total"] == 0
        flag.touch()
        wide = generate("wide")
        assert len(wide.output_ids) == 8 and eng.follower.threads == 2 and eng.stats["follow_switches_total"] == 1
        os.unlink(flag)
        generate("narrow-again")
        assert eng.follower.threads == 1 and eng.stats["follow_switches_total"] == 2
        assert eng.error is None
    finally:
        eng.stop()
