"""Where prepared models live and how asyncrl writes a model directory there.

One job: the on-disk model cache. The errors every model function raises, the cache location
(``$ASYNCRL_CACHE_DIR``), the marker file asyncrl writes into each directory it prepares, and
the steps shared by the tiny model and GGUF preparation: configs loadable by transformers 4.x
and 5.x, readable modes, and an atomic rename into place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


class ModelError(RuntimeError):
    """A model could not be found, prepared or loaded; the message says what to do."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """No model under that name or path; the message names the command that prepares it."""


class CorruptModelError(ModelError):
    """A model directory exists but a file in it is missing or unreadable; the message names the file."""


def cache_root() -> Path:
    """``$ASYNCRL_CACHE_DIR`` if set, else ``~/.cache/asyncrl``."""
    env = os.environ.get("ASYNCRL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "asyncrl"


def models_dir(cache: Path | str | None = None) -> Path:
    """Directory holding prepared models: ``<cache root>/models``."""
    return (Path(cache).expanduser() if cache else cache_root()) / "models"


#: marker file asyncrl writes into every directory it prepares (source, parameters, format version)
MARKER_FILE = "asyncrl_model.json"


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


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
