"""``asyncrl models``: prepare, list and locate models from the command line."""

from __future__ import annotations

import sys

from asyncrl.models.cache import ModelError, cache_root, models_dir
from asyncrl.models.gguf import KNOWN_MODELS, find_gguf, list_prepared, prepare_model
from asyncrl.models.resolve import resolve_model_path
from asyncrl.models.tiny import TINY_MODEL_NAME

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
