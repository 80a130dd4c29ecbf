"""``data.check_verifier_status`` is wired: a train batch whose rewards are all 0 stops the trainer
with exit status 2 (never restarted by the controller) and a message that says what to check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from asyncrl.core.config import load_config
from asyncrl.tasks.rewards import VerifierStatusError
from tests.test_trainer import make_groups
from trainer.batch import prepare_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _zero(groups):
    for g in groups:
        for s in g["samples"]:
            s["reward"] = 0.0
    return groups


def _cfg(check: bool):
    return load_config([], overrides={"data": {"check_verifier_status": check}, "rollout": {"n_samples_per_prompt": 2}})


def test_all_zero_rewards_raise_when_the_check_is_on():
    with pytest.raises(VerifierStatusError, match=r"every reward of the train batch \(6 samples\) is 0"):
        prepare_batch(_zero(make_groups(3, 50)), _cfg(True), 0)
    assert len(prepare_batch(_zero(make_groups(3, 50)), _cfg(False), 0).samples) == 6


def test_one_nonzero_reward_passes_and_failed_samples_do_not_count():
    groups = _zero(make_groups(3, 50))
    groups[2]["samples"][1]["reward"] = 1.0
    assert len(prepare_batch(groups, _cfg(True), 0).samples) == 6
    # the only non-zero reward belongs to a failed sample: the scored ones are all 0 (its group,
    # left with one sample, is skipped by GRPO: 4 samples remain)
    groups[2]["samples"][1]["error"] = "verifier timeout"
    groups[2]["samples"][1]["reward"] = None
    with pytest.raises(VerifierStatusError, match=r"\(4 samples\)"), pytest.warns(UserWarning, match="reward_error"):
        prepare_batch(groups, _cfg(True), 0)


@pytest.mark.slow
def test_the_trainer_exits_2_on_a_broken_verifier(tmp_path, tiny_model_dir):
    (tmp_path / "batches.jsonl").write_text(json.dumps(_zero(make_groups(3, 700))) + "\n")
    cfg = {"model": {"path": str(tiny_model_dir)}, "run": {"output_dir": str(tmp_path / "runs"), "total_steps": 1},
           "rollout": {"n_samples_per_prompt": 2}, "data": {"check_verifier_status": True},
           "monitoring": {"jsonl": True, "progress": False}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, ASYNCRL_TRAINER_BATCHES=str(tmp_path / "batches.jsonl"), DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "trainer", "--config", str(tmp_path / "cfg.yaml")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "step 1: every reward of the train batch (6 samples) is 0" in proc.stderr
    assert "data.check_verifier_status=false" in proc.stderr
    from asyncrl.controller.roles import FATAL_EXIT_CODES

    assert 2 in FATAL_EXIT_CODES  # the controller's supervisor never restarts it
