"""The published weight directory: its format, its checksums, writing it and reading it back.

A trainer publishes policy version ``v`` as ``<weights_dir>/v<version:06d>/`` holding
``config.json``, ``model.safetensors`` (the full weights in the engine's dtype; tied embeddings
stored once, as ``save_pretrained`` does), ``generation_config.json`` when the source model has
one, the source model's tokenizer files (so a version directory is a complete model directory),
and ``SHA256SUMS`` (``sha256sum`` format, one line per file). The checksum announced on the
version clock is the sha256 of ``model.safetensors``.

Atomicity: :func:`write_weights` writes everything into a hidden temporary directory, fsyncs each
file and the directory, renames the directory into place and fsyncs the parent, so a reader sees
either no version directory or a complete one; then the oldest versions beyond ``keep_last`` are
deleted. :func:`verify_weights_dir` checks a directory against its ``SHA256SUMS``;
:func:`load_state_dict_from_dir` reads the ``*.safetensors`` files of any HF model directory
(this one, or a sharded one) into a CPU state dict, as an engine's ``/update_weights_from_disk``
does. Nothing here unpickles: safetensors and JSON only.

The trainer writes these directories (``trainer/publisher.py``) and the rollout servers read them
(``rollout_server/weight_endpoints.py``, ``rollout_server/worker_weights.py``); see
docs/architecture.md#weight-sync.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "WEIGHTS_FILE",
    "SUMS_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "ADAPTER_CONFIG_FILE",
    "is_adapter_dir",
    "weights_file_of",
    "PublishError",
    "ChecksumError",
    "WeightLoadError",
    "version_dir_name",
    "list_versions",
    "write_weights",
    "sha256_file",
    "verify_weights_dir",
    "load_state_dict_from_dir",
]

WEIGHTS_FILE = "model.safetensors"
SUMS_FILE = "SHA256SUMS"
#: An adapter-only version (``trainer.lora``) holds these instead of ``model.safetensors`` and
#: ``config.json``: PEFT's own file names, so the directory loads with ``PeftModel.from_pretrained``
#: and SGLang's ``/load_lora_adapter``. Its announced checksum is the sha256 of the adapter file.
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
_VERSION_RE = re.compile(r"^v(\d{6,})$")


class PublishError(RuntimeError):
    """Weights could not be published (bad version, existing directory, I/O failure)."""


class ChecksumError(ValueError):
    """Downloaded or local weight files do not match their checksum."""


def version_dir_name(version: int) -> str:
    """``v000007`` for version 7."""
    if version < 0:
        raise PublishError(f"policy version must be >= 0, got {version}")
    return f"v{version:06d}"


def list_versions(weights_dir: Path) -> list[int]:
    """Published versions present in ``weights_dir``, ascending (temporary directories ignored)."""
    weights_dir = Path(weights_dir)
    if not weights_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in weights_dir.iterdir() if p.is_dir() and (m := _VERSION_RE.match(p.name)))


def sha256_file(path: Path, chunk_bytes: int = 8 << 20) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> str:
    """Write and fsync ``data``; returns its hex sha256.

    The hash is computed from memory in a second thread while the file is written (hashlib
    releases the GIL on large buffers), so publishing costs max(write, hash), not their sum.
    """
    result: dict[str, str] = {}
    hasher = None
    if len(data) > (1 << 20):
        hasher = threading.Thread(target=lambda: result.update(h=hashlib.sha256(data).hexdigest()))
        hasher.start()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if hasher is None:
        return hashlib.sha256(data).hexdigest()
    hasher.join()
    return result["h"]


def write_weights(
    weights_dir: Path,
    version: int,
    state_dict: Mapping[str, Any],
    config_json: dict[str, Any],
    *,
    generation_config_json: dict[str, Any] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    keep_last: int | None = None,
    adapter: bool = False,
) -> tuple[Path, str]:
    """Write one version directory atomically and prune old versions.

    With ``adapter=True`` the version is adapter-only (``trainer.lora``): ``state_dict`` holds the
    PEFT adapter tensors (``get_peft_model_state_dict`` names) and is written as
    ``adapter_model.safetensors``, ``config_json`` is PEFT's ``adapter_config.json``.

    Args:
        weights_dir: parent directory of version directories (created if missing).
        version: the policy version (``v<version:06d>``); must not exist yet.
        state_dict: name -> CPU tensor, already in the engine dtype, tied duplicates removed.
        config_json: the model's ``config.json`` content (its ``dtype`` should match the tensors).
        generation_config_json: optional ``generation_config.json`` content.
        extra_files: other files copied verbatim (the tokenizer files, so that a version directory
            is a complete model directory usable as ``--model-path``).
        keep_last: keep only this many newest versions (None: keep all).

    Returns:
        ``(version directory, sha256 of model.safetensors or adapter_model.safetensors)``.

    Raises:
        PublishError: the version directory already exists (versions are immutable), or the write failed.
    """
    from safetensors.torch import save_file

    weights_dir = Path(weights_dir)
    weights_dir.mkdir(parents=True, exist_ok=True)
    final = weights_dir / version_dir_name(version)
    if final.exists():
        raise PublishError(f"{final} already exists: published versions are immutable (is another trainer running?)")
    tmp = weights_dir / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights_file = ADAPTER_WEIGHTS_FILE if adapter else WEIGHTS_FILE
    config_file = ADAPTER_CONFIG_FILE if adapter else "config.json"
    try:
        tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
        # save_file writes straight from the tensors (several times faster than building the
        # bytes in Python and writing them); the hash then re-reads the file from the page cache.
        save_file(tensors, str(tmp / weights_file), metadata={"format": "pt"})
        _fsync_file(tmp / weights_file)
        sums = {weights_file: sha256_file(tmp / weights_file)}
        sums[config_file] = _write_file(tmp / config_file, json.dumps(config_json, indent=2, sort_keys=True).encode())
        if generation_config_json is not None:
            sums["generation_config.json"] = _write_file(tmp / "generation_config.json",
                                                         json.dumps(generation_config_json, indent=2).encode())
        for name, data in (extra_files or {}).items():
            if "/" in name or name.startswith(".") or name in sums or name == SUMS_FILE:
                raise PublishError(f"extra file name {name!r} is not allowed in a version directory")
            sums[name] = _write_file(tmp / name, data)
        sums = dict(sorted(sums.items()))
        _write_file(tmp / SUMS_FILE, "".join(f"{h}  {n}\n" for n, h in sums.items()).encode())
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(weights_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PublishError(f"writing weights version {version} into {weights_dir} failed: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        for old in list_versions(weights_dir)[:-keep_last]:
            if old != version:
                shutil.rmtree(weights_dir / version_dir_name(old), ignore_errors=True)
    return final, sums[weights_file]


def is_adapter_dir(path: str | Path) -> bool:
    """True when ``path`` is an adapter-only version (it holds ``adapter_config.json``)."""
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file()


def weights_file_of(sums: Mapping[str, str]) -> str:
    """The file whose sha256 is a version's announced checksum: ``model.safetensors`` or, in an
    adapter-only version, ``adapter_model.safetensors``.

    Raises:
        ChecksumError: ``sums`` lists neither (or both).
    """
    present = [n for n in (WEIGHTS_FILE, ADAPTER_WEIGHTS_FILE) if n in sums]
    if len(present) != 1:
        raise ChecksumError(f"{SUMS_FILE} must list exactly one of {WEIGHTS_FILE}, {ADAPTER_WEIGHTS_FILE}; it lists "
                            f"{present or 'neither'}")
    return present[0]


def _read_sums(text: str) -> dict[str, str]:
    sums = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-f]{64}", parts[0]):
            raise ChecksumError(f"malformed {SUMS_FILE} line: {line!r}")
        name = parts[1].strip().lstrip("*")
        if "/" in name or name.startswith(".") or not name:
            raise ChecksumError(f"{SUMS_FILE} names a file outside the directory: {name!r}")
        sums[name] = parts[0]
    weights_file_of(sums)
    return sums


def verify_weights_dir(path: Path, checksum: str | None = None) -> None:
    """Check every file listed in ``SHA256SUMS`` (and ``checksum`` of model.safetensors when given;
    of adapter_model.safetensors in an adapter-only version).

    Raises:
        ChecksumError: a file is missing or its hash differs (the message names it).
    """
    path = Path(path)
    try:
        sums = _read_sums((path / SUMS_FILE).read_text())
    except FileNotFoundError:
        raise ChecksumError(f"{path} has no {SUMS_FILE}") from None
    main = weights_file_of(sums)
    if checksum is not None and sums[main] != checksum:
        raise ChecksumError(f"{path}: {SUMS_FILE} lists {main} as {sums[main]}, announced {checksum}")
    for name, expected in sums.items():
        if not (path / name).is_file():
            raise ChecksumError(f"{path}: {name} is missing")
        got = sha256_file(path / name)
        if got != expected:
            raise ChecksumError(f"{path}: {name} has sha256 {got}, expected {expected}")


class WeightLoadError(ValueError):
    """Weights could not be read or do not fit the model; the message names the file or tensor."""


def load_state_dict_from_dir(path: str | Path) -> dict[str, Any]:
    """Read every ``*.safetensors`` file of an HF model directory into one CPU state dict.

    Raises:
        WeightLoadError: the directory is missing, has no safetensors file, a file is
            unreadable or truncated, or two files hold the same tensor name.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise WeightLoadError(f"{path} is not a directory (expected an HF model directory with *.safetensors)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{path} contains no *.safetensors file")
    state: dict[str, Any] = {}
    for f in files:
        try:
            part = load_file(str(f), device="cpu")
        except Exception as exc:  # SafetensorError, OSError
            raise WeightLoadError(f"cannot read {f}: {exc}") from exc
        dup = set(part) & set(state)
        if dup:
            raise WeightLoadError(f"tensor {sorted(dup)[0]!r} appears in more than one file of {path}")
        state.update(part)
    return state
