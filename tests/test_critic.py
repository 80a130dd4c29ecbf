"""The critic (trainer/critic.py): the value model on the policy's packed layout, and PPO with GAE
through the Trainer — values, advantages and targets against an independent per-sample loop,
the value loss falling, checkpoints round-tripping the critic, and config validation."""

from __future__ import annotations

import pytest
import torch

from tests.test_trainer import tiny_model  # noqa: F401 - the module-scoped fixture
from trainer.attention import BLOCK_ATTENTION
from trainer.critic import load_value_model
from trainer.packing import build_micro_batch, packed_values

PROMPTS = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [9, 8]]
RESPONSES = [[5, 6, 7], [10, 11], [12], [13, 14, 15, 16]]


def _unpacked_values(model, prompt, response):
    """V(s_t) for each response token: the value head at the position before the token."""
    ids = torch.tensor([prompt + response[:-1]])
    scores = model(input_ids=ids, use_cache=False).logits[0, :, 0]
    return scores[len(prompt) - 1:]


@pytest.fixture(scope="module")
def value_model(tiny_model_dir):
    model = load_value_model(tiny_model_dir)
    torch.nn.init.normal_(model.score.weight, std=0.5, generator=torch.Generator().manual_seed(0))  # a visible head
    return model


def test_value_model_is_the_backbone_with_a_scalar_head(value_model, tiny_model_dir):
    from asyncrl.models import load_causal_lm

    lm = load_causal_lm(tiny_model_dir, "float32")
    assert value_model.score.out_features == 1
    assert value_model.config.classifier_dropout == 0.0
    for name, p in lm.model.named_parameters():  # the backbone is the policy's
        assert torch.equal(p, dict(value_model.model.named_parameters())[name]), name


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", BLOCK_ATTENTION])
def test_packed_values_equal_per_sample_values(value_model, share, attn):
    value_model.set_attn_implementation(attn)
    try:
        packed = build_micro_batch(PROMPTS, RESPONSES, [0, 1, 2, 3], share_prompts=share)
        got = packed_values(value_model, packed)
        value_model.set_attn_implementation("sdpa")
        for local, start, end in packed.token_offsets:
            want = _unpacked_values(value_model, PROMPTS[local], RESPONSES[local])
            assert torch.allclose(got[start:end], want, atol=1e-5), (share, attn, local)
    finally:
        value_model.set_attn_implementation("sdpa")


def test_packed_values_gradients_equal_per_sample(value_model):
    packed = build_micro_batch(PROMPTS, RESPONSES, [0, 1, 2, 3], share_prompts=True)
    value_model.zero_grad()
    packed_values(value_model, packed).square().sum().backward()
    got = {n: p.grad.clone() for n, p in value_model.named_parameters() if p.grad is not None}
    value_model.zero_grad()
    sum(_unpacked_values(value_model, p, r).square().sum() for p, r in zip(PROMPTS, RESPONSES)).backward()
    for n, p in value_model.named_parameters():
        if p.grad is not None:
            scale = float(p.grad.abs().max())  # fp32: compare relative to the gradient's size
            assert float((got[n] - p.grad).abs().max()) <= 1e-5 * max(scale, 1.0), n
    value_model.zero_grad()


# ---------------------------------------------------------------------------------------------
# PPO with GAE through the Trainer


def _gae_cfg(tmp_path, model_dir, **trainer):
    from tests.test_trainer import make_cfg

    base = {"advantage": "gae", "gae": {"discount": 1.0, "gae_lambda": 0.95},
            "critic": {"optimizer": {"lr": 1e-3}, "value_norm": False, "value_eps_clip": 0.2},
            "loss": {"correction": "decoupled", "importance_weight_cap": 5.0, "dual_clip_c": None}}
    for k, v in trainer.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return make_cfg(tmp_path, model_dir, **base)


