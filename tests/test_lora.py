"""LoRA (``trainer.lora``, issue 30 items 1-2): a PEFT adapter trained by the real DeepSpeed trainer,
published adapter-only (disk and http), merged by a real embedded rollout server process, whose
logprobs of a fixed completion must equal the trainer's to 1e-4 (tiny random model, fp32)."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
import torch

from asyncrl.core.config import ConfigError, load_config
from asyncrl.core.weights import ADAPTER_WEIGHTS_FILE, download_weights, verify_weights_dir
from rollout_server.client import EngineError
from rollout_server.testing import start_embedded_server
from tests.test_rollout_worker import models, server_a, tokenizer  # noqa: F401 (fixtures)
from tests.test_trainer import make_cfg, make_groups, tiny_model  # noqa: F401 (fixture)
from trainer.loop import ListBatchSource, train_loop

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9]
COMPLETION = [11, 3, 17, 2, 30, 8, 8, 21]
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


def _lora_cfg(tmp_path, model_dir, transport="disk", **trainer):
    cfg = make_cfg(tmp_path, model_dir, optimizer={"lr": 5e-2}, lora=LORA, **trainer)
    return cfg.model_copy(update={"weight_sync": cfg.weight_sync.model_copy(update={"transport": transport})})


def _completion_logprobs(model) -> list[float]:
    """log p(COMPLETION[t] | PROMPT + COMPLETION[:t]) by a plain forward pass (fp32, temperature 1)."""
    ids = torch.tensor([PROMPT + COMPLETION])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lsm = torch.log_softmax(logits, -1)
    return [float(lsm[len(PROMPT) - 1 + t, tok]) for t, tok in enumerate(COMPLETION)]


async def _engine_logprobs(client) -> list[float]:
    out = await client.generate(PROMPT + COMPLETION, {"max_new_tokens": 1, "temperature": 0},
                                logprob_start_len=len(PROMPT) - 1)
    vals = out["meta_info"]["input_token_logprobs"]
    assert vals[0][0] is None and [v[1] for v in vals[1:]] == COMPLETION
    return [v[0] for v in vals[1:]]


def _train_one_step(trainer, vocab):
    train_loop(trainer, ListBatchSource([make_groups(2, vocab)]), max_steps=1)


def _train_and_publish(cfg, tiny_model) -> tuple[list[float], list[tuple]]:
    """One LoRA step of a fresh trainer on ``cfg``: the trained policy's logprobs of COMPLETION
    (``_completion_logprobs`` of the PEFT engine, eval mode) and the ``(version, uri, checksum)``
    announcements the trainer made (the trainer is closed)."""
    from trainer.trainer import Trainer

    announced: list[tuple] = []
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model), announce=lambda v, u, c: announced.append((v, u, c)))
    try:
        _train_one_step(trainer, tiny_model.config.vocab_size)
        trainer.module.eval()
        want = _completion_logprobs(trainer.engine)
    finally:
        trainer.close()
    return want, announced


def test_lora_config_is_off_by_default_and_refuses_what_it_cannot_do(tmp_path, tiny_model_dir):
    assert make_cfg(tmp_path, tiny_model_dir).trainer.lora is None
    with pytest.raises(ConfigError, match="ema_eta"):
        load_config([], overrides={"trainer": {"lora": {}, "reference": {"ema_eta": 0.5}}})


def test_adapter_only_sync_over_disk_matches_trainer_logprobs(tmp_path, tiny_model_dir, tiny_model):
    """The trainer trains only the adapter (its reference is the base with the adapter disabled),
    publishes only the adapter, and the engine merged into its base gives the trainer's logprobs."""
    from trainer.trainer import Trainer

    server = start_embedded_server(tiny_model_dir)
    try:
        announced = []
        cfg = _lora_cfg(tmp_path, tiny_model_dir, loss={"kl_coef": 0.1})
        trainer = Trainer(cfg, model=copy.deepcopy(tiny_model), announce=lambda v, u, c: announced.append((v, u, c)))
        try:
            trainable = {n for n, p in trainer.module.named_parameters() if p.requires_grad}
            assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
            _train_one_step(trainer, tiny_model.config.vocab_size)
            trainer.module.eval()
            want = _completion_logprobs(trainer.engine)
            # the reference: the same module with the adapter disabled == the base model, bit for bit
            assert _completion_logprobs(trainer.ref_model) == _completion_logprobs(tiny_model)
        finally:
            trainer.close()
        (version, uri, checksum), = announced
        assert version == 1
        verify_weights_dir(uri, checksum)
        files = sorted(p.name for p in (trainer.weights_dir / "v000001").iterdir())
        assert files == ["SHA256SUMS", "adapter_config.json", ADAPTER_WEIGHTS_FILE]
        adapter_cfg = json.loads((trainer.weights_dir / "v000001" / "adapter_config.json").read_text())
        assert adapter_cfg["r"] == 4 and adapter_cfg["peft_type"] == "LORA"
        base = _completion_logprobs(tiny_model)
        assert max(abs(a - b) for a, b in zip(want, base)) > 1e-3  # the adapter changed the policy

        async def go():
            async with server.client() as c:
                res = await c.update_weights_from_disk(uri, weight_version="1")
                assert res["lora_adapter"]["checksum"] == checksum and res["lora_adapter"]["version"] == "1"
                assert res["lora_adapter"]["modules"] == 4 * tiny_model.config.num_hidden_layers
                got = await _engine_logprobs(c)
                info = await c._request("GET", "/get_model_info", None, 30)
                return got, info

        got, (_, info) = asyncio.run(go())
        assert info["weight_version"] == "1" and info["lora_adapter"]["checksum"] == checksum
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    finally:
        server.stop()


