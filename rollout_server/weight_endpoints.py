"""The embedded server's weight endpoints: SGLang's ``/update_weights_from_*`` family and version tags.

One job: turn a weight-update request into a validated state dict handed to the engine
(``/update_weights_from_disk``, ``/update_weights_from_tensor`` with base64 safetensors,
``/init_weights_update_group`` + ``/update_weights_from_distributed`` +
``/destroy_weights_update_group`` over gloo, ``/update_weight_version``). Updates are
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

from rollout_server.requests import read_json_body
from rollout_server.sampling import RequestError

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

    def _update_args(self, body: dict, required: str) -> tuple[Any, bool]:
        if required and required not in body:
            raise RequestError(f"missing required field {required!r}")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, (str, int)):
            raise RequestError("weight_version must be a string")
        abort_all = body.get("abort_all_requests", False)
        if not isinstance(abort_all, bool):
            raise RequestError("abort_all_requests must be true or false")
        return version, abort_all

    async def handle_update_from_disk(self, request: web.Request) -> web.Response:
        from asyncrl.weights import WeightLoadError, load_state_dict_from_dir

        try:
            body = await read_json_body(request, allow_empty=False)
            version, abort_all = self._update_args(body, "model_path")
            if body.get("load_format") not in (None, "auto", "safetensors"):
                raise RequestError(f"load_format {body['load_format']!r} is not supported (use safetensors)")
            path = body["model_path"]
            if not isinstance(path, str) or not path:
                raise RequestError("model_path must be a directory path")
        except RequestError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        async with self._weights_lock:
            try:
                state = await self.loop.run_in_executor(None, load_state_dict_from_dir, path)
            except WeightLoadError as exc:
                return web.json_response({"success": False, "message": f"Failed to get weights iterator: {exc}"}, status=400)
            return await self._apply_weights(state, version, abort_all)

    async def handle_update_from_tensor(self, request: web.Request) -> web.Response:
        from asyncrl.weights import WeightLoadError, decode_safetensors_payload

        try:
            body = await read_json_body(request, allow_empty=False)
            version, abort_all = self._update_args(body, "serialized_named_tensors")
            blobs = body["serialized_named_tensors"]
            if isinstance(blobs, str):
                blobs = [blobs]
            if not isinstance(blobs, list) or not blobs or not all(isinstance(b, str) for b in blobs):
                raise RequestError("serialized_named_tensors must be a list of base64 safetensors payloads")
            if body.get("load_format") not in (None, "safetensors", "direct"):
                raise RequestError(f"load_format {body['load_format']!r} is not supported (base64 safetensors only)")
        except RequestError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        async with self._weights_lock:
            try:
                state = await self.loop.run_in_executor(None, decode_safetensors_payload, blobs)
            except WeightLoadError as exc:
                return web.json_response({"success": False, "message": str(exc)}, status=400)
            return await self._apply_weights(state, version, abort_all)

    async def handle_init_group(self, request: web.Request) -> web.Response:
        from asyncrl.weights import init_weights_update_group

        try:
            body = await read_json_body(request, allow_empty=False)
            for key in ("master_address", "master_port", "rank_offset", "world_size"):
                if key not in body:
                    raise RequestError(f"missing required field {key!r}")
            backend = body.get("backend", "nccl")
            if backend != "gloo":
                raise RequestError(f"backend {backend!r} is not available on the CPU engine: use gloo")
            name = body.get("group_name", "weight_update_group")
            if name in self._dist_groups:
                raise RequestError(f"weight update group {name!r} already exists")
        except RequestError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        try:
            pg = await self.loop.run_in_executor(
                None, init_weights_update_group, body["master_address"], int(body["master_port"]),
                int(body["rank_offset"]), int(body["world_size"]), name, backend,
            )
        except Exception as exc:  # rendezvous failure, timeout
            return web.json_response({"success": False, "message": f"Failed to init group: {exc}"}, status=400)
        self._dist_groups[name] = pg
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def handle_update_from_distributed(self, request: web.Request) -> web.Response:
        from asyncrl.weights import WeightLoadError, receive_broadcast_weights

        try:
            body = await read_json_body(request, allow_empty=False)
            version, abort_all = self._update_args(body, "names")
            names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
            if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not (
                len(names) == len(dtypes) == len(shapes)
            ):
                raise RequestError("names, dtypes and shapes must be lists of equal length")
            name = body.get("group_name", "weight_update_group")
            pg = self._dist_groups.get(name)
            if pg is None:
                raise RequestError(f"no weight update group {name!r}: call /init_weights_update_group first")
        except RequestError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        async with self._weights_lock:
            try:
                state = await self.loop.run_in_executor(None, receive_broadcast_weights, pg, names, dtypes, shapes)
            except (WeightLoadError, RuntimeError) as exc:
                return web.json_response({"success": False, "message": f"Failed to receive weights: {exc}"}, status=400)
            return await self._apply_weights(state, version, abort_all)

    async def handle_destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await read_json_body(request)
        except RequestError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        name = body.get("group_name", "weight_update_group")
        pg = self._dist_groups.pop(name, None)
        if pg is None:
            return web.json_response({"success": False, "message": f"no weight update group {name!r}"}, status=400)
        destroy_group(pg)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def handle_update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await read_json_body(request, allow_empty=False)
            v = body.get("new_version")
            if not isinstance(v, (str, int)) or isinstance(v, bool):
                raise RequestError("new_version must be a string")
        except RequestError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        if body.get("abort_all_requests", True):
            self.engine.abort("", True)
        await asyncio.wrap_future(self.engine.call("set_version", str(v)))
        return web.json_response({"success": True, "message": f"Weight version updated to {v}", "new_version": str(v)})


def destroy_group(pg: Any) -> None:
    """Destroy a weight-update process group, best effort (its endpoint, or the server's cleanup)."""
    try:
        import torch.distributed as dist

        dist.destroy_process_group(pg)
    except Exception:  # best effort at shutdown
        log.debug("destroying weight update group failed", exc_info=True)
