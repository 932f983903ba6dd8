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
#   SHUTDOWN_TIMEOUT [100]   seconds the workers get after a stop signal to finish
#                            their step and checkpoint before SIGKILL; keep it below
#                            the grace period of whatever sends the signal
#   RDZV_CONF [unset]        extra rendezvous options, e.g. is_host=1,last_call_timeout=5
#                            (join_timeout, last_call_timeout, close_timeout,
#                            keep_alive_interval, keep_alive_max_attempt, is_host)
#   PYTHON [.venv/bin/python]
#   CUDA_DEVICE_MAX_CONNECTIONS [1]  see below; set it to override
# A restarted worker group resumes from the newest complete checkpoint in
# checkpoint.dir by itself (rlt-train resumes by default).
#
# Stopping: SIGTERM or SIGUSR1 to this script (the agent: the script execs it)
# is forwarded to the workers, which checkpoint at the end of the current step
# and exit 0; the agent waits SHUTDOWN_TIMEOUT seconds for them, SIGKILLs the
# rest and exits 0 when every worker exited 0, else 128 + the signal number
# (143 for SIGTERM), with one line naming the workers' exit codes
# (rlt_scale/launcher.py). SIGINT/SIGHUP/SIGQUIT are forwarded the same way
# but rlt-train does not checkpoint on them. Rerun the same command to resume.
#
# Several machines: run the same command on each, with NNODES=MIN:MAX and
# RDZV_ENDPOINT naming the first machine, e.g.
#   NNODES=1:2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29500 launch/torchrun.sh configs/rlt-100m.yaml
# A failed worker restarts the whole group (MAX_RESTARTS times); a lost
# machine makes the others re-form at the smaller size (down to MIN) and
# resume. The c10d store lives in the agent on RDZV_ENDPOINT's host: losing
# that machine ends the job. Under Slurm use launch/slurm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# torch >= 2.5 shares the rendezvous TCP store with the workers and caches its
# address in the first agent; an agent that joins later (scale-up, or a
# restarted node) then waits forever for that address (pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# megatron-core's TP layers overlap their communication with computation only
# when the GPU runs kernels in the order they were queued: one hardware queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# rlt_scale.launcher torchrun: torchrun, whose stop signal ends with status 0
# when every worker checkpointed and exited 0 (torchrun itself exits 1).
exec "$PYTHON" -m rlt_scale.launcher torchrun \
  --nnodes="${NNODES:-1}" \
  --nproc-per-node="${NPROC_PER_NODE:-1}" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="${RDZV_ENDPOINT:-127.0.0.1:29500}" \
  --rdzv-id="${RDZV_ID:-rlt}" \
  --max-restarts="${MAX_RESTARTS:-3}" \
  --shutdown-timeout="${SHUTDOWN_TIMEOUT:-100}" \
  ${RDZV_CONF:+--rdzv-conf="$RDZV_CONF"} \
  -m rlt_scale.cli.train "$@"