def test_adapters_do_not_compound_and_bad_adapters_fail_loudly(tmp_path, tiny_model_dir, tiny_model):
    """Version 2's adapter is merged into the base, not into version 1's merge; an adapter that does
    not fit is refused with 400 and changes nothing; full weights put the base back."""
    from trainer.trainer import Trainer

    server = start_embedded_server(tiny_model_dir)
    try:
        announced = []
        trainer = Trainer(_lora_cfg(tmp_path, tiny_model_dir), model=copy.deepcopy(tiny_model),
                          announce=lambda v, u, c: announced.append((v, u, c)))
        try:
            train_loop(trainer, ListBatchSource([make_groups(2, tiny_model.config.vocab_size, seed=s) for s in (0, 1)]),
                       max_steps=2)
            trainer.module.eval()
            want2 = _completion_logprobs(trainer.engine)
        finally:
            trainer.close()
        uris = {v: u for v, u, _ in announced}
        bad = tmp_path / "bad"
        bad.mkdir()
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(uris[2] + "/" + ADAPTER_WEIGHTS_FILE))
        name = next(n for n in tensors if n.endswith("lora_A.weight"))
        tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
        save_file(tensors, str(bad / ADAPTER_WEIGHTS_FILE))
        (bad / "adapter_config.json").write_text(open(uris[2] + "/adapter_config.json").read())

        async def go():
            async with server.client() as c:
                await c.update_weights_from_disk(uris[1], weight_version="1")
                await c.update_weights_from_disk(uris[2], weight_version="2")
                got2 = await _engine_logprobs(c)
                with pytest.raises(EngineError, match="do not fit"):
                    await c.update_weights_from_disk(str(bad), weight_version="3")
                still = await c.weight_version(), await _engine_logprobs(c)
                await c.update_weights_from_disk(str(tiny_model_dir), weight_version="0")
                info = await c._request("GET", "/get_model_info", None, 30)
                return got2, still, await _engine_logprobs(c), info

        got2, (v_after_bad, lp_after_bad), got0, (_, info) = asyncio.run(go())
        assert max(abs(a - b) for a, b in zip(got2, want2)) < 1e-4
        assert v_after_bad == "2" and lp_after_bad == got2
        assert info["lora_adapter"] is None
        assert max(abs(a - b) for a, b in zip(got0, _completion_logprobs(tiny_model))) < 1e-4
    finally:
        server.stop()


