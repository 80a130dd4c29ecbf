"""The weight and LoRA endpoints' request bodies (``/update_weights_from_*``, ``/init_weights_update_group``,
``/destroy_weights_update_group``, ``/update_weight_version``, ``/load_lora_adapter``,
``/unload_lora_adapter``): one strict schema per endpoint, as :mod:`rollout_server.schemas` (whose
base, field types and error helper they use) says a schema is. docs/rollout.md ("Request validation
and isolation") lists their limits; :mod:`rollout_server.weight_endpoints` serves them.
"""

from typing import Annotated, Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from rollout_server.schemas import (
    MAX_ID_CHARS,
    MAX_PATH_CHARS,
    Count,
    Id,
    LoraName,
    _error,
    _one_or_list,
    _Strict,
    _version,
)

__all__ = [
    "MAX_TENSORS",
    "MAX_TENSOR_DIMS",
    "DestroyGroupBody",
    "InitGroupBody",
    "LoadLoraAdapterBody",
    "UnloadLoraAdapterBody",
    "UpdateFromDiskBody",
    "UpdateFromDistributedBody",
    "UpdateFromTensorBody",
    "UpdateWeightVersionBody",
]

#: tensors of one weight update, and dimensions of one tensor
MAX_TENSORS = 1_000_000
MAX_TENSOR_DIMS = 8


class _WeightUpdate(_Strict):
    weight_version: Optional[Any] = None
    abort_all_requests: bool = False
    flush_cache: bool = True  # SGLang's: false keeps the context cache's keys/values of the old weights
    torch_empty_cache: bool = False  # SGLang's; ignored (CPU)

    @field_validator("weight_version", mode="plain")
    @classmethod
    def _version(cls, v: Any) -> Optional[str]:
        return _version(v)


class UpdateFromDiskBody(_WeightUpdate):
    """``/update_weights_from_disk`` (SGLang's ``UpdateWeightFromDiskReqInput``; unused SGLang options ignored)."""

    model_path: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]
    load_format: Optional[Literal["auto", "safetensors"]] = None
    is_async: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: Count = 0


class UpdateFromTensorBody(_WeightUpdate):
    """``/update_weights_from_tensor``: base64 safetensors payloads (never pickle)."""

    serialized_named_tensors: _one_or_list(str, min_items=1, max_items=MAX_TENSORS)
    load_format: Optional[Literal["safetensors", "direct"]] = None
    disable_draft_model: Optional[bool] = None

    def blobs(self) -> list[str]:
        """The payloads as a list."""
        v = self.serialized_named_tensors
        return [v] if isinstance(v, str) else list(v)


class UpdateFromDistributedBody(_WeightUpdate):
    """``/update_weights_from_distributed``: the tensors rank 0 is about to broadcast, in order."""

    names: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]], Field(max_length=MAX_TENSORS)]
    dtypes: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=MAX_TENSORS)]
    shapes: Annotated[list[Annotated[list[Count], Field(max_length=MAX_TENSOR_DIMS)]], Field(max_length=MAX_TENSORS)]
    group_name: Id = "weight_update_group"
    load_format: Optional[Annotated[str, Field(max_length=64)]] = None
    lora_config: Optional[dict[str, Any]] = None
    """asyncrl's extension (not SGLang's): the broadcast tensors are a PEFT LoRA adapter with this
    ``adapter_config.json``, merged into the base weights (``trainer.lora`` over ``nccl``)."""
    lora_checksum: Optional[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = None
    """With ``lora_config``: the sha256 of the published ``adapter_model.safetensors``, reported back."""

    @model_validator(mode="after")
    def _same_lengths(self) -> "UpdateFromDistributedBody":
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise _error(f"names, dtypes and shapes must be lists of equal length, got {len(self.names)}, "
                         f"{len(self.dtypes)} and {len(self.shapes)}")
        if (self.lora_config is None) != (self.lora_checksum is None):
            raise _error("lora_config and lora_checksum go together (an adapter broadcast names its checksum)")
        return self


class LoadLoraAdapterBody(_Strict):
    """``/load_lora_adapter`` (SGLang's ``LoadLoRAAdapterReqInput``): register the PEFT adapter in
    directory ``lora_path`` under ``lora_name``; ``pinned`` and ``lora_id`` are SGLang's, ignored."""

    lora_name: LoraName
    lora_path: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]
    pinned: bool = False
    lora_id: Optional[Id] = None


class UnloadLoraAdapterBody(_Strict):
    """``/unload_lora_adapter`` (SGLang's ``UnloadLoRAAdapterReqInput``); ``lora_id`` is SGLang's, ignored."""

    lora_name: LoraName
    lora_id: Optional[Id] = None


class InitGroupBody(_Strict):
    """``/init_weights_update_group`` (SGLang's ``InitWeightsUpdateGroupReqInput``)."""

    master_address: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]
    master_port: Annotated[int, Field(ge=1, le=65535)]
    rank_offset: Annotated[int, Field(ge=0, le=65535)]
    world_size: Annotated[int, Field(ge=1, le=65536)]
    group_name: Id = "weight_update_group"
    backend: Annotated[str, Field(max_length=64)] = "nccl"

    @model_validator(mode="after")
    def _ranks(self) -> "InitGroupBody":
        """The trainer is rank 0 and this engine ``rank_offset`` (tensor parallel size 1): both inside the world."""
        if self.world_size < 2:
            raise _error(f"world_size must be at least 2 (the trainer is rank 0 and this engine one more rank), "
                         f"got {self.world_size}")
        if not 1 <= self.rank_offset < self.world_size:
            raise _error(f"rank_offset must be in [1, world_size - 1] = [1, {self.world_size - 1}] (rank 0 is the "
                         f"trainer), got {self.rank_offset}")
        return self


class DestroyGroupBody(_Strict):
    """``/destroy_weights_update_group``."""

    group_name: Id = "weight_update_group"


class UpdateWeightVersionBody(_Strict):
    """``/update_weight_version``: relabel the loaded weights (aborts running requests unless told not to)."""

    new_version: Any
    abort_all_requests: bool = True

    @field_validator("new_version", mode="plain")
    @classmethod
    def _version(cls, v: Any) -> str:
        return _version(v)
