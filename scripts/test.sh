#!/usr/bin/env bash
# Run the whole test suite (unit, integration, real-model and crash tests) from a fresh machine.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for the quick loop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The suite runs in setup's virtual environment: its python, and its `asyncrl` script on PATH.
VENV=${ASYNCRL_VENV:-.venv}
export VIRTUAL_ENV="$(cd "$VENV" && pwd)" PATH="$(cd "$VENV" && pwd)/bin:$PATH"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python -m pytest -q --durations=25 "$@"
