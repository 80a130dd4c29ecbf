"""Weight publishing: what the trainer does with each policy version, per transport.

Every transport starts the same way: rank 0 writes ``<weights_dir>/v<version:06d>/`` with
:func:`asyncrl.core.weights.write_weights` (atomic, checksummed, the oldest versions beyond
``keep_last`` pruned), and only then announces the version on the clock
(``VersionClock.publish``: compare-and-set), with the sha256 of ``model.safetensors`` as the
checksum (``Trainer.publish_weights``, :class:`WeightPublishing` below). Transports
(docs/architecture.md#weight-sync; pull, except ``nccl``):

- ``disk``: the uri is the version directory's absolute path; a rollout server calls
  ``/update_weights_from_disk`` with it.
- ``http``: :class:`asyncrl.core.weights.WeightFileServer` (aiohttp, in a background thread of trainer
  rank 0) serves the weights directory; the uri is ``http://host:port/weights/v000007/`` and a
  rollout server downloads and verifies it with :func:`asyncrl.core.weights.download_weights`.
- ``nccl``: the weights are still written to disk first (durable; new or restarted servers
  load them from there), then :class:`NcclWeightPusher` broadcasts them to the running engines
  with SGLang's choreography (``/init_weights_update_group`` once, then
  ``/update_weights_from_distributed`` + one broadcast per tensor, via
  :class:`asyncrl.core.weights.DistributedWeightSender`): NCCL where CUDA exists, gloo on CPU.
  The announced uri is the disk directory; engines already updated report the new
  ``weight_version`` and skip the reload.

With ``trainer.lora`` a version is adapter-only (:meth:`WeightPublishing._publish_adapter`:
``adapter_model.safetensors`` + ``adapter_config.json``, PEFT's format; trainer/lora.py), carried
by ``disk`` and ``http``, and pushed by ``nccl`` with the adapter's config and checksum in the
``/update_weights_from_distributed`` body (asyncrl's ``lora_config``/``lora_checksum``).

The directory format and both ends of each transport are in :mod:`asyncrl.core.weights`, which the
rollout servers import too; this module holds what only the trainer does:
:class:`WeightPublishing` (``Trainer.full_state_dict``, ``Trainer.publish_weights``, the files
copied from the source model into every version) and :class:`NcclWeightPusher`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrl.core.weights import PublishError

__all__ = ["NcclWeightPusher", "WeightPublishing"]


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

    async def push(self, state_dict: Mapping[str, Any], version: int, lora: tuple[dict, str] | None = None) -> None:
        """Broadcast ``state_dict`` to every engine as ``weight_version = str(version)``.

        ``lora``: ``(adapter_config.json content, adapter checksum)`` when ``state_dict`` is a LoRA
        adapter (``trainer.lora``); the embedded engine merges it (a failed merge raises here).
        """
        from asyncrl.core.net import free_port
        from asyncrl.core.weights import DistributedWeightSender

        if self._sender is None:
            sender = DistributedWeightSender(self.urls, self.master_address, free_port(self.master_address),
                                             backend=self.backend, api_key=self.api_key,
                                             timeout_seconds=self.timeout_seconds)
            await sender.init()
            self._sender = sender
        extra = {"lora_config": lora[0], "lora_checksum": lora[1]} if lora is not None else None
        await self._sender.send(dict(state_dict), version=str(version), extra=extra)

    async def close(self) -> None:
        """Destroy the weight-update group on the engines and here."""
        if self._sender is not None:
            await self._sender.close()
            self._sender = None


class WeightPublishing:
    """Publishing the policy's weights as versions: a base of :class:`trainer.trainer.Trainer`.

    Uses the trainer's ``engine``, ``module``, ``cfg``, ``model_config``, ``model_source``,
    ``weights_dir``, ``rank``, its transports (``http_server``, ``nccl_pusher``), ``announce``,
    ``run_async``, ``_barrier`` and the counters ``step`` and ``published_version(s)``.
    """

    @staticmethod
    def _model_source(path: str, model: Any) -> Path | None:
        """The source model's local directory (tokenizer files, generation config); None if it has none."""
        from asyncrl.models import resolve_model_path

        for candidate in (path, getattr(model, "name_or_path", None)):
            if not candidate:
                continue
            try:
                return Path(resolve_model_path(candidate))
            except Exception:  # a name that is not prepared: no files to copy
                continue
        return None

    def _tokenizer_files(self) -> dict[str, bytes]:
        """Tokenizer files of the source model, copied into every published version directory."""
        names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                 "tokenizer.model", "chat_template.jinja", "added_tokens.json")
        if self.model_source is None:
            return {}
        return {n: (self.model_source / n).read_bytes() for n in names if (self.model_source / n).is_file()}

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """Full model weights on rank 0 (gathered under ZeRO-3), cast to ``dtype``; None on other ranks.

        Tied weights are stored once (``lm_head.weight`` dropped when embeddings are tied).
        Collective: call on every rank.
        """
        dtype = dtype or getattr(torch, self.cfg.model.dtype)
        module = self.module

        zero3 = self.engine.zero_optimization_stage() == 3

        def collect():
            if self.rank != 0:
                return None
            # Outside ZeRO-3 the parameters stay valid while the (synchronous) publish runs, so a
            # tensor already in the right dtype is not copied; gathered ZeRO-3 tensors are.
            return {k: v.detach().to(dtype=dtype, copy=zero3).cpu() for k, v in module.state_dict().items()}

        if zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                sd = collect()
        else:
            sd = collect()
        if sd is not None and getattr(self.model_config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        return sd

    def publish_weights(self) -> dict[str, float]:
        """Write the current weights as version :attr:`step` (durable), then announce it (rank 0).

        Collective: call on every rank. Publishing a version already published is a no-op.

        Returns:
            ``version``, ``publish_seconds``, ``publish_bytes`` (rank 0; other ranks get ``version``).

        Raises:
            asyncrl.core.weights.PublishError: the version directory exists or cannot be written.
        """
        from asyncrl.core.weights import write_weights

        version = self.step
        if version in self.published_versions:
            return {"version": float(version)}
        start = time.perf_counter()
        if getattr(self, "lora", False):
            return self._publish_adapter(version, start)
        sd = self.full_state_dict()
        out = {"version": float(version)}
        if self.rank == 0:
            config = self.model_config.to_dict()
            config["dtype"] = self.cfg.model.dtype
            config["torch_dtype"] = self.cfg.model.dtype
            config["use_cache"] = True
            gen = None
            if self.model_source is not None and (self.model_source / "generation_config.json").is_file():
                gen = json.loads((self.model_source / "generation_config.json").read_text())
            path, checksum = write_weights(self.weights_dir, version, sd, config, generation_config_json=gen,
                                           extra_files=self._extra_files, keep_last=self.cfg.weight_sync.keep_last)
            uri = self.http_server.uri_for(version) if self.http_server is not None else str(path.resolve())
            if self.nccl_pusher is not None:
                self.run_async(self.nccl_pusher.push(sd, version))
            if self.announce is not None:
                self.run_async(self.announce(version, uri, checksum))
            out.update({"publish_seconds": time.perf_counter() - start,
                        "publish_bytes": float((path / "model.safetensors").stat().st_size),
                        "uri": uri, "checksum": checksum})
        self._barrier()
        self.published_version = version
        self.published_versions.append(version)
        return out

    def _publish_adapter(self, version: int, start: float) -> dict[str, Any]:
        """``trainer.lora``: publish only the adapter (``adapter_model.safetensors`` +
        ``adapter_config.json``, PEFT's format; trainer/lora.py) as ``version``, then announce it.

        The checksum announced is the sha256 of ``adapter_model.safetensors``; rollout servers
        merge the adapter into their copy of the base weights (docs/trainer.md#lora); with ``nccl``
        the adapter is also pushed into the running engines. Collective: call on every rank.
        """
        from asyncrl.core.weights import ADAPTER_WEIGHTS_FILE, write_weights
        from trainer.lora import adapter_config_json, adapter_state_dict

        sd = adapter_state_dict(self.module, getattr(torch, self.cfg.model.dtype),
                                self.engine.zero_optimization_stage() == 3, self.rank)
        out: dict[str, Any] = {"version": float(version)}
        if self.rank == 0:
            config = adapter_config_json(self.module, str(self.model_source or self.cfg.model.path))
            path, checksum = write_weights(self.weights_dir, version, sd, config, adapter=True,
                                           keep_last=self.cfg.weight_sync.keep_last)
            uri = self.http_server.uri_for(version) if self.http_server is not None else str(path.resolve())
            if self.nccl_pusher is not None:
                self.run_async(self.nccl_pusher.push(sd, version, lora=(config, checksum)))
            if self.announce is not None:
                self.run_async(self.announce(version, uri, checksum))
            out.update({"publish_seconds": time.perf_counter() - start,
                        "publish_bytes": float((path / ADAPTER_WEIGHTS_FILE).stat().st_size),
                        "uri": uri, "checksum": checksum})
        self._barrier()
        self.published_version = version
        self.published_versions.append(version)
        return out
