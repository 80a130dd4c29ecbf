"""``asyncrl reward-model --config F [flags]``: the reward-model role as its own process.

Serves ``reward.model.path`` (:mod:`asyncrl.reward_model.server`) on ``reward.model.host`` and
``reward.model.port`` (0: a free port, printed) with ``/metrics`` on the same port, until
SIGTERM or SIGINT (explicit handlers, so it works as PID 1 in a container). Then it drains:
new requests get 503, the texts already queued are scored and answered, and it exits 0 after
printing ``drained: N requests answered``.

Exit status: 0 after a drain, 1 when the drain timed out or the server failed, 2 for a bad
command line or config (``reward.model.path`` unset, a model that does not load as a
sequence-classification model, a label index the model does not have) — the controller does
not restart a role that exits 2.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

__all__ = ["main", "run_reward_model_server"]


async def run_reward_model_server(cfg: Any, stop: asyncio.Event | None = None,
                                  ready: asyncio.Event | None = None) -> int:
    """Serve the reward model until ``stop`` (or SIGTERM/SIGINT), then drain; returns the exit code.

    ``ready`` (optional) is set once the server accepts requests; the bound port is printed.

    Raises:
        ValueError: ``reward.model.path`` unset, the model does not load as a
            sequence-classification model, or ``label_index`` is out of range.
        asyncrl.models.ModelNotFoundError: ``reward.model.path`` cannot be resolved.
    """
    rm = cfg.reward.model
    if rm.path is None:
        raise ValueError("reward.model.path is not set: give the reward model's directory "
                         "(--reward.model.path DIR, an AutoModelForSequenceClassification checkpoint)")
    from asyncrl.core.net import SERVER_KWARGS, free_port
    from asyncrl.core.serving import serve_until_stopped, stop_on_signals
    from asyncrl.metrics import role_registry
    from asyncrl.models import resolve_model_path
    from asyncrl.reward_model.server import RewardModelOptions, RewardModelServer

    stop = stop_on_signals(stop)
    path = str(resolve_model_path(rm.path))
    opts = RewardModelOptions.from_config(cfg, path)
    if opts.port == 0:
        opts.port = free_port(opts.host)
    registry, metrics = role_registry("reward_model")
    server = RewardModelServer(opts, metrics=metrics, registry=registry)
    await asyncio.get_running_loop().run_in_executor(None, server.load)
    return await serve_until_stopped(
        "reward-model", server, server.app(), opts.host, opts.port, stop=stop, ready=ready, what="requests",
        banner=f"serving {path} ({server.device}) on http://{opts.host}:{opts.port} (POST /score, /health, /metrics; "
               f"batches of <= {opts.max_batch_size} texts, {opts.batch_wait_ms:g} ms wait)",
        left=lambda: f"{server.batcher.pending if server.batcher else 0} texts left after "
                     f"reward.model.drain_timeout_seconds={opts.drain_timeout_seconds:g}",
        runner_kwargs=SERVER_KWARGS)


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl reward-model``; returns the exit code."""
    from asyncrl.core.serving import role_main
    from asyncrl.models import ModelNotFoundError

    return role_main(argv, "reward-model", run_reward_model_server,
                     config_errors=(FileNotFoundError, ModelNotFoundError))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
