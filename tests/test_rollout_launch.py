"""Launching rollout engines: SGLang's command line from the config (checked against SGLang's
documented flags), the embedded engine through ``launch_servers``, readiness errors, the
client's error paths, and — where a GPU and SGLang exist — the real SGLang server."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.core.config import load_config
from asyncrl.core.net import free_port
from rollout_server.client import EngineClient, EngineError, EngineUnavailable
from rollout_server.launch import engine_command, launch_servers, stop_servers
from rollout_server.sglang import SGLANG_DOCUMENTED_FLAGS, sglang_available, sglang_command


def _flags(cmd: list[str]) -> list[tuple[str, str | None]]:
    """Parse ``--flag [value]`` pairs after ``-m module``, using the documented arity."""
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    out, i, rest = [], 0, cmd[3:]
    while i < len(rest):
        flag = rest[i]
        assert flag in SGLANG_DOCUMENTED_FLAGS, f"{flag} is not a documented SGLang server flag"
        if SGLANG_DOCUMENTED_FLAGS[flag] == "+":  # one or more values
            j = i + 1
            while j < len(rest) and not rest[j].startswith("--"):
                j += 1
            assert j > i + 1, f"{flag} needs a value"
            out.append((flag, " ".join(rest[i + 1:j])))
            i = j
        elif SGLANG_DOCUMENTED_FLAGS[flag]:
            assert i + 1 < len(rest) and not rest[i + 1].startswith("--"), f"{flag} needs a value"
            out.append((flag, rest[i + 1]))
            i += 2
        else:
            out.append((flag, None))
            i += 1
    return out


def test_sglang_command_from_config():
    cfg = load_config(overrides={
        "model": {"path": "x", "dtype": "bfloat16", "max_context_len": 4096},
        "run": {"seed": 7},
        "rollout": {"engine": "sglang", "sglang_tp_size": 2, "sglang_mem_fraction_static": 0.8, "host": "0.0.0.0",
                    "engine_max_batch_size": 128, "api_key_required": True},
        "security": {"api_key": "tok"},
    })
    cmd = sglang_command(cfg, "/models/m", 30001, weight_version=5, python="python3")
    flags = dict(_flags(cmd))
    assert flags == {
        "--model-path": "/models/m", "--host": "0.0.0.0", "--port": "30001", "--tp-size": "2", "--dtype": "bfloat16",
        "--max-running-requests": "128", "--weight-version": "5", "--random-seed": "7", "--enable-metrics": None,
        "--skip-server-warmup": None, "--incremental-streaming-output": None, "--mem-fraction-static": "0.8",
        "--context-length": "4096", "--api-key": "tok",
    }
    # defaults: no key unless required, cumulative streaming when incremental is off, extra args verbatim
    cfg = load_config(overrides={"rollout": {"incremental_streaming": False, "sglang_args": ["--log-level", "warning"]}})
    flags = dict(_flags(sglang_command(cfg, "/m", 30000)))
    assert "--api-key" not in flags and "--incremental-streaming-output" not in flags
    assert flags["--log-level"] == "warning" and flags["--dtype"] == "float32"
    assert "--enable-lora" not in flags


def test_sglang_command_enables_lora_for_adapters_by_name():
    """trainer.lora on SGLang: adapters loaded later must fit rank and target modules given at launch, and
    max_staleness + 2 adapters fit (the worker keeps max_staleness + 1, one more while it loads the next)."""
    cfg = load_config(overrides={"rollout": {"engine": "sglang"}, "buffer": {"max_staleness": 2},
                                 "trainer": {"lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]},
                                             "loss": {"correction": "decoupled"}}})
    assert cfg.resolved_lora_mode() == "by_name"
    flags = dict(_flags(sglang_command(cfg, "/m", 30000)))
    assert flags["--enable-lora"] is None and flags["--max-lora-rank"] == "8"
    assert flags["--lora-target-modules"] == "q_proj v_proj"
    assert flags["--max-loaded-loras"] == flags["--max-loras-per-batch"] == "4"
    from rollout_server.server import parse_args

    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": "torch", "lora_mode": "by_name"})})
    assert parse_args(engine_command(cfg, "/m", 31000)[3:]).max_loaded_loras == 4


def test_embedded_command_mirrors_sglang_flags(monkeypatch):
    from rollout_server.server import parse_args

    cfg = load_config(overrides={"rollout": {"engine_threads": 2, "api_key_required": True},
                                 "security": {"api_key": "k"}})
    cmd = engine_command(cfg, "/m", 31000, weight_version=3)
    assert cmd[1:3] == ["-m", "rollout_server.server"]
    assert "--api-key" not in cmd and "k" not in cmd  # never on the command line (`ps`)
    monkeypatch.setenv("ASYNCRL_ENGINE_API_KEY", "k")  # launch_servers passes it in the environment
    opts = parse_args(cmd[3:])
    assert (opts.model_path, opts.port, opts.weight_version, opts.api_key, opts.engine_threads) == ("/m", 31000, "3", "k", 2)
    assert opts.incremental_streaming_output is True
    assert (opts.device, opts.dtype) == ("cpu", "float32")  # no rollout GPUs: the engine runs on the CPU


def test_embedded_engine_runs_on_cuda_when_given_rollout_gpus():
    from rollout_server.server import parse_args

    cfg = load_config(overrides={"resources": {"rollout_gpus": [0]}})
    opts = parse_args(engine_command(cfg, "/m", 31000)[3:])
    assert opts.device == "cuda" and opts.dtype == "float32"
    assert parse_args(["--model-path", "/m", "--device", "cuda:1", "--dtype", "bfloat16"]).device == "cuda:1"


async def test_launch_sglang_without_sglang_fails_clearly():
    if sglang_available():
        pytest.skip("sglang is installed here; the missing-sglang error path cannot be exercised")
    cfg = load_config(overrides={"rollout": {"engine": "sglang"}})
    with pytest.raises(RuntimeError, match="SGLang is not installed"):
        await launch_servers(cfg, model_path="/nonexistent")


@pytest.mark.integration
async def test_launch_embedded_and_attach(tiny_model_dir, tmp_path):
    cfg = load_config(overrides={"rollout": {"base_port": 0, "num_servers": 1, "engine_threads": 1}})
    handles = await launch_servers(cfg, model_path=str(tiny_model_dir), weight_version=4, log_dir=tmp_path)
    try:
        async with EngineClient(handles[0].url) as c:
            assert await c.weight_version() == "4"
            assert await c.incremental_streaming() is True
        attached = await launch_servers(load_config(overrides={"rollout": {"server_urls": [handles[0].url]}}))
        assert attached[0].url == handles[0].url and attached[0].process is None
    finally:
        stop_servers(handles)
    assert handles[0].process.poll() is not None


@pytest.mark.integration
async def test_launch_failure_is_reported(tmp_path):
    cfg = load_config(overrides={"rollout": {"base_port": 0, "engine_threads": 1}})
    with pytest.raises(EngineUnavailable, match="exited"):
        await launch_servers(cfg, model_path=str(tmp_path / "missing-model"), log_dir=tmp_path, ready_timeout_seconds=60)


async def test_client_errors():
    port = free_port()
    async with EngineClient(f"http://127.0.0.1:{port}", timeout_seconds=2) as c:
        assert await c.health() is False
        with pytest.raises(EngineUnavailable):
            await c.model_info()
        with pytest.raises(EngineUnavailable, match="not ready"):
            await c.wait_ready(timeout_seconds=0.5, poll_seconds=0.1)
        with pytest.raises(EngineUnavailable):
            async for _ in c.generate_stream([1, 2]):
                pass
    err = EngineError(400, "input_ids cannot be empty.", "http://x/generate")
    assert err.status == 400 and "input_ids" in str(err)


def _gpu_and_sglang() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return "torch missing"
    if not torch.cuda.is_available():
        return "needs a CUDA gpu"
    if not sglang_available():
        return "needs sglang (pip install 'asyncrl[sglang]')"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_and_sglang() is not None, reason=f"gpu/sglang: {_gpu_and_sglang()}")
async def test_real_sglang_server(tiny_model_dir, tmp_path):
    """The real thing: launch SGLang from the config, drive it with the same client (both
    streaming modes detected), abort, pause/continue, weight update from disk, and the NCCL
    weight-update choreography from this process (rank 0)."""
    import torch

    from asyncrl.core.weights import DistributedWeightSender, load_state_dict_from_dir

    cfg = load_config(overrides={"rollout": {"engine": "sglang", "base_port": 0, "sglang_mem_fraction_static": 0.3}})
    handles = await launch_servers(cfg, model_path=str(tiny_model_dir), weight_version=0, log_dir=tmp_path,
                                   ready_timeout_seconds=900)
    try:
        async with EngineClient(handles[0].url) as c:
            assert await c.incremental_streaming() is True
            res = await c.generate_collect([1, 2, 3], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert len(res.token_ids) == 8 and res.finish_type == "length" and res.versions == ["0"] * 8
            task = asyncio.create_task(c.generate([1, 2, 3], {"max_new_tokens": 4000, "ignore_eos": True}))
            await asyncio.sleep(1.0)
            await c.pause("abort")
            out = await task
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            await c.update_weights_from_disk(str(tiny_model_dir), weight_version="1")
            await c.resume()
            assert await c.weight_version() == "1"
        sender = DistributedWeightSender([handles[0].url], "127.0.0.1", free_port(), backend="nccl")
        await sender.init()
        state = {k: v.cuda() for k, v in load_state_dict_from_dir(tiny_model_dir).items()}
        await sender.send(state, version="2")
        await sender.close()
        async with EngineClient(handles[0].url) as c:
            assert await c.weight_version() == "2"
        del torch
    finally:
        stop_servers(handles)

