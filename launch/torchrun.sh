#!/usr/bin/env bash
# Elastic launch with torchrun (c10d rendezvous, restarts).
#
#   launch/torchrun.sh CONFIG [key=value ...]
#
# Environment (defaults in brackets):
#   NPROC_PER_NODE [1]       processes on this node
#   NNODES [1]               node count, or MIN:MAX for an elastic job
#   RDZV_ENDPOINT [127.0.0.1:29500]  host:port of the rendezvous (the first node)
#   RDZV_ID [rlt]            job id shared by all nodes of one job
#   MAX_RESTARTS [3]         worker-group restarts before giving up
#   PYTHON [.venv/bin/python]
# A restarted worker group resumes from the newest complete checkpoint in
# checkpoint.dir by itself (rlt-train resumes by default).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
exec "$PYTHON" -m torch.distributed.run \
  --nnodes="${NNODES:-1}" \
  --nproc-per-node="${NPROC_PER_NODE:-1}" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="${RDZV_ENDPOINT:-127.0.0.1:29500}" \
  --rdzv-id="${RDZV_ID:-rlt}" \
  --max-restarts="${MAX_RESTARTS:-3}" \
  -m rlt_scale.train "$@"
