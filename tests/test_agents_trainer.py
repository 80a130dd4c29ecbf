"""Episodes in the trainer (issue 15): concat and stepwise losses against an independent loop,
the grouping hook, precomputed step advantages (real DeepSpeed on CPU, the tiny model)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from asyncrl.core.config import load_config
from trainer.batch import TrainGroup, prepare_batch


def make_cfg(tmp_path, model_dir, representation="concat", hook=None):
    over = {
        "model": {"path": str(model_dir)},
        "run": {"output_dir": str(tmp_path), "name": "t", "total_steps": 10},
        "rollout": {"n_samples_per_prompt": 2},
        "buffer": {"max_staleness": 4, "stale_policy": "keep"},
        "trainer": {"micro_batch_tokens": 40, "optimizer": {"lr": 1e-3}, "advantage": "dr_grpo",
                    "loss": {"correction": "decoupled", "importance_weight_cap": 1.5, "dual_clip_c": None}},
        "agent": {"workflow": "agent_workflows:three_turns", "representation": representation,
                  "trajectory_grouping_hook": hook},
    }
    return load_config([], overrides=over)


def episode_groups(vocab, seed=0, n_groups=2):
    """Groups of two episodes each: call (3) | obs (2) | call (2) | obs (1) | call (2)."""
    g = torch.Generator().manual_seed(seed)
    layout = [(0, 3, "turn"), (3, 5, "obs"), (5, 7, "turn"), (7, 8, "obs"), (8, 10, "turn")]
    groups = []
    for gi in range(n_groups):
        prompt = torch.randint(3, vocab, (4,), generator=g).tolist()
        samples = []
        for si in range(2):
            ids = torch.randint(3, vocab, (10,), generator=g).tolist()
            lps = (-(torch.rand(10, generator=g) * 3 + 4.5)).tolist()
            for a, b, r in layout:
                if r == "obs":
                    lps[a:b] = [0.0] * (b - a)
            samples.append({"sample_id": f"e{gi}/{si}", "index": si, "response_ids": ids, "behaviour_logprobs": lps,
                            "versions": [2] * 10, "finish_reason": "stop", "reward": float((gi + si) % 2),
                            "segments": layout, "info": {"termination": "env_done", "turns": 3, "tool_calls": 1}})
        groups.append({"group_id": f"e{gi}", "prompt_ids": prompt, "samples": samples})
    return groups, [(0, 3), (5, 7), (8, 10)]


def independent_loss(model, prox_model, groups, calls, cap=1.5, eps_l=0.2, eps_h=0.28):
    """Decoupled PPO, token mean over model tokens only, dr_grpo advantages — no trainer code."""
    terms = []
    for grp in groups:
        mean = sum(s["reward"] for s in grp["samples"]) / len(grp["samples"])
        for s in grp["samples"]:
            ids = torch.tensor([grp["prompt_ids"] + s["response_ids"]])
            p = len(grp["prompt_ids"])
            resp = torch.tensor(s["response_ids"])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, p - 1:-1].float(), -1).gather(-1, resp[:, None])[:, 0]
            with torch.no_grad():
                prox = torch.log_softmax(prox_model(input_ids=ids).logits[0, p - 1:-1].float(), -1).gather(
                    -1, resp[:, None])[:, 0]
            behav = torch.tensor(s["behaviour_logprobs"])
            model_tok = torch.zeros(len(resp), dtype=torch.bool)
            for a, b in calls:
                model_tok[a:b] = True
            adv = s["reward"] - mean
            u = torch.exp(logp - prox)
            w = torch.clamp(torch.exp(prox - behav), max=cap)
            obj = torch.min(u * adv, torch.clamp(u, 1 - eps_l, 1 + eps_h) * adv)
            terms.append(-(w * obj)[model_tok])
    return torch.cat(terms).mean()


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from asyncrl.models import load_causal_lm

    return load_causal_lm(tiny_model_dir, "float32")


@pytest.mark.parametrize("representation", ["concat", "stepwise"])
def test_episode_loss_matches_independent_loop(representation, tmp_path, tiny_model_dir, tiny_model):
    from trainer.trainer import Trainer

    cfg = make_cfg(tmp_path, tiny_model_dir, representation)
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model))
    trainer.step = 3
    groups, calls = episode_groups(tiny_model.config.vocab_size)
    initial = copy.deepcopy(trainer.module).eval()
    plan = trainer.begin_step(copy.deepcopy(groups))
    samples = plan.batch.samples
    if representation == "stepwise":
        assert len(samples) == 4 * 3
        s0 = samples[0]
        first = groups[0]["samples"][0]
        assert [len(s.response_ids) for s in samples[:3]] == [3, 2, 2]
        assert samples[1].prompt_ids == groups[0]["prompt_ids"] + first["response_ids"][:5]
        assert samples[2].response_ids == first["response_ids"][8:10] and s0.sample_id == "e0/0#0"
        assert all(float(s.loss_mask.sum()) == len(s.response_ids) for s in samples)
    else:
        assert len(samples) == 4
        assert samples[0].loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 1, 1]
    assert plan.metrics["episode_turns_mean"] == 3.0 and plan.metrics["episode_tool_calls_mean"] == 1.0
    reference = copy.deepcopy(trainer.module).eval()
    total = 0.0
    for mb in plan.minibatches:
        total += trainer.forward_backward(mb)["loss"]
    expected = independent_loss(reference, initial, groups, calls)
    expected.backward()
    assert total == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-7)
    for (name, p), (_, q) in zip(trainer.module.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), name
    trainer.close()


def swap_rewards(groups: list[TrainGroup]) -> list[TrainGroup]:
    """A grouping hook: one group of every episode, rewards replaced by the number of model calls."""
    samples = [s for g in groups for s in g.samples]
    for s in samples:
        s.reward = float(len(s.call_spans)) + (0.5 if s.index == 0 else 0.0)
    return [TrainGroup("all", groups[0].prompt_ids, samples)]


def test_grouping_hook_regroups_and_rescores(tmp_path, tiny_model_dir, tiny_model):
    cfg = make_cfg(tmp_path, tiny_model_dir, hook="test_agents_trainer:swap_rewards")
    groups, _ = episode_groups(tiny_model.config.vocab_size)
    batch = prepare_batch(groups, cfg, 3)
    assert batch.group_ids == ["all"]
    # dr_grpo over one group of 4: rewards 3.5, 3, 3.5, 3 -> advantages +-0.25
    assert sorted({round(float(p.advantages[0]), 4) for p in batch.samples}) == [-0.25, 0.25]
    bad = make_cfg(tmp_path, tiny_model_dir, hook="test_agents_trainer:bad_hook")
    with pytest.raises(ValueError, match="non-empty list"):
        prepare_batch(groups, bad, 3)


def bad_hook(groups):
    return None


def test_precomputed_step_advantages_skip_the_estimator_and_partial_ones_fall_back(tmp_path, tiny_model_dir, tiny_model):
    cfg = make_cfg(tmp_path, tiny_model_dir)
    groups, _ = episode_groups(tiny_model.config.vocab_size, n_groups=1)
    for s in groups[0]["samples"]:
        s["advantages"] = [0.1 * i for i in range(10)]
    batch = prepare_batch(copy.deepcopy(groups), cfg, 3)
    assert batch.samples[0].advantages.tolist() == pytest.approx([0.1 * i for i in range(10)])
    groups[0]["samples"][1]["advantages"] = None
    with pytest.warns(UserWarning, match="re-estimating"):
        batch = prepare_batch(copy.deepcopy(groups), cfg, 3)
    assert batch.samples[0].advantages.tolist() == pytest.approx([-0.5] * 10)
    groups[0]["samples"][1]["advantages"] = [1.0] * 3
    with pytest.raises(Exception, match="e0/1"):
        prepare_batch(copy.deepcopy(groups), cfg, 3)


def test_precomputed_step_advantages_added_to_the_estimate(tmp_path, tiny_model_dir, tiny_model):
    """trainer.precomputed_advantages: add — the estimator's advantage from the rewards plus the
    workflow's per-token values (OPSD on top of GRPO); environment tokens stay out of the loss."""
    cfg = make_cfg(tmp_path, tiny_model_dir)
    cfg.trainer.precomputed_advantages = "add"
    groups, calls = episode_groups(tiny_model.config.vocab_size, n_groups=1)
    for s in groups[0]["samples"]:
        s["advantages"] = [0.1 * i for i in range(10)]
    batch = prepare_batch(copy.deepcopy(groups), cfg, 3)
    rewards = [s["reward"] for s in groups[0]["samples"]]  # dr_grpo: reward minus the group mean
    for ps, r in zip(batch.samples, rewards):
        want = [r - sum(rewards) / 2 + 0.1 * i for i in range(10)]
        assert ps.advantages.tolist() == pytest.approx(want)
        assert ps.loss_mask.tolist() == [1.0 if any(a <= i < b for a, b in calls) else 0.0 for i in range(10)]
