#!/usr/bin/env bash
# One-shot GPU check (issue 28 item 5): engine decode, trainer tokens/s + MFU, weight publish and
# load, the main job for 20 steps, the gpu-marked tests and SGLang's presence, on one CUDA GPU.
# Writes docs/bench/gpu/gpu_check-<UTC timestamp>.json; ends within 12 minutes on one H100.
#
#   bench/gpu_check.sh                 # everything that the machine has the requirements for
#   bench/gpu_check.sh --dry-run       # the plan: stages, commands, timeouts (runs nothing)
#   bench/gpu_check.sh --wheels DIR    # first pip-install DIR/*.whl (no network needed)
#   bench/gpu_check.sh --help          # every option
#
# The logic is in bench/gpu_check.py; this wrapper picks the interpreter ($PYTHON, else the
# repository's .venv, else python3) and puts the repository on PYTHONPATH, so a bare machine
# with CUDA torch and a copy of the working tree needs no install of asyncrl itself.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x "$repo/.venv/bin/python" ]]; then
  py="$repo/.venv/bin/python"
else
  py="$(command -v python3 || command -v python)"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$repo"
exec "$py" "$repo/bench/gpu_check.py" "$@"
