"""``asyncrl rollout-server --config F [flags]``: one rollout server = engine + rollout worker.

Two modes, chosen by the config:

* **embedded** (``rollout.server_urls`` empty): this process serves the embedded torch engine
  (SGLang's HTTP API, :mod:`rollout_server.server`) on ``rollout.host`` and port
  ``rollout.base_port + server_index`` (``base_port`` 0: a free port), with the model of
  ``model.path`` and ``rollout.engine_threads`` torch threads, and runs one
  :class:`rollout_server.worker.RolloutWorker` against it over loopback HTTP. The engine's
  ``/metrics`` also carries the worker's ``asyncrl_rollout_*`` metrics.
* **attached** (``rollout.server_urls`` set, SGLang or embedded servers started elsewhere):
  worker only. ``--server_index i`` attaches to URL ``i``; without it the process runs one worker
  per URL (one worker per engine: a weight-update pause is per engine). ``--metrics_port P``
  serves the worker metrics (0: a free port).

Flags besides the config tree's: ``--server_index I`` (default 0), ``--worker_id ID`` (default
``<hostname>-<pid>-<i>``), ``--metrics_port P``. The Redis URL is ``buffer.redis_url``
(``--redis_url``), the run ``run.name``.

At start it checks that ``rollout.max_response_len`` fits the model's context
(:func:`asyncrl.models.check_context`; the feeder rejects prompts that do not leave room).

SIGTERM / SIGINT (explicit handlers, so it works as PID 1 in a container) drain: stop
claiming, abort this worker's engine requests, park every in-flight sample as PARTIAL with all
its tokens, print ``parked N in-flight samples``, stop the engine, exit 0. Exit 1 when the
worker stops on an error (the message says why), 2 for a bad command line or config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from typing import Any

__all__ = ["main", "run_rollout_server"]

_OWN_FLAGS = ("server_index", "worker_id", "metrics_port")


def _split_own_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Take ``--server_index``/``--worker_id``/``--metrics_port`` out of ``argv``.

    Raises:
        ValueError: a flag without a value.
    """
    own: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        if key in _OWN_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"--{key} needs a value")
                value = argv[i + 1]
                i += 1
            own[key] = value
        else:
            rest.append(arg)
        i += 1
    return own, rest


def _print(msg: str) -> None:
    print(f"asyncrl rollout-server: {msg}", flush=True)