def _independent_ppo_gae(policy, critic, groups, gamma, lam, cap):
    """Decoupled PPO (one optimizer step per batch: pi_prox = pi_theta) with GAE advantages and the
    value loss, token mean over the batch — written without trainer code."""
    pg_terms, v_terms = [], []
    for g in groups:
        p = len(g["prompt_ids"])
        for s in g["samples"]:
            ids = torch.tensor([g["prompt_ids"] + s["response_ids"][:-1]])
            resp = torch.tensor(s["response_ids"])
            logp = torch.log_softmax(policy(input_ids=ids).logits[0, p - 1:].float(), -1).gather(-1, resp[:, None])[:, 0]
            values = critic(input_ids=ids).logits[0, p - 1:, 0]
            v = values.detach().double()
            T = len(s["response_ids"])
            rewards = [0.0] * (T - 1) + [s["reward"]]
            deltas = [rewards[t] + gamma * (float(v[t + 1]) if t + 1 < T else 0.0) - float(v[t]) for t in range(T)]
            adv = torch.tensor([sum((gamma * lam) ** (l - t) * deltas[l] for l in range(t, T)) for t in range(T)])
            returns = adv + v
            behav = torch.tensor(s["behaviour_logprobs"])
            w = torch.clamp(torch.exp(logp.detach() - behav), max=cap)
            u = torch.exp(logp - logp.detach())
            pg_terms.append(-(w * torch.min(u * adv.float(), torch.clamp(u, 0.8, 1.28) * adv.float())))
            v_terms.append(0.5 * (values - returns.float()) ** 2)  # V == V_old: the clip is inactive
    return torch.cat(pg_terms).mean(), torch.cat(v_terms).mean()


def test_ppo_gae_step_matches_an_independent_loop_with_a_value_head(tmp_path, tiny_model_dir, tiny_model, value_model):
    import copy

    from tests.test_trainer import make_groups
    from trainer.trainer import Trainer

    cfg = _gae_cfg(tmp_path, tiny_model_dir, micro_batch_tokens=16)
    # stale samples: tokens of versions 0 and 1 trained at version 2 — their values are the
    # current critic's, recomputed now (the independent loop runs the current value model)
    groups = make_groups(4, tiny_model.config.vocab_size, versions=1, stale_first=0)
    policy, critic = copy.deepcopy(tiny_model).train(), copy.deepcopy(value_model).train()
    value_model.set_attn_implementation("sdpa")
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model), critic_model=copy.deepcopy(value_model))
    trainer.step = 2
    plan = trainer.begin_step(groups)
    assert plan.metrics["staleness_max"] == 2.0
    (mb,) = plan.minibatches
    assert len(mb.micro_batches) >= 2  # packed over several micro-batches
    metrics = trainer.forward_backward(mb)
    pg, vl = _independent_ppo_gae(policy, critic, groups, 1.0, 0.95, 5.0)
    (pg + vl).backward()
    assert metrics["loss"] == pytest.approx(float(pg.detach()), rel=1e-5, abs=1e-7)
    assert metrics["value_loss"] == pytest.approx(float(vl.detach()), rel=1e-5)
    for module, independent in ((trainer.module, policy), (trainer.critic.engine.module, critic)):
        for (name, p), (_, q) in zip(module.named_parameters(), independent.named_parameters()):
            err = float((p.grad - q.grad).abs().max()) / max(float(q.grad.abs().max()), 1e-12)
            assert err <= 1e-5, name  # relative to the gradient's largest entry (fp32)
    out = trainer.optim_step(lr=1e-3)
    assert out["critic_grad_norm"] > 0 and out["critic_lr"] == 1e-3 and trainer.step == 3
    trainer.close()


