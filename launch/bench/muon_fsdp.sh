#!/usr/bin/env bash
# FlashMuon on GPUS GPUs of one host (launch/bench/bench_muon_fsdp.py, NCCL): Llama-3.2-1B and Llama-3.1-8B
# shapes under FSDP2 over all GPUs, and FSDP2 x TP=2 from 4 GPUs; FlashMuon against torch.optim.Muon's
# whole-matrix baseline and FlashAdamW; the bit-identity check against one process on 1B, with a DCP
# checkpoint saved at GPUS ranks and resumed at GPUS / 2. Logs and JSON go to OUT (default runs/muon-fsdp-GPUS).
#
#     bash launch/bench/muon_fsdp.sh 8
#     SMALL=tiny LARGE=tiny EXTRA="--cpu --seq 32" bash launch/bench/muon_fsdp.sh 2 /tmp/muon  # the same on gloo
set -uo pipefail
cd "$(dirname "$0")/../.."
GPUS=${1:?usage: bash launch/bench/muon_fsdp.sh GPUS [OUT]}
OUT=${2:-runs/muon-fsdp-$GPUS}
mkdir -p "$OUT" && rm -rf "$OUT/ckpt"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
SMALL=${SMALL:-1b} LARGE=${LARGE:-8b}
read -r -a EXTRA <<< "${EXTRA:-}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
failed=()
run() {  # run NAME RANKS ARGS...: one torchrun, its log and JSON under OUT
  local name=$1 ranks=$2
  shift 2
  echo "== $name ($ranks ranks)"
  python3 -m torch.distributed.run --standalone --nproc_per_node="$ranks" launch/bench/bench_muon_fsdp.py "$@" \
    "${EXTRA[@]}" --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | grep -v '^W1\|NCCL' | tail -n 20
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("$name")
}
run "$SMALL-fsdp" "$GPUS" --model "$SMALL" --check --save "$OUT/ckpt"
run "$SMALL-resume" "$((GPUS / 2))" --model "$SMALL" --check --resume "$OUT/ckpt" --cases
run "$LARGE-fsdp" "$GPUS" --model "$LARGE"
if [ "$GPUS" -ge 4 ]; then
  run "$SMALL-fsdp-tp2" "$GPUS" --model "$SMALL" --tp 2 --check
  run "$LARGE-fsdp-tp2" "$GPUS" --model "$LARGE" --tp 2
fi
[ ${#failed[@]} = 0 ] || { echo "muon_fsdp.sh: failed: ${failed[*]} (logs in $OUT)"; exit 1; }
