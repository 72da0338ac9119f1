#!/usr/bin/env bash
# Multi-node training with launch/train.py: run this script once on EVERY node, with the same settings.
# torchrun's c10d rendezvous joins the nodes (no node ranks to hand out); the mesh defaults to HSDP with one
# replica group per node (train.py --replicas / --shards change it); checkpoints go to CKPT_DIR, which must be
# one directory on storage that every node mounts (docs/scaling.md: what that storage must provide); a job
# started again with the same CKPT_DIR, after a failure or a SLURM requeue, continues from its last checkpoint.
# A node whose agent died rejoins a running c10d job when this script is started there again (by hand, a
# supervisor such as systemd or Kubernetes, or AGENT_RESTARTS below): the other agents, whose workers failed
# with it, wait in a new rendezvous round and the job continues from its last checkpoint.
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
#   MAX_RESTARTS    torchrun restarts of the workers after a failure (default 3); a node that is started again
#                   costs every surviving agent one restart
#   AGENT_RESTARTS  times this script starts torchrun again on this node after the agent exits with an error
#                   or is killed (default 0); a restarted agent rejoins the running job (c10d rendezvous only)
#   RDZV_STORE      "serve" on the RDZV_HOST node, "join" on the others: the rendezvous store is a process of its
#                   own (launch/rdzv_store.py, started here) instead of part of the first agent, so node 0's
#                   agent too can die and be started again (c10d only; default: the first agent serves it)
#   RDZV_CONF       extra --rdzv-conf settings, e.g. is_host=false,join_timeout=900 (c10d only)
#   CKPT_DIR        checkpoint directory on shared storage (required); CKPT_EVERY steps (default 100)
#   PYTHON          the interpreter (default: python)
# Every other argument goes to launch/train.py.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root: torchrun runs the checkout's launch.train (and flashdist)
: "${NNODES:?set NNODES, the number of nodes}"
: "${RDZV_HOST:?set RDZV_HOST, an address of one node that every node can reach}"
: "${CKPT_DIR:?set CKPT_DIR, a checkpoint directory on storage that every node mounts}"
restarts=${AGENT_RESTARTS:-0}
[[ "$restarts" =~ ^[0-9]+$ ]] || { echo "multinode.sh: AGENT_RESTARTS=$restarts: give a whole number (0: never)" >&2; exit 2; }
PY=${PYTHON:-python}
NPROC=${NPROC_PER_NODE:-$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))')}
if [[ -n "${NODE_RANK:-}" ]]; then
  RDZV=(--node-rank="$NODE_RANK" --master-addr="$RDZV_HOST" --master-port="${RDZV_PORT:-29500}")
else
  RDZV=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:${RDZV_PORT:-29500}" --rdzv-id="${JOB_ID:-flashdist}")
  case "${RDZV_STORE:-}" in
    "") ;;
    serve) "$PY" -m launch.rdzv_store --port "${RDZV_PORT:-29500}" &
           store_pid=$!
           trap 'kill "$store_pid" 2>/dev/null || true' EXIT
           RDZV_CONF="is_host=false${RDZV_CONF:+,$RDZV_CONF}" ;;
    join) RDZV_CONF="is_host=false${RDZV_CONF:+,$RDZV_CONF}" ;;
    *) echo "multinode.sh: RDZV_STORE=$RDZV_STORE: use serve (on the RDZV_HOST node) or join (elsewhere)" >&2
       exit 2 ;;
  esac
  [[ -z "${RDZV_CONF:-}" ]] || RDZV+=(--rdzv-conf="$RDZV_CONF")
  # Each rendezvous round then publishes a fresh address for the workers' store (rank 0's worker serves it).
  # With torch's default (the rank-0 agent serves it and caches its address after the first round), an agent
  # that joins a later round waits for an address that is never written again (docs/scaling.md, "Restarts").
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
TORCHRUN=("$PY" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC" "${RDZV[@]}"
  --max-restarts="${MAX_RESTARTS:-3}" -m launch.train --ckpt-dir "$CKPT_DIR" --ckpt-every "${CKPT_EVERY:-100}"
  --auto-resume "$@")
((restarts > 0)) || [[ -n "${store_pid:-}" ]] || exec "${TORCHRUN[@]}"  # else stay, to stop the store
stopping=0
trap 'stopping=1' TERM INT  # a job being stopped (scancel, Ctrl-C) is not an agent to bring back
for ((attempt = 1; ; attempt++)); do
  rc=0
  "${TORCHRUN[@]}" || rc=$?
  ((rc != 0 && !stopping && attempt <= restarts)) || exit "$rc"
  echo "multinode.sh: the torchrun agent exited with status $rc; starting it again ($attempt of $restarts)" >&2
done
