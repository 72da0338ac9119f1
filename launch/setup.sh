#!/usr/bin/env bash
# Creates .venv (once) with torch, triton, pytest and flashdist (editable). Safe to run again.
# CPU machines: torch==2.13.0 is pinned because an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FLASHDIST_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# setuptools >= 77 (pyproject's SPDX license): tests/test_packaging.py builds the wheel with it, and a venv
# comes with an older one (Python 3.11) or none (3.12 on)
if ! "$PY" -c "import torch, triton, pytest, safetensors, ninja, setuptools
assert int(setuptools.__version__.split('.')[0]) >= 77" 2>/dev/null; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==${FLASHDIST_TORCH:-2.13.0}" triton pytest safetensors matplotlib ninja "setuptools>=77"
fi
if ! "$PY" -c "import deepspeed" 2>/dev/null; then  # after torch, so pip keeps the CPU torch
  DS_BUILD_OPS=0 "$PY" -m pip install -q "deepspeed==0.19.8"
fi
# The real clients flashdist integrates with, as test extras (tests build tiny models from configs). The
# constraint keeps the CPU torch: a client that asks for a newer torch would otherwise pull a CUDA build.
if ! "$PY" -c "import transformers, accelerate, lightning, torchtitan, peft" 2>/dev/null; then
  "$PY" -m pip install -q -c <(echo "torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')") \
    "transformers>=5.17,<6" "accelerate>=1.15" "lightning>=2.6" "torchtitan==0.3.0" "peft>=0.21"
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || "$PY" -m pip install -q --no-deps -e .
echo "$PY"