def test_adapter_only_sync_over_http(tmp_path, tiny_model_dir, tiny_model):
    from trainer.trainer import Trainer

    announced = []
    trainer = Trainer(_lora_cfg(tmp_path, tiny_model_dir, transport="http"), model=copy.deepcopy(tiny_model),
                      announce=lambda v, u, c: announced.append((v, u, c)))
    try:
        _train_one_step(trainer, tiny_model.config.vocab_size)
        trainer.module.eval()
        want = _completion_logprobs(trainer.engine)
        (version, uri, checksum), = announced
        assert uri.startswith("http://") and uri.endswith("/weights/v000001/")
        local = asyncio.run(download_weights(uri, checksum, tmp_path / "worker"))
        verify_weights_dir(local, checksum)
    finally:
        trainer.close()
    size = (local / ADAPTER_WEIGHTS_FILE).stat().st_size
    full = sum(p.numel() * 4 for p in tiny_model.parameters())
    assert size < full / 5  # adapter-only: a fraction of the model
    server = start_embedded_server(tiny_model_dir)
    try:
        async def go():
            async with server.client() as c:
                await c.update_weights_from_disk(str(local), weight_version="1")
                return await _engine_logprobs(c)

        got = asyncio.run(go())
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    finally:
        server.stop()


def _adam_moments(trainer) -> list[torch.Tensor]:
    """AdamW's exp_avg and exp_avg_sq of every optimized parameter, in parameter order (ZeRO 0)."""
    opt = trainer.engine.optimizer
    return [opt.state[p][k] for g in opt.param_groups for p in g["params"] for k in ("exp_avg", "exp_avg_sq")
            if p in opt.state]


def test_checkpoint_restores_adapter_and_optimizer_state(tmp_path, tiny_model_dir, tiny_model):
    from trainer.trainer import Trainer

    cfg = _lora_cfg(tmp_path, tiny_model_dir)
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model))
    try:
        _train_one_step(trainer, tiny_model.config.vocab_size)
        trainer.save_checkpoint()
        adapter = {n: p.detach().clone() for n, p in trainer.module.named_parameters() if p.requires_grad}
        opt_state = [t.clone() for t in _adam_moments(trainer)]
        assert opt_state and len(opt_state) == 2 * len(adapter)
        assert any(float(t.abs().sum()) > 0 for n, t in adapter.items() if "lora_B" in n)
    finally:
        trainer.close()
    resumed = Trainer(cfg, model=copy.deepcopy(tiny_model))
    try:
        assert resumed.load_checkpoint() is not None
        assert resumed.step == 1
        for n, p in resumed.module.named_parameters():
            if p.requires_grad:
                assert torch.equal(p.detach(), adapter[n]), n
        got = _adam_moments(resumed)
        assert len(got) == len(opt_state) and all(torch.equal(a, b) for a, b in zip(got, opt_state))
    finally:
        resumed.close()


