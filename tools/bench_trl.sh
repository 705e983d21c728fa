#!/usr/bin/env bash
# TRL's GRPOTrainer on brorl's bench model, for the side-by-side figure in docs/results/speed.md.
# TRL is not a dependency of brorl: this script installs it in its own venv (never the project's).
#
#   bash tools/bench_trl.sh                 # N=512 then N=64: completions/s and peak RSS
#   bash tools/bench_trl.sh 512 --steps 5   # one N, extra flags go to tools/bench_trl.py
#   python -m tools.bench --part step --trl /tmp/trl-venv/bin/python   # TRL interleaved with brorl
#
# Env: TRL_VENV (default /tmp/trl-venv), PYTHON (the project's python, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
VENV=${TRL_VENV:-/tmp/trl-venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  # Versions that were tested together (torch 2.13.0 is the CPU wheel on a CPU box; never an
  # unpinned torch, which would pull a multi-GB CUDA build).
  "$VENV/bin/pip" install -q torch==2.13.0 transformers==5.24.0 trl==1.16.0 accelerate==1.15.0 \
    datasets==5.2.0 numpy==2.4.6
fi

# The same randomly initialised model, tokenizer and prompts as bench.py, written by the project.
MODEL=$(mktemp -d /tmp/brorl-bench-model.XXXX)
trap 'rm -rf "$MODEL"' EXIT
"$PYTHON" -m tools.bench --save "$MODEL"

NS=(512 64)
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then NS=("$1"); shift; fi
for n in "${NS[@]}"; do
  if ! "$VENV/bin/python" tools/bench_trl.py --model_dir "$MODEL" --n "$n" "$@" >"$MODEL/log.txt" 2>&1; then
    tail -n 30 "$MODEL/log.txt"; exit 1
  fi
  grep -E '^(TRL|RESULT)' "$MODEL/log.txt"
done
