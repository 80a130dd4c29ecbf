#!/usr/bin/env bash
# Fresh machine -> the main job, end to end, on the embedded defaults.
#   bash scripts/quickstart.sh            # short variant (~10 min of training on a 2-core CPU)
#   bash scripts/quickstart.sh --full     # the whole configs/smollm2_arith.yaml run
# Any other arguments are passed to `asyncrl train` (e.g. --partial_percent 0.5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${ASYNCRL_VENV:-.venv}
export VIRTUAL_ENV="$(cd "$VENV" && pwd)" PATH="$(cd "$VENV" && pwd)/bin:$PATH"
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
asyncrl models prepare smollm2-135m-instruct
short=(--run.name "quickstart-$(date +%Y%m%d-%H%M%S)" --run.max_wall_seconds 600)
if [ "${1:-}" = "--full" ]; then shift; short=(); fi
asyncrl train --config configs/smollm2_arith.yaml "${short[@]}" "$@"
run_dir=$(python -c 'import sys; from asyncrl.core.config import load_config; print(load_config(sys.argv[1:]).run.run_dir)' \
  --config configs/smollm2_arith.yaml "${short[@]}" "$@")
asyncrl report "$run_dir"
echo "quickstart: report in $run_dir/report.md and $run_dir/report.png"
