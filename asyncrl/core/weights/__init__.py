"""Weight sync between the trainer and the rollout servers: what both sides share.

The trainer publishes each policy version as a checksummed directory and the rollout servers
load it; both ends of every transport live here, so ``trainer/`` and ``rollout_server/`` never
import each other (docs/architecture.md#weight-sync):

* :mod:`asyncrl.core.weights.directory` — the version directory (``v000007/``: ``config.json``,
  ``model.safetensors``, tokenizer files, ``SHA256SUMS``; or, adapter-only under ``trainer.lora``,
  ``adapter_model.safetensors`` + ``adapter_config.json``), its atomic writer, its checksums and
  the safetensors reader (``disk`` transport: the uri is the directory);
* :mod:`asyncrl.core.weights.http` — the ``http`` transport: the trainer's file server and the
  verified, atomic download of a rollout server;
* :mod:`asyncrl.core.weights.distributed` — the ``nccl`` transport: SGLang's
  ``/init_weights_update_group`` + ``/update_weights_from_distributed`` choreography, sender
  and receiver (NCCL on GPUs, gloo on CPUs);
* :mod:`asyncrl.core.weights.payload` — the base64 safetensors payload of
  ``/update_weights_from_tensor``.

No transport unpickles data from the network. Heavy imports (torch, safetensors, aiohttp) happen
inside the functions that need them.
"""

from asyncrl.core.weights.directory import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    SUMS_FILE,
    WEIGHTS_FILE,
    ChecksumError,
    PublishError,
    WeightLoadError,
    is_adapter_dir,
    list_versions,
    load_state_dict_from_dir,
    sha256_file,
    verify_weights_dir,
    version_dir_name,
    weights_file_of,
    write_weights,
)
from asyncrl.core.weights.distributed import DistributedWeightSender, init_weights_update_group, receive_broadcast_weights
from asyncrl.core.weights.http import WeightFileServer, download_weights
from asyncrl.core.weights.payload import decode_safetensors_payload, encode_safetensors_payload

__all__ = [
    "ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "is_adapter_dir", "weights_file_of",
    "SUMS_FILE", "WEIGHTS_FILE", "ChecksumError", "PublishError", "WeightLoadError", "list_versions",
    "load_state_dict_from_dir", "sha256_file", "verify_weights_dir", "version_dir_name", "write_weights",
    "DistributedWeightSender", "init_weights_update_group", "receive_broadcast_weights", "WeightFileServer",
    "download_weights", "decode_safetensors_payload", "encode_safetensors_payload",
]
