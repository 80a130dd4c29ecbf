"""The rollout-server role: the embedded engine (or attached engines) and the rollout workers that feed them.

One job: :func:`run_rollout_server`, what ``asyncrl rollout-server`` runs once its command line
is parsed (:mod:`rollout_server.cli`).

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

At start it checks that ``rollout.max_response_len`` fits the model's context
(:func:`asyncrl.models.check_context`; the feeder rejects prompts that do not leave room).

A Redis that is down or restarting when the server starts is waited for (``buffer.outage_seconds``,
one WARNING line; :mod:`asyncrl.core.outage`); the worker itself retries its claims through an outage.
A stream the worker drops is logged as one INFO line (:class:`ClientDisconnectFilter`).

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

__all__ = ["ClientDisconnectFilter", "run_rollout_server"]


class ClientDisconnectFilter(logging.Filter):
    """Turns aiohttp's "Error handling request" ERROR + traceback for a client that closed its
    connection mid-response into one INFO line.

    The rollout worker closes an engine stream when it drops the sample (a Redis outage, a lost
    lease, a shutdown); the engine's next chunk then fails with ``ConnectionResetError``
    (aiohttp's ``ClientConnectionResetError``: "Cannot write to closing transport"), which aiohttp
    logged as an ERROR with a traceback — one per in-flight stream at every Redis restart. Nothing
    failed on the server: the sample is parked or reclaimed by the buffer. Other errors pass
    unchanged.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno >= logging.ERROR and isinstance(exc, (ConnectionResetError, BrokenPipeError)):
            message = record.getMessage()
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "%s: the client closed the connection mid-response (%s)", (message, exc)
            record.exc_info, record.exc_text = None, None
        return True


def quiet_client_disconnects(logger_name: str = "aiohttp.server") -> ClientDisconnectFilter:
    """Install :class:`ClientDisconnectFilter` on ``logger_name`` once; returns it."""
    logger = logging.getLogger(logger_name)
    for f in logger.filters:
        if isinstance(f, ClientDisconnectFilter):
            return f
    f = ClientDisconnectFilter()
    logger.addFilter(f)
    return f


def embedded_server_options(cfg: Any, model_path: str, port: int, index: int, context: int) -> Any:
    """The :class:`rollout_server.server_options.ServerOptions` of the in-process embedded server
    ``index`` of a run: the same ``rollout.engine_*`` settings a launched server gets as flags
    (:func:`rollout_server.launch.engine_command`), so a config means the same on either path."""
    from asyncrl.core.secret_values import reveal
    from rollout_server.launch import by_name_lora_slots
    from rollout_server.limits import limits_from_config
    from rollout_server.server_options import ServerOptions

    r = cfg.rollout
    return ServerOptions(
        model_path=model_path, host=r.host, port=port,
        api_key=reveal(cfg.security.api_key) if r.api_key_required else None,
        incremental_streaming_output=r.incremental_streaming, weight_version="0",
        max_running_requests=r.engine_max_batch_size, context_length=context,
        engine_threads=r.engine_threads, random_seed=cfg.run.seed + index,
        # resources.rollout_gpus: the controller exports them as CUDA_VISIBLE_DEVICES
        device="cuda" if cfg.resources.rollout_gpus else "cpu",
        limits=limits_from_config(r), scheduler_delay_factor=r.engine_scheduler_delay_factor,
        max_loaded_loras=by_name_lora_slots(cfg) if cfg.resolved_lora_mode() == "by_name" else 8,
    )


def _print(msg: str) -> None:
    print(f"asyncrl rollout-server: {msg}", flush=True)


async def run_rollout_server(cfg: Any, server_index: int = 0, worker_id: str | None = None,
                             metrics_port: int | None = None, stop: asyncio.Event | None = None) -> int:
    """Run engine + worker (or workers attached to URLs) until ``stop`` or SIGTERM; returns the exit code.

    Raises:
        asyncrl.core.config.ConfigError: ``max_response_len`` does not fit the model's context.
        asyncrl.models.ModelNotFoundError: ``model.path`` cannot be resolved.
    """
    from asyncrl.metrics import role_registry, start_metrics_server
    from asyncrl.models import check_context, load_tokenizer, resolve_model_path
    from asyncrl.tasks.rewards import RewardScorer
    from buffers import ReplayBuffer
    from rollout_server.client import EngineClient
    from rollout_server.worker import RolloutWorker, WorkerError, WorkerOptions

    r = cfg.rollout
    quiet_client_disconnects()  # a stream the worker dropped is not a server error
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    model_path = str(resolve_model_path(cfg.model.path))
    context = check_context(cfg, max_prompt_tokens=1)
    tokenizer = load_tokenizer(model_path)
    from asyncrl.core.secret_values import reveal

    scorer = RewardScorer.from_config(cfg.data, cfg.reward, reveal(cfg.security.api_key))

    api_key = reveal(cfg.security.api_key) if (r.api_key_required or r.server_urls) else None
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

        from asyncrl.core.net import SERVER_KWARGS, free_port
        from rollout_server.server import RolloutHTTPServer

        index = server_index or 0
        port = free_port(r.host) if r.base_port == 0 else r.base_port + index
        opts = embedded_server_options(cfg, model_path, port, index, context)
        server = RolloutHTTPServer(opts)
        await loop.run_in_executor(None, server.load)
        runner = web.AppRunner(server.app(), access_log=None, **SERVER_KWARGS)
        await runner.setup()
        site = web.TCPSite(runner, r.host, port)
        await site.start()
        urls = [f"http://{r.host}:{port}"]
        metrics_list = [server.rollout_metrics]
        _print(f"embedded engine serving {model_path} on {urls[0]}")

    from asyncrl.core.outage import DependencyOutage, OutageGuard

    guard = OutageGuard(f"rollout-server {server_index if server_index is not None else ''}".strip(),
                        cfg.buffer.outage_seconds)
    try:  # Redis restarting when this server starts: wait it out, not a crash
        buf = await guard.call(lambda: ReplayBuffer.open_for(cfg, role="rollout"),
                               "opening the run's buffer", give_up=stop.is_set)
    except DependencyOutage as exc:
        if runner is not None:
            await runner.cleanup()
        if stop.is_set():
            return 0
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    clients = [EngineClient(u, api_key=api_key) for u in urls]
    workers = []
    code = 0
    try:
        if scorer.reward_model is not None:  # no sample is scored before the reward model answers
            _print(f"waiting for the reward model at {scorer.reward_model.url}")
            await loop.run_in_executor(None, scorer.reward_model.wait_ready, 600.0)
        for i, (client, metrics) in enumerate(zip(clients, metrics_list)):
            await client.wait_ready(timeout_seconds=600.0)
            idx = i if server_index is None else server_index
            opts_w = WorkerOptions.from_config(cfg, worker_id=f"{base_id}-{idx}",
                                               weights_cache_dir=cfg.run.run_dir / "weights_cache" / f"server{idx}")
            worker = RolloutWorker(buf, client, scorer, tokenizer, opts_w, metrics=metrics)
            if cfg.agent.workflow:  # episodes of a multi-turn workflow (docs/agents.md)
                from asyncrl.agents.loader import load_workflow
                from rollout_server.episodes import EpisodeRunner

                workflow = load_workflow(cfg.agent, reveal(cfg.security.api_key))
                if workflow.env_client is not None:  # no episode calls a tool before the environment server answers
                    _print(f"waiting for the environment server at {workflow.env_client.url}")
                    await workflow.env_client.wait_ready(600.0)
                worker.episodes = EpisodeRunner(worker, workflow, cfg.agent, cfg.run.seed)
            workers.append(worker)
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
        scorer.close()
        for w in workers:
            if getattr(w, "episodes", None) is not None:
                await w.episodes.workflow.aclose()
        for c in clients:
            await c.close()
        await buf.close()
        if runner is not None:
            await runner.cleanup()
    return code