def _publish_adapter(weights_dir, version, base_lm, seed, target_modules=("q_proj", "v_proj")):
    """A random PEFT adapter on ``base_lm`` published as ``version`` exactly as the trainer does;
    returns ``(path, checksum, the merged model)`` (PEFT's own ``merge_and_unload``)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from asyncrl.core.weights import write_weights
    from trainer.lora import adapter_config_json

    peft_model = get_peft_model(copy.deepcopy(base_lm), LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    path, checksum = write_weights(weights_dir, version, state, adapter_config_json(peft_model), adapter=True)
    return path, checksum, peft_model.merge_and_unload()


async def test_partial_rollout_resumes_under_the_adapter_and_a_bad_adapter_is_not_claimed(redis_url, server_a, models,
                                                                                           tokenizer, tmp_path):
    """A sample parked under v0 resumes under adapter v1 through the real worker: per-token
    versions [0]*4 + [1]*8, each token's logprob equal to its version's recomputation (v1 = PEFT's
    own merge). Then adapter v2 targets a module the model lacks: the engine refuses it (400), a
    worker syncing to it counts an error and does not take version 2, and the engine keeps v1."""
    from asyncrl.core.types import PromptGroup, SampleStatus
    from buffers import ReplayBuffer
    from rollout_server.testing import recompute_logprobs
    from tests.test_rollout_worker import TEMPERATURE, _feed, _prompt, _ready, _run_until, _settings, _worker

    server = server_a  # the base model (models["dir0"]) at version 0
    settings = _settings(n_samples_per_prompt=2, max_budget=4, max_response_len=12, flush_tokens=2)
    try:
        async with await ReplayBuffer.open(redis_url, "lora", settings) as buf:
            prompt = _prompt(tokenizer, "count to ten")
            await _feed(buf, [PromptGroup("g0", prompt, {}, 2)])
            w = _worker(buf, server.url, tokenizer, "w-lora", extra_sampling_params={"ignore_eos": True})
            items = await buf.claim("w-lora", 2)
            assert await asyncio.gather(*(w.process(it) for it in items)) == [SampleStatus.PARTIAL] * 2
            path, sha, merged1 = _publish_adapter(tmp_path / "weights", 1, models["lm0"], seed=3)
            await buf.clock.publish(1, str(path), sha)
            stats = await _run_until(w, _ready(buf, 1))
            assert stats.weight_updates == 1 and w.version == 1
            _, samples = await buf.get_group("g0")
            for s in samples:
                assert s.status == SampleStatus.SCORED and s.versions == [0] * 4 + [1] * 8, s.versions
                ref0 = recompute_logprobs(models["lm0"], prompt, s.response_ids, TEMPERATURE)
                ref1 = recompute_logprobs(merged1, prompt, s.response_ids, TEMPERATURE)
                got = s.behaviour_logprobs
                assert max(abs(a - b) for a, b in zip(ref0[:4], got[:4])) < 1e-4
                assert max(abs(a - b) for a, b in zip(ref1[4:], got[4:])) < 1e-4
                assert max(abs(a - b) for a, b in zip(ref0[4:], got[4:])) > 1e-3  # really the adapter

            bad, bad_sha, _ = _publish_adapter(tmp_path / "weights", 2, models["lm0"], seed=4)
            cfg = json.loads((bad / "adapter_config.json").read_text())
            from safetensors.torch import load_file

            from asyncrl.core.weights import write_weights

            tensors = {k.replace("q_proj", "no_such_proj"): v for k, v in load_file(str(bad / ADAPTER_WEIGHTS_FILE)).items()}
            import shutil

            shutil.rmtree(bad)
            bad, bad_sha = write_weights(tmp_path / "weights", 2, tensors, cfg, adapter=True)
            await buf.clock.publish(2, str(bad), bad_sha)
            await _feed(buf, [PromptGroup("g1", prompt, {}, 2)])
            w2 = _worker(buf, server.url, tokenizer, "w-lora2", extra_sampling_params={"ignore_eos": True})
            try:
                assert await w2.sync_weights(initial=True) is False
                assert w2.stats.weight_update_errors >= 1 and w2.version != 2
                assert await w2.client.weight_version() == "1"
            finally:
                await w2.client.close()
            await w.client.close()
    finally:
        async with server.client() as c:
            await c.update_weights_from_disk(str(models["dir0"]), weight_version="0")


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_lora_under_zero_publishes_the_adapter_peft_loads(tmp_path, tiny_model_dir, tiny_model, zero_stage):
    """Under ZeRO-2 and ZeRO-3 (parameters partitioned, gathered for the publish) the published
    directory is a PEFT adapter: ``PeftModel.from_pretrained`` on the base gives the trainer's logprobs."""
    from peft import PeftModel

    want, announced = _train_and_publish(_lora_cfg(tmp_path, tiny_model_dir, zero_stage=zero_stage,
                                                   loss={"kl_coef": 0.1}), tiny_model)
    (_, uri, _), = announced
    loaded = PeftModel.from_pretrained(copy.deepcopy(tiny_model), uri).eval()
    got = _completion_logprobs(loaded)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert max(abs(a - b) for a, b in zip(got, _completion_logprobs(tiny_model))) > 1e-3


