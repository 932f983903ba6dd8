#!/usr/bin/env bash
# Launch with the deepspeed launcher, on one machine or the hosts of a hostfile.
#
#   launch/deepspeed.sh CONFIG [key=value ...]
#
# Environment: HOSTFILE (lines "host slots=N"; unset = this machine only),
# NPROC_PER_NODE [1] (this machine only), MASTER_PORT [29500].
# On CPU-only machines the launcher starts NPROC_PER_NODE CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
DEEPSPEED=${DEEPSPEED:-.venv/bin/deepspeed}
args=(--master_port "${MASTER_PORT:-29500}")
if [[ -n "${HOSTFILE:-}" ]]; then
  args+=(--hostfile "$HOSTFILE")
else
  args+=(--num_gpus "${NPROC_PER_NODE:-1}")
fi
exec "$DEEPSPEED" "${args[@]}" --module rlt_scale.train "$@"
