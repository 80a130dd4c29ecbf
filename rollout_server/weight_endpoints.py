"""The embedded server's weight endpoints: SGLang's ``/update_weights_from_*`` family and version tags.

One job: turn a weight-update request into a validated state dict handed to the engine
(``/update_weights_from_disk``, ``/update_weights_from_tensor`` with base64 safetensors,
``/init_weights_update_group`` + ``/update_weights_from_distributed`` +
``/destroy_weights_update_group`` over gloo, ``/update_weight_version``), and SGLang's named LoRA
adapters (``/load_lora_adapter``, ``/unload_lora_adapter``; rollout_server/engine_lora.py). Every body is validated by its schema in
:mod:`rollout_server.schemas_weights` (strict types, bounded sizes; the message names the field). Updates are
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
from rollout_server.weight_group import GroupTimeout, join_group, leave_group, on_daemon_thread, receive_broadcasts
from rollout_server.schemas_weights import (
    DestroyGroupBody,
    InitGroupBody,
    LoadLoraAdapterBody,
    UnloadLoraAdapterBody,
    UpdateFromDiskBody,
    UpdateFromDistributedBody,
    UpdateFromTensorBody,
    UpdateWeightVersionBody,
)

__all__ = ["WeightEndpoints", "destroy_group", "read_adapter_dir"]

log = logging.getLogger("rollout_server.server")

#: seconds a handler waits for a join beyond its own bound (what the rendezvous's timeout does not cover)
_JOIN_SLACK_SECONDS = 5.0


class WeightEndpoints:
    """Weight-update handlers (mixin of :class:`rollout_server.server.RolloutHTTPServer`).

    Expects ``engine``, ``loop``, ``rollout_metrics``, ``_weights_lock`` and ``_dist_groups`` on
    the server.
    """

    async def _apply_weights(self, state: dict, version: Any, abort_all: bool, flush_cache: bool = True) -> web.Response:
        from asyncrl.core.weights import WeightLoadError

        try:
            res = await asyncio.wrap_future(
                self.engine.call("update_weights", state, None if version is None else str(version), bool(abort_all),
                                 bool(flush_cache))
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
        return await read_body(request, schema, self.weights_body_reader, allow_empty=False, what=what)

    async def handle_update_from_disk(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_disk``: load a safetensors directory (:class:`~rollout_server.schemas_weights.UpdateFromDiskBody`).

        An adapter-only version (``adapter_config.json`` + ``adapter_model.safetensors``,
        ``trainer.lora``) is verified against its ``SHA256SUMS`` and merged into the base weights
        (:meth:`_apply_adapter_dir`); the answer's ``lora_adapter`` names the adapter now loaded.
        """
        from asyncrl.core.weights import WeightLoadError, is_adapter_dir, load_state_dict_from_dir

        try:
            body = await self._weights_body(request, UpdateFromDiskBody, "/update_weights_from_disk")
        except RequestError as exc:
            return _refused(exc)
        async with self._weights_lock:
            if is_adapter_dir(body.model_path):
                return await self._apply_adapter_dir(body)
            try:
                state = await self.loop.run_in_executor(None, load_state_dict_from_dir, body.model_path)
            except WeightLoadError as exc:
                return web.json_response({"success": False, "message": f"Failed to get weights iterator: {exc}"}, status=400)
            return await self._apply_weights(state, body.weight_version, body.abort_all_requests, body.flush_cache)

    async def _apply_adapter_dir(self, body: Any) -> web.Response:
        """Verify and merge an adapter-only version directory; 400 with the reason when it does not land.

        The adapter's checksum (sha256 of ``adapter_model.safetensors``, the one the trainer
        announced) is what the engine then reports in ``lora_adapter.checksum``, so the caller can
        check that the adapter it asked for is the one generating.
        """
        from pathlib import Path

        from asyncrl.core.weights import ChecksumError, WeightLoadError

        try:
            tensors, config, checksum = await self.loop.run_in_executor(None, read_adapter_dir, Path(body.model_path))
        except (WeightLoadError, ChecksumError) as exc:
            return web.json_response({"success": False, "message": f"Failed to load the LoRA adapter: {exc}"}, status=400)
        return await self._merge_adapter_tensors(tensors, config, checksum, body)

    async def _merge_adapter_tensors(self, tensors: dict, config: dict, checksum: str, body: Any) -> web.Response:
        """Hand an adapter (tensors + ``adapter_config.json`` + its checksum) to the engine's merge;
        400 with the reason when it does not fit, else ``lora_adapter`` names what is loaded."""
        from asyncrl.core.weights import WeightLoadError

        version = None if body.weight_version is None else str(body.weight_version)
        try:
            res = await asyncio.wrap_future(self.engine.call("update_adapter", tensors, config, checksum, version,
                                                             bool(body.abort_all_requests), bool(body.flush_cache)))
        except (RequestError, WeightLoadError) as exc:
            return web.json_response({"success": False, "message": f"Failed to load the LoRA adapter: {exc}"}, status=400)
        if self.rollout_metrics is not None:
            with contextlib.suppress(TypeError, ValueError):
                self.rollout_metrics.policy_version.set(int(version))
        msg = f"Succeeded to merge the LoRA adapter {checksum[:12]} into the base weights."
        if version is not None:
            msg += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": msg, "num_paused_requests": res["num_paused_requests"],
                                  "lora_adapter": res["lora_adapter"]})

    async def handle_load_lora_adapter(self, request: web.Request) -> web.Response:
        """``POST /load_lora_adapter`` (:class:`~rollout_server.schemas_weights.LoadLoraAdapterBody`): register a named adapter.

        The directory is read like an adapter-only version (verified against its ``SHA256SUMS``
        when it has one) and registered by the engine (rollout_server/engine_lora.py); the base
        weights and the weight version do not change. Answers SGLang's ``LoRAUpdateOutput``:
        200 ``{"success": true, "loaded_adapters": {name: path}}``, or 400 with ``success`` false
        and ``error_message`` (unreadable or unfitting adapter, name taken, too many loaded, a
        merged adapter in place), and nothing registered.
        """
        from pathlib import Path

        from asyncrl.core.weights import ChecksumError, WeightLoadError

        try:
            body = await self._weights_body(request, LoadLoraAdapterBody, "/load_lora_adapter")
        except RequestError as exc:
            return _lora_answer(self.engine, exc)
        async with self._weights_lock:
            try:
                tensors, config, checksum = await self.loop.run_in_executor(None, read_adapter_dir, Path(body.lora_path))
                loaded = await asyncio.wrap_future(self.engine.call("load_lora", body.lora_name, body.lora_path, tensors,
                                                                    config, checksum))
            except (RequestError, WeightLoadError, ChecksumError) as exc:
                return _lora_answer(self.engine, RequestError(f"Failed to load LoRA adapter {body.lora_name!r}: {exc}"))
        log.info("LoRA adapter %r loaded from %s (sha256 %s)", body.lora_name, body.lora_path, checksum[:12])
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": loaded})

    async def handle_unload_lora_adapter(self, request: web.Request) -> web.Response:
        """``POST /unload_lora_adapter`` (:class:`~rollout_server.schemas_weights.UnloadLoraAdapterBody`): forget a named adapter.

        Requests already running under it finish under it; new ones naming it get a 400. 400 with
        ``error_message`` when no adapter of that name is loaded.
        """
        try:
            body = await self._weights_body(request, UnloadLoraAdapterBody, "/unload_lora_adapter")
        except RequestError as exc:
            return _lora_answer(self.engine, exc)
        async with self._weights_lock:
            try:
                loaded = await asyncio.wrap_future(self.engine.call("unload_lora", body.lora_name))
            except RequestError as exc:
                return _lora_answer(self.engine, RequestError(f"Failed to unload LoRA adapter: {exc}"))
        log.info("LoRA adapter %r unloaded", body.lora_name)
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": loaded})

    async def handle_update_from_tensor(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_tensor``: base64 safetensors payloads (:class:`~rollout_server.schemas_weights.UpdateFromTensorBody`)."""
        from asyncrl.core.weights import WeightLoadError, decode_safetensors_payload

        try:
            body = await self._weights_body(request, UpdateFromTensorBody, "/update_weights_from_tensor")
        except RequestError as exc:
            return _refused(exc)
        async with self._weights_lock:
            try:
                state = await self.loop.run_in_executor(None, decode_safetensors_payload, body.blobs())
            except WeightLoadError as exc:
                return web.json_response({"success": False, "message": str(exc)}, status=400)
            return await self._apply_weights(state, body.weight_version, body.abort_all_requests, body.flush_cache)

    async def handle_init_group(self, request: web.Request) -> web.Response:
        """``POST /init_weights_update_group``: join rank 0's gloo group (:class:`~rollout_server.schemas_weights.InitGroupBody`).

        The join runs on a dedicated daemon thread (:func:`rollout_server.weight_group.on_daemon_thread`),
        bounded by ``--weight-group-timeout-seconds``; the gloo device listens on the server's host.
        """
        try:
            body = await self._weights_body(request, InitGroupBody, "/init_weights_update_group")
            if body.backend != "gloo":
                raise RequestError(f"backend {body.backend!r} is not available on the CPU engine: use gloo")
            if body.group_name in self._dist_groups or body.group_name in self._joining:
                raise RequestError(f"weight update group {body.group_name!r} already exists")
        except RequestError as exc:
            return _refused(exc)
        bound = self.limits.weight_group_timeout_seconds
        self._joining.add(body.group_name)
        try:
            pg = await on_daemon_thread(
                join_group, body.master_address, body.master_port, body.rank_offset, body.world_size,
                body.group_name, self.opts.host, bound,
                # the rendezvous itself is bounded too; the slack covers what it does not bound (name resolution)
                timeout_seconds=bound + _JOIN_SLACK_SECONDS, what="joining weight update group", on_late_result=leave_group,
            )
        except GroupTimeout as exc:
            return web.json_response({"success": False, "message": f"Failed to init group: {exc} (master "
                                      f"{body.master_address}:{body.master_port} unreachable?; the bound is "
                                      "--weight-group-timeout-seconds, rollout.engine_weight_group_timeout_seconds)"},
                                     status=400)
        except Exception as exc:  # rendezvous failure, timeout
            return web.json_response({"success": False, "message": f"Failed to init group: {type(exc).__name__}: {exc}"},
                                     status=400)
        finally:
            self._joining.discard(body.group_name)
        self._dist_groups[body.group_name] = pg
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def handle_update_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_distributed``: receive the announced broadcasts (:class:`~rollout_server.schemas_weights.UpdateFromDistributedBody`).

        Each broadcast is bounded by ``--weight-group-timeout-seconds``; the receiving runs on a
        daemon thread, so a stalled trainer never holds up shutdown.
        """
        try:
            body = await self._weights_body(request, UpdateFromDistributedBody, "/update_weights_from_distributed")
            pg = self._dist_groups.get(body.group_name)
            if pg is None:
                raise RequestError(f"no weight update group {body.group_name!r}: call /init_weights_update_group first")
        except RequestError as exc:
            return _refused(exc)
        from asyncrl.core.weights import WeightLoadError

        async with self._weights_lock:
            try:
                state = await on_daemon_thread(
                    receive_broadcasts, pg, list(body.names), list(body.dtypes), [list(x) for x in body.shapes],
                    self.limits.weight_group_timeout_seconds, timeout_seconds=None, what="receiving weight broadcasts",
                )
            except (WeightLoadError, RuntimeError) as exc:
                return web.json_response({"success": False, "message": f"Failed to receive weights: {exc}"}, status=400)
            if body.lora_config is not None:  # trainer.lora over nccl: the tensors are an adapter
                return await self._merge_adapter_tensors(state, body.lora_config, body.lora_checksum, body)
            return await self._apply_weights(state, body.weight_version, body.abort_all_requests, body.flush_cache)

    async def handle_destroy_group(self, request: web.Request) -> web.Response:
        """``POST /destroy_weights_update_group`` (:class:`~rollout_server.schemas_weights.DestroyGroupBody`)."""
        try:
            body = await read_body(request, DestroyGroupBody, self.body_reader, what="/destroy_weights_update_group")
        except RequestError as exc:
            return _refused(exc)
        pg = self._dist_groups.pop(body.group_name, None)
        if pg is None:
            return web.json_response({"success": False, "message": f"no weight update group {body.group_name!r}"}, status=400)
        destroy_group(pg)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def handle_update_weight_version(self, request: web.Request) -> web.Response:
        """``POST /update_weight_version``: relabel the loaded weights (:class:`~rollout_server.schemas_weights.UpdateWeightVersionBody`)."""
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
    """SGLang's answer to a refused weight request: 400 ``{"success": false, "message"}`` (413/408 for a body
    refused by its size or arrival time; the connection is then closed, the body may be partly unread)."""
    resp = web.json_response({"success": False, "message": str(exc)}, status=getattr(exc, "status", 400))
    if getattr(exc, "status", 400) != 400:
        resp.force_close()
    return resp


def _lora_answer(engine: Any, exc: RequestError) -> web.Response:
    """SGLang's refused ``LoRAUpdateOutput``: 400 ``{"success": false, "error_message", "loaded_adapters"}``
    (413/408 for a body refused by its size or arrival time; the connection is then closed)."""
    status = getattr(exc, "status", 400)
    resp = web.json_response({"success": False, "error_message": str(exc), "loaded_adapters": engine.loaded_lora_paths()},
                             status=status)
    if status != 400:
        resp.force_close()
    return resp


def read_adapter_dir(path: Any) -> tuple[dict, dict, str]:
    """``(tensors, adapter_config, sha256 of adapter_model.safetensors)`` of a PEFT adapter directory.

    The directory is verified against its ``SHA256SUMS`` when it has one (what the trainer writes).

    Raises:
        WeightLoadError: a file is missing or unreadable, or the config is not a JSON object.
        ChecksumError: a file does not match ``SHA256SUMS``.
    """
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from asyncrl.core.weights import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, WeightLoadError, sha256_file, verify_weights_dir

    path = Path(path)
    if (path / "SHA256SUMS").is_file():
        verify_weights_dir(path)
    try:
        config = json.loads((path / ADAPTER_CONFIG_FILE).read_text())
        tensors = load_file(str(path / ADAPTER_WEIGHTS_FILE), device="cpu")
    except Exception as exc:  # OSError, JSONDecodeError, SafetensorError
        raise WeightLoadError(f"cannot read the adapter in {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise WeightLoadError(f"{path / ADAPTER_CONFIG_FILE} is not a JSON object")
    return tensors, config, sha256_file(path / ADAPTER_WEIGHTS_FILE)


def destroy_group(pg: Any) -> None:
    """Destroy a weight-update process group, best effort (its endpoint, or the server's cleanup)."""
    leave_group(pg)
