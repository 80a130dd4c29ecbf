"""LoRA adapter directories as full models: what evaluation loads when a run trains an adapter.

A run with ``trainer.lora`` publishes each policy version as a PEFT adapter only
(``adapter_model.safetensors`` + ``adapter_config.json``; docs/trainer.md#lora), which the rollout
engines merge or apply per request. Anything that loads a *model directory* — the controller's
held-out evaluation, ``asyncrl eval --model`` — needs the full weights instead: :func:`merge_adapter`
loads the base model, applies the adapter with the ``peft`` library (``PeftModel.from_pretrained``)
and merges it (``merge_and_unload``: ``W + (alpha / r) · B A`` per targeted linear layer, Hu et al.
2021, arXiv 2106.09685), then saves a safetensors Hugging Face directory with the base model's
tokenizer and chat template.

The directory is written into a temporary sibling and renamed into place, like a prepared model,
so a crash never leaves a half-written one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from asyncrl.models.cache import CorruptModelError, ModelNotFoundError

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "is_adapter_dir", "adapter_base", "merge_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_FULL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a PEFT adapter (``adapter_config.json``) and no full
    weights (``model.safetensors`` or its index)."""
    p = Path(path)
    return p.is_dir() and (p / ADAPTER_CONFIG).is_file() and not any((p / f).exists() for f in _FULL_WEIGHTS)


def adapter_base(adapter_dir: str | Path) -> str:
    """The base model an adapter was trained on: ``base_model_name_or_path`` of its
    ``adapter_config.json`` (asyncrl's trainer writes the run's ``model.path`` there).

    Raises:
        CorruptModelError: the config is unreadable or names no base model.
    """
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        base = json.loads(path.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as exc:
        raise CorruptModelError(f"cannot read {path}: {exc}") from None
    if not base:
        raise CorruptModelError(f"{path} names no base model (base_model_name_or_path): merge it with an explicit base")
    return str(base)


def merge_adapter(adapter_dir: str | Path, base: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write ``base`` with the LoRA adapter of ``adapter_dir`` merged into it, as a full model directory.

    Args:
        adapter_dir: a PEFT adapter directory (:func:`is_adapter_dir`).
        base: the base model, as :func:`asyncrl.models.resolve_model_path` takes it (a prepared
            name or a Hugging Face directory).
        out_dir: where the merged model goes; replaced if it exists.
        dtype: the merged weights' dtype (``float32``, ``bfloat16``, ``float16``).

    Returns:
        ``out_dir`` (resolved): ``config.json``, ``model.safetensors`` and the base model's
        tokenizer and chat-template files.

    Raises:
        ModelNotFoundError: ``adapter_dir`` or ``base`` does not exist.
        CorruptModelError: ``adapter_dir`` is not an adapter directory, or PEFT cannot apply it to
            the base model (the message names the directory and the cause).
    """
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    if not adapter_dir.is_dir():
        raise ModelNotFoundError(f"adapter directory {adapter_dir} does not exist")
    if not is_adapter_dir(adapter_dir) or not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise CorruptModelError(f"{adapter_dir} is not a LoRA adapter directory ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, "
                                "no full weights)")
    from asyncrl.models.resolve import load_causal_lm, resolve_model_path

    base_dir = resolve_model_path(base)
    model = load_causal_lm(base_dir, dtype)
    try:
        from peft import PeftModel

        merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    except Exception as exc:  # peft raises many types for mismatched adapters
        raise CorruptModelError(f"cannot apply the adapter in {adapter_dir} to {base_dir}: "
                                f"{type(exc).__name__}: {exc}") from exc
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        for f in base_dir.iterdir():  # tokenizer, chat template, generation config
            weightish = f.suffix in (".safetensors", ".bin", ".pt", ".gguf") or f.name.endswith(".index.json")
            if f.is_file() and not weightish and not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)
        if out_dir.exists() or out_dir.is_symlink():
            if out_dir.is_dir() and not out_dir.is_symlink():
                shutil.rmtree(out_dir)
            else:
                out_dir.unlink()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir.resolve()
