"""Weight publishing: what the trainer does with each policy version, per transport.

Every transport starts the same way: rank 0 writes ``<weights_dir>/v<version:06d>/`` with
:func:`asyncrl.weights.write_weights` (atomic, checksummed, the oldest versions beyond
``keep_last`` pruned), and only then announces the version on the clock
(``VersionClock.publish``: compare-and-set), with the sha256 of ``model.safetensors`` as the
checksum (``Trainer.publish_weights`` in ``trainer/trainer.py``). Transports
(docs/architecture.md#weight-sync; pull, except ``nccl``):

- ``disk``: the uri is the version directory's absolute path; a rollout server calls
  ``/update_weights_from_disk`` with it.
- ``http``: :class:`asyncrl.weights.WeightFileServer` (aiohttp, in a background thread of trainer
  rank 0) serves the weights directory; the uri is ``http://host:port/weights/v000007/`` and a
  rollout server downloads and verifies it with :func:`asyncrl.weights.download_weights`.
- ``nccl``: the weights are still written to disk first (durable; new or restarted servers
  load them from there), then :class:`NcclWeightPusher` broadcasts them to the running engines
  with SGLang's choreography (``/init_weights_update_group`` once, then
  ``/update_weights_from_distributed`` + one broadcast per tensor, via
  :class:`asyncrl.weights.DistributedWeightSender`): NCCL where CUDA exists, gloo on CPU.
  The announced uri is the disk directory; engines already updated report the new
  ``weight_version`` and skip the reload.

The directory format and both ends of each transport are in :mod:`asyncrl.weights`, which the
rollout servers import too; this module holds what only the trainer does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncrl.weights import PublishError

__all__ = ["NcclWeightPusher"]


class NcclWeightPusher:
    """Trainer rank 0's side of the ``nccl`` transport: push full weights into running engines.

    Args:
        urls: the rollout engines' base URLs (``rollout.server_urls``, or the launched servers').
        master_address: address the engines use to reach this process's rendezvous.
        backend: ``nccl`` (GPU) or ``gloo`` (CPU; tests).
        api_key: bearer token of the engines' state-changing endpoints.

    The process group is created on the first :meth:`push` and reused.
    """

    def __init__(self, urls: list[str], master_address: str = "127.0.0.1", backend: str = "gloo",
                 api_key: str | None = None, timeout_seconds: float = 300.0):
        if not urls:
            raise PublishError("weight_sync.transport=nccl needs the engines' URLs (rollout.server_urls)")
        self.urls, self.master_address, self.backend = list(urls), master_address, backend
        self.api_key, self.timeout_seconds = api_key, timeout_seconds
        self._sender = None

    async def push(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Broadcast ``state_dict`` to every engine as ``weight_version = str(version)``."""
        from asyncrl.net import free_port
        from asyncrl.weights import DistributedWeightSender

        if self._sender is None:
            sender = DistributedWeightSender(self.urls, self.master_address, free_port(self.master_address),
                                             backend=self.backend, api_key=self.api_key,
                                             timeout_seconds=self.timeout_seconds)
            await sender.init()
            self._sender = sender
        await self._sender.send(dict(state_dict), version=str(version))

    async def close(self) -> None:
        """Destroy the weight-update group on the engines and here."""
        if self._sender is not None:
            await self._sender.close()
            self._sender = None
