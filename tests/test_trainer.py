"""The Trainer on the tiny model with real DeepSpeed (CPU, gloo): decoupled PPO on a stale
batch against an independent formula, the loop's phases and early stop, checkpoints."""

from __future__ import annotations

import copy
import json
import math
import sys
import threading

import pytest
import torch

from asyncrl.core.config import load_config
from asyncrl.core.weights import list_versions, verify_weights_dir
from trainer.loop import ListBatchSource, train_loop


def make_cfg(tmp_path, model_dir, **trainer):
    over = {
        "model": {"path": str(model_dir)},
        "run": {"output_dir": str(tmp_path), "name": "t", "total_steps": 10},
        "rollout": {"n_samples_per_prompt": 2},
        "buffer": {"max_staleness": 4, "stale_policy": "keep"},
        "trainer": {"micro_batch_tokens": 24, "optimizer": {"lr": 1e-3}, **trainer},
        "monitoring": {"jsonl": True},
    }
    return load_config([], overrides=over)


def make_groups(n_groups, vocab, seed=0, versions=0, stale_first=None, behav_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        prompt = torch.randint(3, vocab, (3 + gi % 3,), generator=g).tolist()
        samples = []
        for si in range(2):
            r = 2 + (gi + 2 * si) % 4
            v = [versions] * r
            if stale_first is not None:
                v[0] = stale_first
            samples.append({
                "sample_id": f"g{seed}-{gi}-{si}", "index": si,
                "response_ids": torch.randint(3, vocab, (r,), generator=g).tolist(),
                "behaviour_logprobs": (-(torch.rand(r, generator=g) * 3 + 5.5) * behav_scale).tolist(),
                "versions": v, "finish_reason": "stop" if si == 0 else "length", "reward": float((gi + si) % 2),
            })
        groups.append({"group_id": f"g{seed}-{gi}", "prompt_ids": prompt, "samples": samples})
    return groups


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from asyncrl.models import load_causal_lm

    return load_causal_lm(tiny_model_dir, "float32")


def _independent_loss(model, groups, prox_model, cap, eps_l, eps_h, version):
    """Decoupled PPO (AReaL eq. 5), token mean, dr_grpo advantages, written without trainer code."""
    terms = []
    for g in groups:
        rewards = [s["reward"] for s in g["samples"]]
        mean = sum(rewards) / len(rewards)
        for s in g["samples"]:
            ids = torch.tensor([g["prompt_ids"] + s["response_ids"]])
            p = len(g["prompt_ids"])
            resp = torch.tensor(s["response_ids"])
            logits = model(input_ids=ids).logits[0, p - 1:-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, resp[:, None])[:, 0]
            with torch.no_grad():
                pl = torch.log_softmax(prox_model(input_ids=ids).logits[0, p - 1:-1].float(), -1)
                prox = pl.gather(-1, resp[:, None])[:, 0]
            behav = torch.tensor(s["behaviour_logprobs"])
            adv = s["reward"] - mean
            u = torch.exp(logp - prox)
            w = torch.clamp(torch.exp(prox - behav), max=cap)
            obj = torch.min(u * adv, torch.clamp(u, 1 - eps_l, 1 + eps_h) * adv)
            terms.append(-(w * obj))
    return torch.cat(terms).mean()


def test_decoupled_ppo_on_stale_batch_matches_independent_formula(tmp_path, tiny_model_dir, tiny_model):
    from trainer.trainer import Trainer

    cfg = make_cfg(tmp_path, tiny_model_dir, advantage="dr_grpo", ppo_n_minibatches=2, micro_batch_tokens=16,
                   loss={"correction": "decoupled", "importance_weight_cap": 1.5, "dual_clip_c": None})
    vocab = tiny_model.config.vocab_size
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model))
    trainer.step = 3  # weights being trained are version 3; tokens are from versions 1 and 2
    groups = make_groups(4, vocab, versions=2, stale_first=1, behav_scale=1.0)
    initial = copy.deepcopy(trainer.module).eval()
    plan = trainer.begin_step(groups)
    assert plan.metrics["staleness_max"] == 2.0
    assert len(plan.minibatches) == 2 and all(len(mb.micro_batches) >= 2 for mb in plan.minibatches)
    mb_groups = [groups[:2], groups[2:]]
    for k, mb in enumerate(plan.minibatches):
        assert [plan.batch.samples[i].group_id for i in mb.sample_indices] == [g["group_id"] for g in mb_groups[k] for _ in range(2)]
        reference = copy.deepcopy(trainer.module).eval()
        metrics = trainer.forward_backward(mb)
        expected = _independent_loss(reference, mb_groups[k], initial, 1.5, 0.2, 0.28, 3)
        expected.backward()
        assert metrics["loss"] == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-7)
        for (name, p), (_, q) in zip(trainer.module.named_parameters(), reference.named_parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), name
        assert metrics["importance_weight_max"] > 1.5 and metrics["importance_weight_capped_fraction"] > 0
        if k == 0:
            assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # pi_theta == pi_prox before any step
        else:
            assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-6)
        om = trainer.optim_step(lr=1e-3)
        assert om["lr"] == 1e-3 and math.isfinite(om["grad_norm"]) and om["grad_norm"] > 0
    assert trainer.step == 4 and trainer.optimizer_steps == 2
    with pytest.raises(RuntimeError, match="begin_step"):
        trainer.forward_backward(plan.minibatches[0])
    trainer.close()