async def run_rollout_server(cfg: Any, server_index: int = 0, worker_id: str | None = None,
                             metrics_port: int | None = None, stop: asyncio.Event | None = None) -> int:
    """Run engine + worker (or workers attached to URLs) until ``stop`` or SIGTERM; returns the exit code.

    Raises:
        asyncrl.config.ConfigError: ``max_response_len`` does not fit the model's context.
        asyncrl.models.ModelNotFoundError: ``model.path`` cannot be resolved.
    """
    from asyncrl.metrics import role_registry, start_metrics_server
    from asyncrl.models import check_context, load_tokenizer, resolve_model_path
    from asyncrl.rewards import RewardScorer
    from buffers import BufferSettings, ReplayBuffer
    from rollout_server.client import EngineClient
    from rollout_server.worker import RolloutWorker, WorkerError, WorkerOptions

    r = cfg.rollout
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    model_path = str(resolve_model_path(cfg.model.path))
    context = check_context(cfg, max_prompt_tokens=1)
    scorer = RewardScorer.from_config(cfg.data)
    tokenizer = load_tokenizer(model_path)
    api_key = cfg.security.api_key if (r.api_key_required or r.server_urls) else None
    base_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"

    runner = None
    if r.server_urls:
        if server_index is not None and not 0 <= server_index < len(r.server_urls):
            raise ValueError(f"--server_index {server_index} is out of range: rollout.server_urls has "
                             f"{len(r.server_urls)} URLs")
        urls = list(r.server_urls) if server_index is None else [r.server_urls[server_index]]
        registry, metrics = role_registry("rollout")
        if metrics_port is not None:
            bound = start_metrics_server(registry, metrics_port, host=cfg.monitoring.metrics_host)
            _print(f"metrics on http://{cfg.monitoring.metrics_host}:{bound}/metrics")
        metrics_list = [metrics] + [None] * (len(urls) - 1)  # one process, one catalogue: the first worker's
    else:
        from aiohttp import web

        from rollout_server.launch import free_port
        from rollout_server.server import RolloutHTTPServer, ServerOptions

        index = server_index or 0
        port = free_port(r.host) if r.base_port == 0 else r.base_port + index
        opts = ServerOptions(
            model_path=model_path, host=r.host, port=port,
            api_key=cfg.security.api_key if r.api_key_required else None,
            incremental_streaming_output=r.incremental_streaming, weight_version="0",
            max_running_requests=r.engine_max_batch_size, context_length=context,
            engine_threads=r.engine_threads, random_seed=cfg.run.seed + index,
        )
        server = RolloutHTTPServer(opts)
        await loop.run_in_executor(None, server.load)
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, r.host, port)
        await site.start()
        urls = [f"http://{r.host}:{port}"]
        metrics_list = [server.rollout_metrics]
        _print(f"embedded engine serving {model_path} on {urls[0]}")

    buf = await ReplayBuffer.open(cfg.buffer.redis_url, run=cfg.run.name, settings=BufferSettings.from_config(cfg))
    clients = [EngineClient(u, api_key=api_key) for u in urls]
    workers = []
    code = 0
    try:
        for i, (client, metrics) in enumerate(zip(clients, metrics_list)):
            await client.wait_ready(timeout_seconds=600.0)
            idx = i if server_index is None else server_index
            opts_w = WorkerOptions.from_config(cfg, worker_id=f"{base_id}-{idx}",
                                               weights_cache_dir=cfg.run.run_dir / "weights_cache" / f"server{idx}")
            workers.append(RolloutWorker(buf, client, scorer, tokenizer, opts_w, metrics=metrics))
        for w in workers:
            _print(f"worker {w.opts.worker_id} on {w.client.url} (run {cfg.run.name!r}, "
                   f"{w.opts.max_inflight_requests} requests in flight)")

        results = await asyncio.gather(*(w.run(stop) for w in workers), return_exceptions=True)
        for w, res in zip(workers, results):
            if isinstance(res, BaseException):
                code = 1
                print(f"asyncrl rollout-server: worker {w.opts.worker_id} stopped: {res}", file=sys.stderr, flush=True)
            elif stop.is_set():
                _print(f"drained {w.opts.worker_id}: parked {len(res.drained)} in-flight samples "
                       f"[{','.join(sorted(res.drained))}]; {res.segments} segments, {res.completed} completed, "
                       f"{res.generated_tokens} tokens")
        if any(isinstance(res, WorkerError) for res in results):
            code = 1
    finally:
        for c in clients:
            await c.close()
        await buf.close()
        if runner is not None:
            await runner.cleanup()
    return code


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl rollout-server``; returns the exit code."""
    from asyncrl.config import ConfigError
    from asyncrl.config_cli import config_from_argv

    try:
        own, rest = _split_own_flags(list(argv))
        server_index = int(own["server_index"]) if "server_index" in own else None
        metrics_port = int(own["metrics_port"]) if "metrics_port" in own else None
    except ValueError as exc:
        print(f"asyncrl rollout-server: {exc} (--server_index and --metrics_port take integers)", file=sys.stderr)
        return 2
    cfg = config_from_argv(rest, "rollout-server")
    if isinstance(cfg, int):
        if cfg == 0:
            print("\nrollout-server flags: --server_index I (port base_port+I, or URL I of rollout.server_urls), "
                  "--worker_id ID, --metrics_port P (attached mode)")
        return cfg
    if not cfg.buffer.redis_url:
        print("asyncrl rollout-server: buffer.redis_url is not set (--redis_url redis://:PASSWORD@HOST:PORT/0)",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not cfg.rollout.server_urls and server_index is None:
        server_index = 0
    try:
        return asyncio.run(run_rollout_server(cfg, server_index, own.get("worker_id"), metrics_port))
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"asyncrl rollout-server: {exc}", file=sys.stderr)
        return 2
