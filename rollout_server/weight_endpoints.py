"""The embedded server's weight endpoints: SGLang's ``/update_weights_from_*`` family and version tags.

One job: turn a weight-update request into a validated state dict handed to the engine
(``/update_weights_from_disk``, ``/update_weights_from_tensor`` with base64 safetensors,
``/init_weights_update_group`` + ``/update_weights_from_distributed`` +
``/destroy_weights_update_group`` over gloo, ``/update_weight_version``). Every body is validated by its schema in
:mod:`rollout_server.schemas` (strict types, bounded sizes; the message names the field). Updates are
serialised by one lock; a rejected update answers 400 ``{"success": false, "message": ...}``
and changes nothing. :class:`WeightEndpoints` is a mixin of
:class:`rollout_server.server.RolloutHTTPServer`.
"""

from __future__ import annotations

import contextlib
import asyncio
import logging
from typing import Any

from aiohttp import web

from rollout_server.requests import read_body
from rollout_server.sampling import RequestError
from rollout_server.schemas import (
    DestroyGroupBody,
    InitGroupBody,
    UpdateFromDiskBody,
    UpdateFromDistributedBody,
    UpdateFromTensorBody,
    UpdateWeightVersionBody,
)

__all__ = ["WeightEndpoints", "destroy_group"]

log = logging.getLogger("rollout_server.server")


