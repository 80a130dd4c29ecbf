"""Validation of a Hugging Face model directory without loading its weights.

One job: say whether a directory is a usable causal LM (config, every safetensors file's
header and length, tokenizer files), raising :class:`CorruptModelError` naming the bad file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.models.cache import CorruptModelError, ModelNotFoundError


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
