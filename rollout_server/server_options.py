"""The embedded server's options and command line (``python -m rollout_server.server`` flags).

One job: what one embedded server is told to be. The flags mirror SGLang's names (both
``--flag-name`` and ``--flag_name`` spellings); the resource limits are
:class:`rollout_server.limits.ServerLimits` (docs/rollout.md#limits).
"""

from __future__ import annotations

import os

import argparse
import logging
import sys
import warnings

from rollout_server.limits import ServerLimits, add_limit_arguments, limits_from_args

__all__ = ["ServerOptions", "parse_args"]


class ServerOptions:
    """Options of one embedded server (the CLI flags mirror SGLang's names; ``limits``: docs/rollout.md#limits)."""

    def __init__(
        self,
        model_path: str,
        host: str = "127.0.0.1",
        port: int = 30000,
        api_key: str | None = None,
        incremental_streaming_output: bool = False,
        weight_version: str = "default",
        max_running_requests: int = 64,
        context_length: int | None = None,
        engine_threads: int | None = None,
        random_seed: int = 0,
        served_model_name: str | None = None,
        stream_interval: int = 1,
        skip_tokenizer_init: bool = False,
        limits: ServerLimits | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_loaded_loras: int = 8,
        scheduler_delay_factor: float = 0.0,
    ):
        self.model_path = str(model_path)
        self.host, self.port = host, int(port)
        self.api_key = api_key or None
        self.incremental_streaming_output = bool(incremental_streaming_output)
        self.weight_version = str(weight_version)
        self.max_running_requests = int(max_running_requests)
        self.context_length = context_length
        self.engine_threads = engine_threads
        self.random_seed = int(random_seed)
        self.served_model_name = served_model_name or self.model_path
        self.stream_interval = int(stream_interval)
        self.skip_tokenizer_init = bool(skip_tokenizer_init)
        self.limits = limits or ServerLimits()
        #: where the engine runs (SGLang's ``--device``): ``cpu``, or ``cuda`` / ``cuda:N`` on a GPU machine
        self.device = str(device)
        #: the engine's weights (SGLang's ``--dtype``): float32 by default (exact behaviour logprobs)
        self.dtype = str(dtype)
        #: most named LoRA adapters registered at once (SGLang's ``--max-loaded-loras``; engine_lora.py)
        self.max_loaded_loras = int(max_loaded_loras)
        if not 1 <= self.max_loaded_loras <= 1024:
            raise ValueError(f"--max-loaded-loras must be in [1, 1024], got {self.max_loaded_loras}")
        #: admission batching of the embedded engine (vLLM's ``--scheduler-delay-factor``; rollout_server/engine.py)
        self.scheduler_delay_factor = float(scheduler_delay_factor)
        if not 0.0 <= self.scheduler_delay_factor <= 1000.0:
            raise ValueError(f"--scheduler-delay-factor must be in [0, 1000] (a multiple of the last prefill's "
                             f"duration), got {scheduler_delay_factor}")



def parse_args(argv: list[str] | None = None, description: str = "") -> ServerOptions:
    """SGLang-style flags (both ``--flag-name`` and ``--flag_name`` spellings)."""
    ap = argparse.ArgumentParser(prog="python -m rollout_server.server", description=description)
    def add(name: str, **kw):
        ap.add_argument(f"--{name}", f"--{name.replace('-', '_')}", **kw)
    add("model-path", required=True, help="HF model directory (or a name known to asyncrl models)")
    add("host", default="127.0.0.1")
    add("port", type=int, default=30000)
    # the key comes from the environment (ASYNCRL_ENGINE_API_KEY, what rollout_server.launch sets):
    # a --api-key on the command line is visible to every user in `ps`
    add("api-key", default=os.environ.get("ASYNCRL_ENGINE_API_KEY") or None)
    add("incremental-streaming-output", action="store_true", help="stream deltas instead of cumulative chunks")
    add("weight-version", default="default")
    add("max-running-requests", type=int, default=64)
    add("context-length", type=int, default=None)
    add("engine-threads", type=int, default=None)
    add("random-seed", type=int, default=0)
    add("served-model-name", default=None)
    add("stream-interval", type=int, default=1)
    add("skip-tokenizer-init", action="store_true", help="input_ids only; responses carry no text (SGLang's flag)")
    add("device", default="cpu", help="where the engine runs: cpu (default), cuda or cuda:N (SGLang's flag)")
    add("dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="the engine's weight dtype (default float32: exact behaviour logprobs)")
    add("max-loaded-loras", type=int, default=8,
        help="most named LoRA adapters loaded at once (/load_lora_adapter; SGLang's flag)")
    add("scheduler-delay-factor", type=float, default=0.0,
        help="while rows decode, admit waiting requests once the oldest has waited this many times the last "
             "prefill's duration (vLLM's flag; 0: at every step; docs/rollout.md)")
    add("log-level", default="info")
    add_limit_arguments(add)
    a = ap.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    if any(x.split("=", 1)[0] in ("--api-key", "--api_key") for x in given):  # as `asyncrl train` warns
        warnings.warn("--api-key puts a secret on the command line, where every user sees it in `ps`: set "
                      "ASYNCRL_ENGINE_API_KEY instead (docs/security.md)", stacklevel=2)
    logging.basicConfig(level=getattr(logging, a.log_level.upper(), logging.INFO))
    return ServerOptions(
        model_path=a.model_path, host=a.host, port=a.port, api_key=a.api_key,
        incremental_streaming_output=a.incremental_streaming_output, weight_version=a.weight_version,
        max_running_requests=a.max_running_requests, context_length=a.context_length,
        engine_threads=a.engine_threads, random_seed=a.random_seed, served_model_name=a.served_model_name,
        stream_interval=a.stream_interval, skip_tokenizer_init=a.skip_tokenizer_init, limits=limits_from_args(a),
        device=a.device, dtype=a.dtype, max_loaded_loras=a.max_loaded_loras,
        scheduler_delay_factor=a.scheduler_delay_factor,
    )
