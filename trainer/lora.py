"""LoRA on the actor (``trainer.lora``): a PEFT adapter, the adapter-disabled reference, adapter-only publishing.

The adapter is PEFT's (``peft.get_peft_model`` with a ``peft.LoraConfig``; Hu et al. 2021,
arXiv 2106.09685), not layers of our own: every targeted ``nn.Linear`` computes
``W x + (alpha / r) * B A x`` with ``A`` (r, in) random and ``B`` (out, r) zero at the start, so
version 0 is exactly the base model. Only ``A`` and ``B`` require grad, so DeepSpeed's optimizer
(and its checkpointed state) holds only the adapter's parameters.

* The reference policy of the KL terms is the same module with the adapter disabled
  (:class:`AdapterDisabled`, PEFT's ``disable_adapter()`` context): the frozen base, no second copy.
* A published version is adapter-only (:func:`adapter_state_dict`, :func:`adapter_config_json`):
  ``adapter_model.safetensors`` + ``adapter_config.json`` in PEFT's own format
  (``PeftModel.from_pretrained`` loads it), written by :func:`asyncrl.core.weights.write_weights`
  with ``adapter=True``. The embedded rollout engine merges it into a copy of its base weights
  (``rollout_server/engine_weights.py``).
"""

from __future__ import annotations

import json
from typing import Any

import torch

__all__ = ["apply_lora", "AdapterDisabled", "adapter_state_dict", "adapter_config_json"]


def apply_lora(model: Any, lora_cfg: Any) -> Any:
    """Wrap ``model`` (a transformers causal LM) in a PEFT LoRA model; only the adapter trains.

    Args:
        model: the actor, fp32 weights.
        lora_cfg: :class:`asyncrl.core.config_trainer.LoraConfig` (``rank``, ``alpha``,
            ``dropout``, ``target_modules``).

    Returns:
        a ``peft.PeftModel`` around ``model`` (base weights frozen, adapter ``B`` zero).

    Raises:
        ValueError: no module of ``model`` matches ``target_modules`` (PEFT's message names them).
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=int(lora_cfg.rank), lora_alpha=float(lora_cfg.alpha), lora_dropout=float(lora_cfg.dropout),
                        target_modules=list(lora_cfg.target_modules), bias="none")
    return get_peft_model(model, config)


class AdapterDisabled:
    """Calls a PEFT model (or the DeepSpeed engine around one) with its adapter disabled: the base policy.

    Args:
        runner: what to call (the DeepSpeed engine, so that ZeRO-3 gathers the parameters).
        peft_model: the ``peft.PeftModel`` inside ``runner`` whose adapter is switched off.

    ``module`` is the PEFT model, so :func:`trainer.packing.packed_logits` finds its config.
    """

    def __init__(self, runner: Any, peft_model: Any):
        self.runner, self.module = runner, peft_model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``runner(*args, **kwargs)`` under ``peft_model.disable_adapter()``."""
        with self.module.disable_adapter():
            return self.runner(*args, **kwargs)


def adapter_state_dict(peft_model: Any, dtype: torch.dtype, zero3: bool, rank: int) -> dict[str, torch.Tensor] | None:
    """The adapter's tensors on rank 0 (``get_peft_model_state_dict`` names), cast to ``dtype``, on CPU.

    Names look like ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: A is
    (r, in_features), B is (out_features, r). Collective under ZeRO-3 (gathers only the adapter's
    parameters); None on other ranks.
    """
    from peft import get_peft_model_state_dict

    def collect():
        if rank != 0:
            return None
        return {k: v.detach().to(dtype=dtype, copy=True).cpu() for k, v in get_peft_model_state_dict(peft_model).items()}

    if zero3:
        import deepspeed

        params = [p for n, p in peft_model.named_parameters() if "lora_" in n]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return collect()
    return collect()


def adapter_config_json(peft_model: Any, base_model_path: str | None = None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` content for the active adapter (JSON-safe: sets become sorted lists)."""
    cfg = peft_model.peft_config[peft_model.active_adapter].to_dict()
    if base_model_path:
        cfg["base_model_name_or_path"] = str(base_model_path)

    def plain(value: Any) -> Any:
        if isinstance(value, set):
            return sorted(value)
        if hasattr(value, "value") and not isinstance(value, (str, int, float, bool)):  # enums
            return value.value
        return value

    return json.loads(json.dumps({k: plain(v) for k, v in cfg.items()}, default=str))