def test_value_loss_falls_and_explained_variance_rises(tmp_path, tiny_model_dir, tiny_model, value_model):
    import copy

    from tests.test_trainer import make_groups
    from trainer.trainer import Trainer

    cfg = _gae_cfg(tmp_path, tiny_model_dir, adv_norm=True,
                   critic={"value_norm": True, "value_norm_type": "ma", "optimizer": {"lr": 1e-3}})
    critic = copy.deepcopy(value_model)
    torch.nn.init.zeros_(critic.score.weight)  # the critic starts at V = 0, as a fresh value head nearly does
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model), critic_model=critic)
    groups = make_groups(4, tiny_model.config.vocab_size, versions=0)
    history = []
    for _ in range(12):
        trainer.step = 0  # the same on-policy batch each time: the critic fits its returns
        plan = trainer.begin_step(groups)
        fb = trainer.forward_backward(plan.minibatches[0])
        trainer.optim_step(lr=1e-6)
        history.append((fb["value_loss"], plan.metrics["explained_variance"]))
        adv = torch.cat([s.advantages[s.loss_mask > 0] for s in plan.batch.samples])
        assert float(adv.mean()) == pytest.approx(0.0, abs=1e-5) and float(adv.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
    losses = [h[0] for h in history]
    assert all(b < a for a, b in zip(losses, losses[1:])), history  # falls at every step
    assert losses[-1] < 0.6 * losses[0], history
    assert history[-1][1] > history[0][1] + 0.3, history
    trainer.close()


def test_critic_checkpoint_round_trips_and_mismatches_are_refused(tmp_path, tiny_model_dir, tiny_model, value_model):
    import copy
    import shutil

    from tests.test_trainer import make_groups
    from trainer.loop import ListBatchSource, train_loop
    from trainer.trainer import CheckpointError, Trainer

    cfg = _gae_cfg(tmp_path, tiny_model_dir, checkpoint_interval=2, keep_checkpoints=2,
                   critic={"value_norm": True, "optimizer": {"lr": 1e-3}},
                   kl_ctl={"coef": 0.05, "adaptive": True, "adaptive_target": 0.01, "adaptive_horizon": 100})
    vocab = tiny_model.config.vocab_size
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model), critic_model=copy.deepcopy(value_model))
    train_loop(trainer, ListBatchSource([make_groups(2, vocab, seed=s) for s in range(2)]), max_steps=2)
    assert trainer.step == 2 and trainer.critic.kl.value != 0.05  # the adaptive coefficient moved
    saved = {k: v.detach().clone() for k, v in trainer.critic.engine.module.state_dict().items()}
    state = trainer.critic.state()
    trainer.close()

    restored = Trainer(cfg, model=copy.deepcopy(tiny_model), critic_model=copy.deepcopy(value_model))
    restored.load_checkpoint()
    assert restored.step == 2 and restored.critic.state() == state
    for k, v in restored.critic.engine.module.state_dict().items():
        assert torch.equal(v, saved[k]), k
    restored.close()

    ckpt = tmp_path / "t" / "checkpoints" / "step00000002"
    shutil.rmtree(ckpt / "critic")
    again = Trainer(cfg, model=copy.deepcopy(tiny_model), critic_model=copy.deepcopy(value_model))
    with pytest.raises(CheckpointError, match="has no critic"):
        again.load_checkpoint()
    again.close()


def test_reference_follows_the_actor_by_ema_and_is_checkpointed(tmp_path, tiny_model_dir, tiny_model, value_model):
    import copy

    from tests.test_trainer import make_groups
    from trainer.trainer import Trainer

    cfg = _gae_cfg(tmp_path, tiny_model_dir, kl_ctl={"coef": 0.1}, reference={"ema_eta": 0.25})
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model), critic_model=copy.deepcopy(value_model))
    ref_before = {k: v.clone() for k, v in trainer.ref_model.state_dict().items()}
    plan = trainer.begin_step(make_groups(2, tiny_model.config.vocab_size))
    assert plan.metrics["kl_ctl"] == 0.1 and "kl_penalty_per_sample" in plan.metrics
    trainer.forward_backward(plan.minibatches[0])
    trainer.optim_step(lr=1e-2)
    actor = dict(trainer.module.named_parameters())
    moved = 0
    for name, p in trainer.ref_model.named_parameters():
        expected = 0.75 * ref_before[name] + 0.25 * actor[name].detach()
        assert torch.allclose(p, expected, atol=1e-6), name
        moved += int(not torch.equal(p, ref_before[name]))
    assert moved > 0
    trainer.save_checkpoint()
    ref_after = {k: v.clone() for k, v in trainer.ref_model.state_dict().items()}
    trainer.close()
    restored = Trainer(cfg, model=copy.deepcopy(tiny_model), critic_model=copy.deepcopy(value_model))
    restored.load_checkpoint()
    for k, v in restored.ref_model.state_dict().items():
        assert torch.equal(v, ref_after[k]), k
    restored.close()


@pytest.mark.parametrize("overrides, match", [
    ({"trainer": {"kl_ctl": {"coef": 0.1}}}, "only a per-token estimator"),
    ({"trainer": {"reference": {"ema_eta": 0.1}}}, "no reference model is used"),
    ({"trainer": {"advantage": "gae", "critic": {"value_norm_type": "ema"}}}, "value_norm_type"),
    ({"trainer": {"advantage": "gae", "gae": {"gae_lambda": 1.5}}}, "gae_lambda"),
])
def test_config_rejects_inconsistent_critic_settings(overrides, match):
    from asyncrl.core.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match=match):
        load_config([], overrides=overrides)