class WeightEndpoints:
    """Weight-update handlers (mixin of :class:`rollout_server.server.RolloutHTTPServer`).

    Expects ``engine``, ``loop``, ``rollout_metrics``, ``_weights_lock`` and ``_dist_groups`` on
    the server.
    """

    async def _apply_weights(self, state: dict, version: Any, abort_all: bool) -> web.Response:
        from asyncrl.weights import WeightLoadError

        try:
            res = await asyncio.wrap_future(
                self.engine.call("update_weights", state, None if version is None else str(version), bool(abort_all))
            )
        except (RequestError, WeightLoadError) as exc:
            return web.json_response({"success": False, "message": f"Failed to update weights: {exc}"}, status=400)
        msg = "Succeeded to update model weights."
        if version is not None:
            msg += f" Weight version updated to {version}."
        if self.rollout_metrics is not None:
            with contextlib.suppress(TypeError, ValueError):  # a non-numeric version name is no gauge value
                self.rollout_metrics.policy_version.set(int(version))
        return web.json_response({"success": True, "message": msg, "num_paused_requests": res["num_paused_requests"]})

    async def _weights_body(self, request: web.Request, schema: type, what: str) -> Any:
        """``request``'s body validated by ``schema``; a :class:`RequestError` says which field is wrong."""
        return await read_body(request, schema, allow_empty=False, what=what)

    async def handle_update_from_disk(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_disk``: load a safetensors directory (:class:`~rollout_server.schemas.UpdateFromDiskBody`)."""
        from asyncrl.weights import WeightLoadError, load_state_dict_from_dir

        try:
            body = await self._weights_body(request, UpdateFromDiskBody, "/update_weights_from_disk")
        except RequestError as exc:
            return _refused(exc)
        async with self._weights_lock:
            try:
                state = await self.loop.run_in_executor(None, load_state_dict_from_dir, body.model_path)
            except WeightLoadError as exc:
                return web.json_response({"success": False, "message": f"Failed to get weights iterator: {exc}"}, status=400)
            return await self._apply_weights(state, body.weight_version, body.abort_all_requests)

    async def handle_update_from_tensor(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_tensor``: base64 safetensors payloads (:class:`~rollout_server.schemas.UpdateFromTensorBody`)."""
        from asyncrl.weights import WeightLoadError, decode_safetensors_payload

        try:
            body = await self._weights_body(request, UpdateFromTensorBody, "/update_weights_from_tensor")
        except RequestError as exc:
            return _refused(exc)
        async with self._weights_lock:
            try:
                state = await self.loop.run_in_executor(None, decode_safetensors_payload, body.blobs())
            except WeightLoadError as exc:
                return web.json_response({"success": False, "message": str(exc)}, status=400)
            return await self._apply_weights(state, body.weight_version, body.abort_all_requests)

    async def handle_init_group(self, request: web.Request) -> web.Response:
        """``POST /init_weights_update_group``: join rank 0's gloo group (:class:`~rollout_server.schemas.InitGroupBody`)."""
        from asyncrl.weights import init_weights_update_group

        try:
            body = await self._weights_body(request, InitGroupBody, "/init_weights_update_group")
            if body.backend != "gloo":
                raise RequestError(f"backend {body.backend!r} is not available on the CPU engine: use gloo")
            if body.group_name in self._dist_groups:
                raise RequestError(f"weight update group {body.group_name!r} already exists")
        except RequestError as exc:
            return _refused(exc)
        try:
            pg = await self.loop.run_in_executor(
                None, init_weights_update_group, body.master_address, body.master_port,
                body.rank_offset, body.world_size, body.group_name, body.backend,
            )
        except Exception as exc:  # rendezvous failure, timeout
            return web.json_response({"success": False, "message": f"Failed to init group: {exc}"}, status=400)
        self._dist_groups[body.group_name] = pg
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def handle_update_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_distributed``: receive the announced broadcasts (:class:`~rollout_server.schemas.UpdateFromDistributedBody`)."""
        from asyncrl.weights import WeightLoadError, receive_broadcast_weights

        try:
            body = await self._weights_body(request, UpdateFromDistributedBody, "/update_weights_from_distributed")
            pg = self._dist_groups.get(body.group_name)
            if pg is None:
                raise RequestError(f"no weight update group {body.group_name!r}: call /init_weights_update_group first")
        except RequestError as exc:
            return _refused(exc)
        async with self._weights_lock:
            try:
                state = await self.loop.run_in_executor(
                    None, receive_broadcast_weights, pg, list(body.names), list(body.dtypes), [list(x) for x in body.shapes]
                )
            except (WeightLoadError, RuntimeError) as exc:
                return web.json_response({"success": False, "message": f"Failed to receive weights: {exc}"}, status=400)
            return await self._apply_weights(state, body.weight_version, body.abort_all_requests)

    async def handle_destroy_group(self, request: web.Request) -> web.Response:
        """``POST /destroy_weights_update_group`` (:class:`~rollout_server.schemas.DestroyGroupBody`)."""
        try:
            body = await read_body(request, DestroyGroupBody, what="/destroy_weights_update_group")
        except RequestError as exc:
            return _refused(exc)
        pg = self._dist_groups.pop(body.group_name, None)
        if pg is None:
            return web.json_response({"success": False, "message": f"no weight update group {body.group_name!r}"}, status=400)
        destroy_group(pg)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def handle_update_weight_version(self, request: web.Request) -> web.Response:
        """``POST /update_weight_version``: relabel the loaded weights (:class:`~rollout_server.schemas.UpdateWeightVersionBody`)."""
        try:
            body = await self._weights_body(request, UpdateWeightVersionBody, "/update_weight_version")
        except RequestError as exc:
            return _refused(exc)
        if body.abort_all_requests:
            self.engine.abort("", True)
        v = body.new_version
        await asyncio.wrap_future(self.engine.call("set_version", v))
        return web.json_response({"success": True, "message": f"Weight version updated to {v}", "new_version": v})


def _refused(exc: RequestError) -> web.Response:
    """SGLang's answer to a refused weight request: 400 ``{"success": false, "message"}``."""
    return web.json_response({"success": False, "message": str(exc)}, status=400)


def destroy_group(pg: Any) -> None:
    """Destroy a weight-update process group, best effort (its endpoint, or the server's cleanup)."""
    try:
        import torch.distributed as dist

        dist.destroy_process_group(pg)
    except Exception:  # best effort at shutdown
        log.debug("destroying weight update group failed", exc_info=True)
