#!/usr/bin/env bash
# The main job: from a fresh clone, set up .venv, then train a byte-level GPT on the installed Python
# sources (standard library and site-packages) with FSDP2 on 2 ranks and FlashAdamW (CPU + gloo, or CUDA + NCCL where GPUs exist):
# 100 steps and a checkpoint, a resume from that checkpoint to step 150, a short torch.optim.AdamW run
# for the memory comparison, and a summary. Takes a few minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash launch/setup.sh | tail -n 1)
RUN=${FLASHDIST_RUN_DIR:-runs/main}
STEPS=${FLASHDIST_STEPS:-150}
FIRST=$((STEPS * 2 / 3))
NPROC=${FLASHDIST_NPROC:-2}
rm -rf "$RUN"
export PYTHONWARNINGS=ignore OMP_NUM_THREADS=1
torchrun_() { "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" "$@" 2>&1 | grep -v '^W1\|^\*\*\*\*\|OMP_NUM_THREADS'; }
echo "== FlashAdamW, steps 0 -> $FIRST, checkpoint at $FIRST"
torchrun_ launch/train.py --steps "$STEPS" --stop-at "$FIRST" --ckpt-dir "$RUN/ckpt" --ckpt-every 50 \
  --out-dir "$RUN/flash" --log-every 10 --eval-every 25
echo "== FlashAdamW, resumed from $RUN/ckpt/latest: steps $FIRST -> $STEPS"
torchrun_ launch/train.py --steps "$STEPS" --ckpt-dir "$RUN/ckpt" --ckpt-every 50 --resume \
  --out-dir "$RUN/flash" --log-every 10 --eval-every 25
echo "== torch.optim.AdamW (fp32 master weights), 10 steps, for the memory comparison"
torchrun_ launch/train.py --optimizer adamw --steps 10 --out-dir "$RUN/adamw" --log-every 5 --eval-every 10
"$PY" launch/summarize.py "$RUN/flash/summary.json" "$RUN/adamw/summary.json"
