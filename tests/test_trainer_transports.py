"""Weight transports driven by the Trainer: ``nccl`` choreography over gloo into a real embedded
rollout server process, and ``http`` (the trainer serves files; a worker downloads and verifies)."""

from __future__ import annotations

import asyncio
import copy

import pytest

from asyncrl.core.weights import download_weights, verify_weights_dir
from rollout_server.testing import greedy_reference, start_embedded_server
from tests.test_trainer import make_cfg, make_groups, tiny_model  # noqa: F401 (fixture)
from trainer.loop import ListBatchSource, train_loop

pytestmark = pytest.mark.slow


def test_nccl_transport_over_gloo_updates_a_running_engine(tmp_path, tiny_model_dir, tiny_model):
    from asyncrl.models import load_causal_lm
    from trainer.trainer import Trainer

    server = start_embedded_server(tiny_model_dir)
    try:
        cfg = make_cfg(tmp_path, tiny_model_dir, optimizer={"lr": 5e-2})
        cfg = cfg.model_copy(update={"weight_sync": cfg.weight_sync.model_copy(update={"transport": "nccl"}),
                                     "rollout": cfg.rollout.model_copy(update={"server_urls": [server.url]})})
        announced = []
        trainer = Trainer(cfg, model=copy.deepcopy(tiny_model), announce=lambda v, u, c: announced.append((v, u, c)))
        try:
            train_loop(trainer, ListBatchSource([make_groups(2, tiny_model.config.vocab_size)]), max_steps=1)
        finally:
            trainer.close()
        (version, uri, checksum), = announced
        assert version == 1
        verify_weights_dir(uri, checksum)  # durable on disk as well
        prompt = [5, 6, 7, 8]
        published = load_causal_lm(uri)
        want_ids, want_lps = greedy_reference(published, prompt, 8)
        _, old_lps = greedy_reference(tiny_model, prompt, 8)

        async def ask():
            async with server.client() as c:
                return await c.weight_version(), await c.generate(prompt, {"max_new_tokens": 8, "temperature": 0,
                                                                            "ignore_eos": True})

        engine_version, out = asyncio.run(ask())
        assert engine_version == "1"
        got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert out["output_ids"] == want_ids
        assert max(abs(a - b) for a, b in zip(got, want_lps)) < 1e-4
        assert max(abs(a - b) for a, b in zip(want_lps, old_lps)) > 1e-3  # the update changed the policy
    finally:
        server.stop()


def test_http_transport_serves_published_versions(tmp_path, tiny_model_dir, tiny_model):
    from trainer.trainer import Trainer

    cfg = make_cfg(tmp_path, tiny_model_dir)
    cfg = cfg.model_copy(update={"weight_sync": cfg.weight_sync.model_copy(update={"transport": "http"})})
    announced = []
    trainer = Trainer(cfg, model=copy.deepcopy(tiny_model), announce=lambda v, u, c: announced.append((v, u, c)))
    try:
        train_loop(trainer, ListBatchSource([make_groups(2, tiny_model.config.vocab_size)]), max_steps=1)
        (version, uri, checksum), = announced
        assert uri.startswith("http://127.0.0.1:") and uri.endswith("/weights/v000001/")
        local = asyncio.run(download_weights(uri, checksum, tmp_path / "worker"))
        verify_weights_dir(local, checksum)
        assert (local / "model.safetensors").read_bytes() == (trainer.weights_dir / "v000001" / "model.safetensors").read_bytes()
    finally:
        trainer.close()
