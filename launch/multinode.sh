#!/usr/bin/env bash
# Multi-node training with launch/train.py: run this script once on EVERY node, with the same settings.
# torchrun's c10d rendezvous joins the nodes (no node ranks to hand out); the mesh defaults to HSDP with one
# replica group per node (train.py --replicas / --shards change it); checkpoints go to CKPT_DIR, which must be
# one directory on storage that every node mounts (docs/scaling.md: what that storage must provide); a job
# started again with the same CKPT_DIR, after a failure or a SLURM requeue, continues from its last checkpoint.
#
#   NNODES=2 RDZV_HOST=node0.example CKPT_DIR=/shared/run1/ckpt bash launch/multinode.sh --steps 2000
#
# Settings (environment):
#   NNODES          number of nodes (required); MIN:MAX for an elastic job
#   RDZV_HOST       the address of one node, reachable from every node, the same everywhere (required)
#   RDZV_PORT       rendezvous port on RDZV_HOST (default 29500)
#   JOB_ID          rendezvous id, the same on every node (default flashdist)
#   NPROC_PER_NODE  ranks per node (default: the GPUs torch sees, else 1)
#   NODE_RANK       set it (0..NNODES-1) to use a static rendezvous (RDZV_HOST = node 0) instead of c10d
#   MAX_RESTARTS    torchrun restarts of the workers after a failure (default 3)
#   CKPT_DIR        checkpoint directory on shared storage (required); CKPT_EVERY steps (default 100)
#   PYTHON          the interpreter (default: python)
# Every other argument goes to launch/train.py.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root: torchrun runs the checkout's launch.train (and flashdist)
: "${NNODES:?set NNODES, the number of nodes}"
: "${RDZV_HOST:?set RDZV_HOST, an address of one node that every node can reach}"
: "${CKPT_DIR:?set CKPT_DIR, a checkpoint directory on storage that every node mounts}"
PY=${PYTHON:-python}
NPROC=${NPROC_PER_NODE:-$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))')}
if [[ -n "${NODE_RANK:-}" ]]; then
  RDZV=(--node-rank="$NODE_RANK" --master-addr="$RDZV_HOST" --master-port="${RDZV_PORT:-29500}")
else
  RDZV=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:${RDZV_PORT:-29500}" --rdzv-id="${JOB_ID:-flashdist}")
fi
exec "$PY" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC" "${RDZV[@]}" \
  --max-restarts="${MAX_RESTARTS:-3}" -m launch.train --ckpt-dir "$CKPT_DIR" --ckpt-every "${CKPT_EVERY:-100}" \
  --auto-resume "$@"