def test_adapter_only_sync_over_nccl_on_gloo_matches_trainer_logprobs(tmp_path, tiny_model_dir, tiny_model):
    """``nccl`` over gloo: the trainer broadcasts only the adapter into a running engine, which
    merges it, reports its checksum and gives the trainer's logprobs to 1e-4."""
    server = start_embedded_server(tiny_model_dir)
    try:
        cfg = _lora_cfg(tmp_path, tiny_model_dir, transport="nccl")
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"server_urls": [server.url]})})
        want, announced = _train_and_publish(cfg, tiny_model)
        (version, uri, checksum), = announced
        verify_weights_dir(uri, checksum)  # durable on disk as well

        async def go():
            async with server.client() as c:
                _, info = await c._request("GET", "/get_model_info", None, 30)
                return info, await _engine_logprobs(c)

        info, got = asyncio.run(go())
        assert info["weight_version"] == "1" and info["lora_adapter"]["checksum"] == checksum
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        assert max(abs(a - b) for a, b in zip(got, _completion_logprobs(tiny_model))) > 1e-3
    finally:
        server.stop()


def test_evaluation_merges_a_published_adapter_into_its_base(tmp_path, tiny_model_dir, tiny_model, capsys):
    """A LoRA run publishes adapters only: the controller's held-out evaluation and ``asyncrl eval
    --model ADAPTER_DIR`` merge the adapter into the base (the trainer's logprobs to 1e-4); a
    directory that is not an adapter, or an adapter naming no base, fails with a clear error."""
    from asyncrl.controller.controller import Controller
    from asyncrl.evaluation.cli import main as eval_main
    from asyncrl.models import CorruptModelError, adapter_base, is_adapter_dir, load_causal_lm, merge_adapter

    cfg = _lora_cfg(tmp_path, tiny_model_dir)
    want, announced = _train_and_publish(cfg, tiny_model)
    (_, uri, _), = announced
    assert is_adapter_dir(uri) and not is_adapter_dir(tiny_model_dir)
    assert adapter_base(uri) == str(tiny_model_dir)
    ctl = Controller(cfg, resumed=False)
    merged = ctl._eval_model_dir(uri)  # <run_dir>/eval/model: base + adapter, full weights
    assert merged.endswith("eval/model") and not is_adapter_dir(merged)
    got = _completion_logprobs(load_causal_lm(merged))
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    # asyncrl eval on the adapter directory itself (its temporary merge is removed afterwards)
    capsys.readouterr()
    assert eval_main(["--model", uri, "--num_problems", "4", "--modes", "greedy", "--max_new_tokens", "4",
                      "--json", "--threads", "1"]) == 0
    [res] = json.loads(capsys.readouterr().out)
    assert res["n"] == 4 and 0.0 <= res["accuracy"] <= 1.0
    # failures name what is wrong
    with pytest.raises(CorruptModelError, match="not a LoRA adapter directory"):
        merge_adapter(tiny_model_dir, tiny_model_dir, tmp_path / "m")
    bad = tmp_path / "nobase"
    bad.mkdir()
    for f in ("adapter_config.json", ADAPTER_WEIGHTS_FILE):
        (bad / f).write_bytes(Path(uri, f).read_bytes())
    conf = json.loads((bad / "adapter_config.json").read_text())
    conf.pop("base_model_name_or_path")
    (bad / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(CorruptModelError, match="names no base model"):
        adapter_base(bad)
    assert eval_main(["--model", str(bad), "--num_problems", "4", "--json"]) == 1
    assert "names no base model" in capsys.readouterr().err
