"""The ``nccl`` weight transport, both ends: SGLang's distributed choreography over a custom process group.

The trainer (rank 0) and each engine join a custom process group (``/init_weights_update_group``);
then for each update the trainer POSTs ``/update_weights_from_distributed`` (names, dtypes,
shapes) and broadcasts every tensor from rank 0 while the engine receives them.
:func:`init_weights_update_group` builds the group exactly as SGLang's
``init_custom_process_group`` does (TCP rendezvous + ``_new_process_group_helper``), so the same
trainer code drives SGLang over NCCL on GPUs and the embedded engine over gloo on CPUs.
:class:`DistributedWeightSender` is the trainer side (``trainer.publisher.NcclWeightPusher``
drives it); :func:`init_weights_update_group` and :func:`receive_broadcast_weights` are the
embedded engine's (``rollout_server/weight_endpoints.py``). The request shapes are SGLang's
(``python/sglang/srt/entrypoints/http_server.py`` in https://github.com/sgl-project/sglang;
the subset is in docs/rollout.md).

Simplification: no bucketing/flattening of tensors (``load_format="flattened_bucket"``);
each tensor is broadcast on its own, in the order of ``names``.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from asyncrl.core.weights.directory import WeightLoadError

__all__ = ["init_weights_update_group", "receive_broadcast_weights", "DistributedWeightSender"]

_DTYPES = ("float32", "float16", "bfloat16", "float64")


def init_weights_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_seconds: float = 300.0,
) -> Any:
    """Join (or, as rank 0, host) a custom process group for weight broadcasts.

    Mirrors SGLang's ``init_custom_process_group``: a ``tcp://`` rendezvous (rank 0 hosts the
    TCP store) and torch's ``_new_process_group_helper``, independent of any default group.

    Returns:
        the process group (pass it to :func:`receive_broadcast_weights` or ``dist.broadcast``).
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_seconds)
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{master_address}:{int(master_port)}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def receive_broadcast_weights(pg: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, Any]:
    """Receive one broadcast (from group rank 0) per tensor, in order; returns ``{name: tensor}``.

    Raises:
        WeightLoadError: an unknown dtype or a malformed shape (checked before receiving).
    """
    import torch
    import torch.distributed as dist

    specs = []
    for name, dt, shape in zip(names, dtypes, shapes):
        dt = str(dt).replace("torch.", "")
        if dt not in _DTYPES:
            raise WeightLoadError(f"tensor {name!r}: unsupported dtype {dt!r} (use one of {', '.join(_DTYPES)})")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WeightLoadError(f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r}")
        specs.append((name, getattr(torch, dt), shape))
    out = {}
    for name, dtype, shape in specs:
        t = torch.empty(shape, dtype=dtype)
        dist.broadcast(t, src=0, group=pg)
        out[name] = t
    return out


class DistributedWeightSender:
    """Trainer side of the distributed choreography, for one or more engines.

    Usage (rank 0 of the trainer)::

        sender = DistributedWeightSender(engine_urls, "127.0.0.1", port, backend="gloo", api_key=key)
        await sender.init()                       # POST /init_weights_update_group to each engine + join
        await sender.send(model.state_dict(), version="3")   # POST /update_weights_from_distributed + broadcast
        await sender.close()

    Each engine is one rank (``rank_offset`` 1, 2, ...); the trainer is rank 0.
    """

    def __init__(self, urls: list[str], master_address: str, master_port: int, backend: str = "nccl",
                 group_name: str = "weight_update_group", api_key: str | None = None, timeout_seconds: float = 300.0):
        self.urls = [u.rstrip("/") for u in urls]
        self.master_address, self.master_port = master_address, int(master_port)
        self.backend, self.group_name = backend, group_name
        self.api_key = api_key
        self.timeout_seconds = timeout_seconds
        self.pg: Any = None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _post_all(self, path: str, bodies: list[dict]) -> list[dict]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_seconds)
        async with aiohttp.ClientSession(timeout=timeout, headers=self._headers()) as http:
            async def one(url: str, body: dict) -> dict:
                async with http.post(url + path, json=body) as r:
                    data = await r.json(content_type=None)
                    if r.status != 200 or not data.get("success", False):
                        raise RuntimeError(f"{url}{path} failed ({r.status}): {data}")
                    return data

            return await asyncio.gather(*(one(u, b) for u, b in zip(self.urls, bodies)))

    async def init(self) -> None:
        """Create the group: every engine joins via HTTP while this process joins as rank 0."""
        world = len(self.urls) + 1
        bodies = [{"master_address": self.master_address, "master_port": self.master_port, "rank_offset": i + 1,
                   "world_size": world, "group_name": self.group_name, "backend": self.backend}
                  for i in range(len(self.urls))]
        loop = asyncio.get_running_loop()
        join = loop.run_in_executor(None, init_weights_update_group, self.master_address, self.master_port, 0,
                                    world, self.group_name, self.backend, self.timeout_seconds)
        posts = asyncio.ensure_future(self._post_all("/init_weights_update_group", bodies))
        self.pg = await join
        await posts

    async def send(self, named_tensors: dict[str, Any], version: str | None = None, flush_cache: bool = True,
                   extra: dict[str, Any] | None = None) -> None:
        """Announce the tensors to every engine and broadcast them (rank 0 -> all).

        ``extra``: more fields of the ``/update_weights_from_distributed`` body (asyncrl's
        ``lora_config``/``lora_checksum`` for an adapter; SGLang has no such fields).
        """
        import torch.distributed as dist

        if self.pg is None:
            raise RuntimeError("call init() before send()")
        names = list(named_tensors)
        tensors = [named_tensors[n].detach().contiguous() for n in names]
        body = {"names": names, "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
                "shapes": [list(t.shape) for t in tensors], "group_name": self.group_name,
                "flush_cache": flush_cache, "weight_version": version, **(extra or {})}
        posts = asyncio.ensure_future(self._post_all("/update_weights_from_distributed", [body] * len(self.urls)))

        def broadcast() -> None:
            for t in tensors:
                dist.broadcast(t, src=0, group=self.pg)

        await asyncio.get_running_loop().run_in_executor(None, broadcast)
        await posts

    async def close(self) -> None:
        """Ask every engine to destroy the group, then destroy ours."""
        import torch.distributed as dist

        if self.pg is None:
            return
        try:
            await self._post_all("/destroy_weights_update_group", [{"group_name": self.group_name}] * len(self.urls))
        finally:
            try:
                dist.destroy_process_group(self.pg)
            except Exception:  # best effort
                pass
            self.pg = None