def test_loop_phases_publish_ack_checkpoint_resume_and_stop(tmp_path, tiny_model_dir, tiny_model):
    from trainer.trainer import CheckpointError, Trainer

    cfg = make_cfg(tmp_path, tiny_model_dir, checkpoint_interval=2, keep_checkpoints=1,
                   loss={"correction": "tis"})
    vocab = tiny_model.config.vocab_size
    announced = []
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model), announce=lambda v, uri, c: announced.append((v, uri, c)))
    batches = [make_groups(2, vocab, seed=s, versions=s) for s in range(4)]
    source = ListBatchSource(batches)
    result = train_loop(trainer, source, max_steps=2)
    assert result.reason == "max_steps" and trainer.step == 2
    assert [a[0] for a in announced] == [1, 2]
    for v, uri, checksum in announced:
        verify_weights_dir(uri, checksum)
    assert source.acknowledged == [(1, ["g0-0", "g0-1"]), (2, ["g1-0", "g1-1"])]
    assert source.committed == [2]
    rec = result.history[-1]
    for key in ("wait_batch_seconds", "forward_backward_seconds", "optim_step_seconds", "publish_weights_seconds",
                "checkpoint_seconds", "loss", "grad_norm", "lr", "reward_mean", "importance_weight_mean",
                "behaviour_kl", "entropy", "advantage_mean", "processed_tokens", "clip_fraction"):
        assert key in rec, key
    if sys.platform == "linux":  # the resident memory the OOM killer weighs: the step's peak covers the end
        assert 0 < rec["memory_resident_gb"] <= rec["memory_peak_resident_gb"] + 0.01 < 64  # VmHWM lags a little
    lines = (tmp_path / "t" / "metrics" / "trainer.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1.0, 2.0]

    saved = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    opt_state = [s["exp_avg"].clone() for s in trainer.engine.optimizer.state.values()]
    rng_after_save = torch.get_rng_state()
    # one more step (uncheckpointed), then a crash-like restore
    train_loop(trainer, source, max_steps=1)
    assert trainer.step == 3 and list_versions(trainer.weights_dir)[-1] == 3
    changed = [k for k, v in trainer.module.state_dict().items() if not torch.equal(v, saved[k])]
    assert changed, "the third step did not change the weights"
    extra = trainer.load_checkpoint()
    assert extra == {"cursor": 2}
    assert trainer.step == 2 and trainer.optimizer_steps == 2 and trainer.published_version == 2
    for k, v in trainer.module.state_dict().items():
        assert torch.equal(v, saved[k]), k
    for s, ref in zip(trainer.engine.optimizer.state.values(), opt_state):
        assert torch.equal(s["exp_avg"], ref)
    assert torch.equal(torch.get_rng_state(), rng_after_save)
    assert list_versions(trainer.weights_dir)[-1] == 2  # abandoned version 3 removed
    with pytest.raises(CheckpointError, match="no checkpoint"):
        trainer.load_checkpoint("step99999999")

    # SIGTERM semantics: the stop flag ends the loop after checkpointing, normally
    source.load_state_dict(extra)
    stop = threading.Event()
    stop.set()
    res = train_loop(trainer, source, stop=stop)
    assert res.reason == "stopped" and res.steps == 0
    assert (trainer.checkpoint_dir / "latest").read_text() == "step00000002"
    assert sorted(p.name for p in trainer.checkpoint_dir.iterdir() if p.is_dir()) == ["step00000002"]
    assert (trainer.checkpoint_dir / "step00000002" / "config.yaml").is_file()

    # a kill -9 between step 2's checkpoint and its line (here: the line lost, a torn fragment
    # left): the resume writes the record kept with the checkpoint, once
    jsonl_path = tmp_path / "t" / "metrics" / "trainer.jsonl"
    jsonl_path.write_text(lines[0] + "\n" + '{"step": 2.0, "lo')
    assert trainer.load_checkpoint() == {"cursor": 2} and trainer.checkpoint_step_record["step"] == 2.0
    for _ in range(2):
        assert train_loop(trainer, source, stop=stop).steps == 0
        restored = [json.loads(x) for x in jsonl_path.read_text().splitlines()]
        assert [r["step"] for r in restored] == [1.0, 2.0]
        assert restored[1]["record_restored"] == 1.0 and "checkpoint_seconds" not in restored[1]
        assert {k: v for k, v in restored[1].items() if k != "record_restored"} == {
            k: v for k, v in rec.items() if k not in ("checkpoint_seconds",)}
    trainer.close()


def test_early_stop_on_importance_ratio(tmp_path, tiny_model_dir, tiny_model):
    from trainer.trainer import Trainer

    cfg = make_cfg(tmp_path, tiny_model_dir, ppo_n_minibatches=2, early_stop_imp_ratio=2.0,
                   loss={"correction": "mask_stale"})
    vocab = tiny_model.config.vocab_size
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model))
    groups = make_groups(4, vocab)
    for g in groups[2:]:  # the second mini-batch's behaviour policy is far below the trainer's
        for s in g["samples"]:
            s["behaviour_logprobs"] = [-30.0] * len(s["response_ids"])
    source = ListBatchSource([groups])
    res = train_loop(trainer, source, max_steps=1)
    assert trainer.step == 1 and trainer.optimizer_steps == 1
    assert res.history[0]["early_stopped"] == 1.0 and res.history[0]["early_stopped_at_minibatch"] == 1.0
    trainer.close()


