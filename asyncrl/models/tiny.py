"""The tiny random test model: a Llama-style causal LM and a BPE tokenizer trained on a shipped corpus.

One job: build (once, deterministically) the model ``model.path: tiny`` names; it is for tests
and the ``configs/tiny.yaml`` smoke run and learns nothing useful.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from asyncrl.models.cache import (
    MARKER_FILE,
    ModelError,
    _install_atomically,
    _make_readable,
    _portable_model_config,
    _portable_tokenizer_config,
    _read_marker,
)

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
_TINY_FORMAT_VERSION = 3


def _tiny_marker(seed: int) -> dict[str, Any]:
    return {"kind": "asyncrl-tiny", "format_version": _TINY_FORMAT_VERSION, "seed": seed,
            "vocab_size_target": _TINY_VOCAB_SIZE, "arch": _TINY_ARCH}


def _train_tiny_tokenizer() -> Any:
    """Byte-level BPE (digits split individually) trained on the shipped corpus; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from asyncrl.models import assets

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
    _portable_tokenizer_config(tmp, CHATML_TEMPLATE, _TINY_ARCH["max_position_embeddings"])
    ids = {t: tok.token_to_id(t) for t in _TINY_SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **_TINY_ARCH,
    )
    config.dtype = "float32"
    model = LlamaForCausalLM(config).to(torch.float32)
    # Re-initialise every weight from a private generator: independent of the global torch RNG
    # (other threads may be sampling) and of transformers' init scheme, so a seed always gives
    # the same bytes. Norm gains are 1, everything else N(0, initializer_range^2) (Llama init).
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * config.initializer_range)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
    )
    model.save_pretrained(tmp)
    _portable_model_config(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    (tmp / MARKER_FILE).write_text(json.dumps({**_tiny_marker(seed), "params": n_params}, indent=2))
    _make_readable(tmp)


def build_tiny_model(out_dir: Path | str, seed: int = 0) -> Path:
    """Build (once) a tiny random Llama-style causal LM and its tokenizer as an HF directory.

    Architecture: hidden 64, 2 layers, 4 attention heads, 2 KV heads, MLP 128, context 1024
    tokens, tied embeddings, fp32 (~0.1 M parameters). Tokenizer: byte-level BPE with
    ~768 tokens trained by ``tokenizers`` on ``asyncrl/models/assets/tiny_corpus.txt``, digits split
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
