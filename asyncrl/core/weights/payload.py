"""The ``tensor`` weight payload: a state dict as base64 safetensors in JSON (``/update_weights_from_tensor``).

:func:`encode_safetensors_payload` is the sender's side (``rollout_server.client.EngineClient``),
:func:`decode_safetensors_payload` the embedded engine's (``rollout_server/weight_endpoints.py``).
Never pickle: real SGLang ships pickled CUDA IPC handles in this field, which only works on one
node and is unsafe to accept from the network, so asyncrl's embedded engine speaks safetensors
only and rejects anything else with :class:`~asyncrl.core.weights.directory.WeightLoadError`.
"""

from __future__ import annotations

import base64
from typing import Any, Iterable

from asyncrl.core.weights.directory import WeightLoadError

__all__ = ["encode_safetensors_payload", "decode_safetensors_payload"]


def encode_safetensors_payload(named_tensors: dict[str, Any] | Iterable[tuple[str, Any]]) -> str:
    """Serialize ``{name: tensor}`` as base64 safetensors (the ``/update_weights_from_tensor`` payload)."""
    from safetensors.torch import save

    items = dict(named_tensors)
    return base64.b64encode(save({k: v.detach().contiguous().cpu() for k, v in items.items()})).decode("ascii")


def decode_safetensors_payload(blobs: list[str]) -> dict[str, Any]:
    """Decode base64 safetensors payloads into one state dict.

    Raises:
        WeightLoadError: a payload is not base64 or not safetensors (e.g. a pickle).
    """
    from safetensors.torch import load

    state: dict[str, Any] = {}
    for i, blob in enumerate(blobs):
        try:
            raw = base64.b64decode(blob, validate=True)
        except (ValueError, TypeError) as exc:
            raise WeightLoadError(f"serialized_named_tensors[{i}] is not base64: {exc}") from exc
        try:
            state.update(load(raw))
        except Exception as exc:
            raise WeightLoadError(
                f"serialized_named_tensors[{i}] is not a safetensors payload ({exc}); the embedded engine accepts "
                "safetensors only, never pickle"
            ) from exc
    return state
