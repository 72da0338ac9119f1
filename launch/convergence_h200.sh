#!/usr/bin/env bash
# launch/convergence.py at GPT-2-small scale on one H200, in commands of at most 9 minutes (docs/convergence.md).
#
#   OUT=/some/dir bash launch/convergence_h200.sh            # partial: every phase in one command
#   OUT=/some/dir bash launch/convergence_h200.sh full       # full: again until convergence.md says "Partial: none"
#   OUT=/some/dir bash launch/convergence_h200.sh muon --seeds 0 --variants ...   # Muon against AdamW, main phase
#
# partial: the five variants side by side (AdamW and FlashAdamW 24-bit with seeds 0 and 1), a short cosine
#   schedule, then the low-learning-rate phase from AdamW's weights; whatever the time budget cuts is reported
#   as partial. full: 105 M tokens per run, checkpointed; each invocation continues the unfinished runs from
#   RUNS (which must survive between commands) and stops inside its budget.
# Results (at most 8 files) go to OUT: convergence.md/.json, convergence.png, rho.png, corpus.json, logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-partial}
shift $(( $# > 0 ? 1 : 0 ))  # the rest goes to convergence.py (later flags win)
: "${OUT:?set OUT to the folder that receives the results}"
PY=${PYTHON:-python3}
RUNS=${RUNS:-runs/convergence-$MODE}
BUDGET=${BUDGET:-470}  # seconds for convergence.py; the rest of 9 minutes is start-up and packing
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # 7 processes share the card
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case $MODE in
  partial) "$PY" launch/convergence.py --config gpt2-small --out "$RUNS" --time-budget "$BUDGET" \
             --steps 480 --rho-steps 240 --rho-share 0.38 --compile off "$@" ;;
  full) "$PY" launch/convergence.py --config gpt2-small --out "$RUNS" --time-budget "$BUDGET" \
          --steps 6400 --rho-steps 2000 --rho-share 0 --ckpt "$@" ;;
  muon) "$PY" launch/convergence.py --config gpt2-small --out "$RUNS" --time-budget "$BUDGET" \
          --phases main --steps "${STEPS:-1500}" --rho-share 0 --compile off "$@" ;;
  *) echo "convergence_h200.sh: unknown mode '$MODE': use partial, full or muon" >&2; exit 2 ;;
esac
rc=$?
for f in convergence.md convergence.json convergence.png rho.png corpus.json; do
  [ -f "$RUNS/$f" ] && cp "$RUNS/$f" "$OUT/"
done
(cd "$RUNS" && tar czf "$OUT/logs.tgz" --ignore-failed-read */*/log.jsonl */*/summary.json */*/stdout.log 2>/dev/null)
exit $rc
