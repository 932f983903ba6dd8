#!/usr/bin/env bash
# Launch with the deepspeed launcher, on this machine or on the hosts of a hostfile.
#
#   launch/deepspeed.sh CONFIG [key=value ...]
#   NPROC_PER_NODE=2 launch/deepspeed.sh configs/tiny.yaml             # this machine, 2 processes
#   HOSTFILE=hosts.txt launch/deepspeed.sh configs/rlt-100m.yaml       # every host of hosts.txt
#
# Environment (defaults in brackets):
#   HOSTFILE [unset]       one line per host, "hostname slots=N" (N processes there; on GPU
#                          hosts N GPUs). Unset: this machine only. With a hostfile, DeepSpeed
#                          starts the processes over passwordless ssh with pdsh (LAUNCHER), so
#                          every host needs pdsh, ssh access from this one, and the repository
#                          and .venv at the same path. A hostfile naming only localhost runs
#                          locally (no pdsh); DS_ARGS=--no_ssh_check skips the ssh probe then.
#   NPROC_PER_NODE [1]     processes on this machine when there is no HOSTFILE
#   MASTER_ADDR [unset]    address of the first host (DeepSpeed asks it for `hostname -I` otherwise)
#   MASTER_PORT [29500]
#   LAUNCHER [pdsh]        DeepSpeed's multi-node launcher: pdsh, openmpi, mpich, impi, mvapich, slurm
#   DS_ARGS [unset]        further launcher options, e.g. "--include=node1:0,1@node2 --no_ssh_check"
#   SHUTDOWN_TIMEOUT [100] seconds the workers get after a stop signal to checkpoint before SIGKILL
#   DEEPSPEED [.venv/bin/deepspeed]
#   PYTHON [.venv/bin/python]  runs rlt_scale.launcher, which runs DEEPSPEED
#   CUDA_DEVICE_MAX_CONNECTIONS [1]  see below. DeepSpeed passes only NCCL*, PYTHON*, UCX*,
#                          MV2* and MLFLOW* variables on to the other hosts of a HOSTFILE: for
#                          them, put the line CUDA_DEVICE_MAX_CONNECTIONS=1 in a .deepspeed_env
#                          file (home or working directory; DS_ENV_FILE names it)
# On CPU-only machines the launcher starts NPROC_PER_NODE (or slots=N) CPU processes.
# The deepspeed launcher does not restart failed workers: for restarts and
# elastic node counts use launch/torchrun.sh or launch/slurm.sh.
#
# Stopping: SIGTERM or SIGUSR1 to this script (rlt_scale.launcher: the script
# execs it) goes to this machine's workers only; they checkpoint at the end of
# the current step and exit 0, and the script exits 0 when the deepspeed
# launcher did (it does when every worker exited 0), else with its status;
# after SHUTDOWN_TIMEOUT seconds everything left is SIGKILLed (status 128 +
# the signal number, 143 for SIGTERM). SIGINT is forwarded the same way (no
# checkpoint). With a multi-host HOSTFILE (pdsh) the signal goes to DeepSpeed's
# runner instead (SIGUSR1 as SIGTERM): it has pdsh SIGTERM the launchers on
# every host, whose workers then checkpoint (DeepSpeed gives them 30 s), and
# exits 1 a second later without waiting: check checkpoint.dir's `latest`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEEPSPEED=${DEEPSPEED:-.venv/bin/deepspeed}
PYTHON=${PYTHON:-.venv/bin/python}
# megatron-core's TP layers overlap their communication with computation only
# when the GPU runs kernels in the order they were queued: one hardware queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
args=(--master_port "${MASTER_PORT:-29500}")
if [[ -n "${HOSTFILE:-}" ]]; then
  [[ -f "$HOSTFILE" ]] || { echo "launch/deepspeed.sh: HOSTFILE=$HOSTFILE does not exist" >&2; exit 2; }
  args+=(--hostfile "$HOSTFILE" --launcher "${LAUNCHER:-pdsh}")
  [[ -n "${MASTER_ADDR:-}" ]] && args+=(--master_addr "$MASTER_ADDR")
else
  args+=(--num_gpus "${NPROC_PER_NODE:-1}")
fi
# DS_ARGS is split on spaces on purpose: it carries several options.
# shellcheck disable=SC2206
[[ -n "${DS_ARGS:-}" ]] && args+=($DS_ARGS)
exec "$PYTHON" -m rlt_scale.launcher deepspeed "${SHUTDOWN_TIMEOUT:-100}" \
  "$DEEPSPEED" "${args[@]}" --module rlt_scale.cli.train "$@"
