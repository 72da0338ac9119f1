#!/usr/bin/env bash
# One pass on a 2-GPU machine (torch and triton preinstalled): the GPU tests, the optimizer-step benchmark,
# the FSDP2 Llama-1B benchmark on 2 ranks, and the convergence comparison. Logs and JSON go to $OUT
# (default runs/gpu). Optional wheels in .whl/ (e.g. flashoptim for the peer rows) are installed first.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/flashoptim*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
step() { echo "== $1"; shift; "$@" 2>&1 | tee "$OUT/$NAME.log" | grep -v '^W1\|NCCL' | tail -n 25; }
NAME=gpu_tests step "pytest -m gpu" python3 -m pytest -m gpu tests/test_gpu.py tests/test_capturable.py -q -x
NAME=bench_step step "optimizer step" python3 launch/bench/bench_step.py --out "$OUT/bench_step.json"
NAME=bench_fsdp step "FSDP2 Llama-1B, 2 ranks" python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
  launch/bench/bench_fsdp.py --model 1b --batch 4 --rounds 3 --check --out "$OUT/bench_fsdp.json"
CONV=${CONV_DIR:-/tmp/convergence}
echo "== convergence"
python3 launch/convergence.py --out "$CONV" --steps "${CONV_STEPS:-1200}" 2>&1 | tail -n 12
cp "$CONV/convergence.json" "$CONV/convergence.png" "$OUT/" 2>/dev/null
