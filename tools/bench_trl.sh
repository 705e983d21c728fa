#!/usr/bin/env bash
# TRL's GRPOTrainer on brorl's bench model, for the side-by-side figure in docs/results/speed.md.
# TRL is not a dependency of brorl: this script installs it in its own venv (never the project's).
#
#   bash tools/bench_trl.sh                 # N=512 then N=64: completions/s and peak RSS
#   bash tools/bench_trl.sh 512 --steps 5   # one N, extra flags go to tools/bench_trl.py
#   bash tools/bench_trl.sh --model smollm2-135m-instruct --task math:assets/smollm2/add2.jsonl 64 --new 16
#                                           # a real model (a folder, hub id or alias) and its
#                                           # task's first 2 prompts, as tools/bench.py --model
#   bash tools/bench_trl.sh 64 --dtype bfloat16   # TRL's bf16=True (mixed precision, fp32 weights)
#   python -m tools.bench --part step --trl /tmp/trl-venv/bin/python   # TRL interleaved with brorl
#
# Env: TRL_VENV (default /tmp/trl-venv), PYTHON (the project's python, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root
VENV=${TRL_VENV:-/tmp/trl-venv}
PYTHON=${PYTHON:-python3}

# --model NAME and --task TASK (first, in either order): a real model instead of the bench model
NAME="" TASK=""
while [ $# -gt 1 ] && { [ "$1" = --model ] || [ "$1" = --task ]; }; do
  if [ "$1" = --model ]; then NAME=$2; else TASK=$2; fi
  shift 2
done
if [ -n "$TASK" ] && [ -z "$NAME" ]; then echo "bench_trl.sh: --task $TASK: only with --model" >&2; exit 2; fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  # Versions that were tested together (torch 2.13.0 is the CPU wheel on a CPU box; never an
  # unpinned torch, which would pull a multi-GB CUDA build).
  "$VENV/bin/pip" install -q torch==2.13.0 transformers==5.24.0 trl==1.16.0 accelerate==1.15.0 \
    datasets==5.2.0 numpy==2.4.6
fi

# The same model, tokenizer and prompts as bench.py, written by the project: the randomly
# initialised bench model, or a real model's folder (model_dir) and prompts.
WORK=$(mktemp -d /tmp/brorl-bench-model.XXXX)
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m tools.bench --save "$WORK" ${NAME:+--model "$NAME"} ${TASK:+--task "$TASK"}
MODEL=$WORK
if [ -n "$NAME" ]; then MODEL=$(cat "$WORK/model_dir"); fi

NS=(512 64)
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then NS=("$1"); shift; fi
for n in "${NS[@]}"; do
  if ! "$VENV/bin/python" tools/bench_trl.py --model_dir "$MODEL" --prompts "$WORK/prompts.json" \
      --n "$n" "$@" >"$WORK/log.txt" 2>&1; then
    tail -n 30 "$WORK/log.txt"; exit 1
  fi
  grep -E '^(TRL|RESULT)' "$WORK/log.txt"
done