@pytest.mark.parametrize("loss", [{"correction": "gspo"}, {"correction": "decoupled", "importance_weight_mode": "mask"},
                                  {"correction": "gspo", "importance_weight_mode": "mask"}])
def test_sequence_level_and_masked_importance_weights_train(tmp_path, tiny_model_dir, tiny_model, loss):
    """GSPO's sequence ratios and masked IS run through the real trainer (two mini-batches, so the
    proximal policy differs from the trained one), and tokens far off the behaviour policy are
    masked rather than trained at the cap."""
    from trainer.trainer import Trainer

    cfg = make_cfg(tmp_path, tiny_model_dir, ppo_n_minibatches=2, loss=loss)
    vocab = tiny_model.config.vocab_size
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model))
    before = {k: v.detach().clone() for k, v in trainer.module.named_parameters()}
    groups = make_groups(4, vocab)
    for s in groups[0]["samples"]:  # a behaviour policy far below the trainer's: weights >> cap
        s["behaviour_logprobs"] = [-30.0] * len(s["response_ids"])
    res = train_loop(trainer, ListBatchSource([groups]), max_steps=1)
    h = res.history[0]
    assert trainer.optimizer_steps == 2 and math.isfinite(h["loss"])
    masked = h["importance_weight_masked_fraction"]
    if loss.get("importance_weight_mode") == "mask":
        assert 0.0 < masked < 1.0  # the far-off group left the loss, the others stayed
    else:
        assert masked == 0.0 and h["importance_weight_capped_fraction"] > 0.0
    assert any(not torch.equal(before[k], v) for k, v in trainer.module.named_parameters())
    trainer.close()
