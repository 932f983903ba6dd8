#!/usr/bin/env bash
# Slurm batch script: one elastic torchrun agent per node, c10d rendezvous on
# the first node, works on GPU and CPU-only nodes alike.
#
#   sbatch [sbatch options] launch/slurm.sh CONFIG [key=value ...]
#
#   sbatch launch/slurm.sh configs/tiny.yaml trainer.max_steps=200
#   sbatch --nodes=4 --time=24:00:00 launch/slurm.sh configs/rlt-100m.yaml
#   MIN_NODES=2 sbatch --nodes=4 --gpus-per-node=8 launch/slurm.sh configs/rlt-48x48.yaml   # 8 workers a node
#   NPROC_PER_NODE=2 sbatch --cpus-per-task=2 launch/slurm.sh configs/tiny.yaml             # CPU nodes
#
# Submit from the repository root: the job runs in $SLURM_SUBMIT_DIR (sbatch
# runs a copy of this file from its spool directory, so the script cannot
# locate the repository through $0). Options on the sbatch command line
# override the #SBATCH defaults below.
#
# Environment, exported into the job (defaults in brackets):
#   NPROC_PER_NODE [the node's GPUs]  worker processes per node, one per GPU: Slurm's
#                          SLURM_GPUS_ON_NODE, else the GPUs `nvidia-smi -L` lists on the first
#                          node, else 1 (launch/gpus-per-node.sh). On CPU nodes set it to the
#                          processes wanted. Every node runs the same number.
#   MIN_NODES [all]        elastic lower bound: the agents run --nnodes=MIN_NODES:<allocated nodes>,
#                          so the job re-forms on the survivors when a node dies
#   MAX_RESTARTS [3]       worker-group restarts per agent before the job fails
#   RDZV_PORT [29500 + job id % 1000]   port of the c10d rendezvous store on the first node
#   SHUTDOWN_TIMEOUT [100] seconds the workers get after SIGTERM to checkpoint before SIGKILL
#   RDZV_CONF [unset]      extra rendezvous options (see launch/torchrun.sh), e.g. last_call_timeout=60
#   LOG_ROOT [logs]        per-job logs in LOG_ROOT/<job name>-<job id>/<node>/ (torchrun --log-dir)
#   PYTHON [.venv/bin/python]
#   CUDA_DEVICE_MAX_CONNECTIONS [1]  see launch/torchrun.sh; set it to override
#   RLT_ROOT [$SLURM_SUBMIT_DIR]  the repository
#
# Resources: Slurm sees one task per node that runs all NPROC_PER_NODE
# workers, so give that task the node's CPUs (--cpus-per-task=N, passed on to
# srun, or --exclusive) and, on GPU nodes, its GPUs (--gpus-per-node=N).
#
# Logs: the job's combined output goes to logs/<job name>-<job id>.out
# (#SBATCH --output; Slurm does not create that directory, the repository
# ships logs/), each worker's stdout/stderr also to its own file under
# LOG_ROOT/<job name>-<job id>/<node>/.
#
# Preemption and time limits: 120 s before the time limit Slurm sends SIGTERM
# to every process of the job step (the agents and their workers); a
# preempting or cancelling Slurm sends SIGTERM then SIGKILL after its
# KillWait/GraceTime. The trainer checkpoints at the end of the current step
# and exits 0; the agents give the workers SHUTDOWN_TIMEOUT seconds before
# SIGKILL and exit 0 when every worker exited 0, else 128 + the signal number
# (rlt_scale.launcher, see launch/torchrun.sh), so a job that checkpointed
# ends COMPLETED (PREEMPTED or CANCELLED when Slurm ended it for that reason).
# A resubmitted (or --requeue'd) job resumes from the newest complete
# checkpoint in checkpoint.dir by itself.
#
# Rendezvous: the c10d store lives in the first node's agent. Losing any
# other node shrinks the job (down to MIN_NODES); losing the first node
# loses the store and ends the job (resubmit to resume).
#
#SBATCH --job-name=rlt
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=TERM@120
#SBATCH --no-kill
set -euo pipefail

[[ -n "${SLURM_JOB_ID:-}" ]] || { echo "launch/slurm.sh is a batch script: sbatch launch/slurm.sh CONFIG [key=value ...]" >&2; exit 2; }
cd "${RLT_ROOT:-$SLURM_SUBMIT_DIR}"

export PYTHON=${PYTHON:-.venv/bin/python}
# shellcheck source=launch/gpus-per-node.sh
source launch/gpus-per-node.sh
NPROC_PER_NODE=$(nproc_per_node)
export NPROC_PER_NODE
# See launch/torchrun.sh: without this, a node joining a running job hangs.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# megatron-core's TP layers overlap their communication with computation only
# when the GPU runs kernels in the order they were queued: one hardware queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
nodes=$SLURM_NNODES
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
rdzv_endpoint="$head_node:${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}"
export JOB_LOG_DIR="${LOG_ROOT:-logs}/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"
mkdir -p "$JOB_LOG_DIR"

echo "job $SLURM_JOB_ID: $nodes node(s) [$SLURM_JOB_NODELIST] x $NPROC_PER_NODE process(es)," \
     "elastic down to ${MIN_NODES:-$nodes}; rendezvous $rdzv_endpoint; logs $JOB_LOG_DIR"

agent=(
  --nnodes="${MIN_NODES:-$nodes}:$nodes"
  --nproc-per-node="$NPROC_PER_NODE"
  --rdzv-backend=c10d
  --rdzv-endpoint="$rdzv_endpoint"
  --rdzv-id="rlt-$SLURM_JOB_ID"
  --max-restarts="${MAX_RESTARTS:-3}"
  --shutdown-timeout="${SHUTDOWN_TIMEOUT:-100}"
  ${RDZV_CONF:+"--rdzv-conf=$RDZV_CONF"}
  --tee=3
  -m rlt_scale.cli.train "$@"
)
# One agent per node. --kill-on-bad-exit=0 and --no-kill keep the surviving
# agents running when a node fails, so torchrun can re-form the job on them.
# srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): pass it on.
# The per-node log directory is expanded on each node ($SLURMD_NODENAME).
srun --export=ALL --nodes="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=0 --no-kill \
  ${SLURM_CPUS_PER_TASK:+"--cpus-per-task=$SLURM_CPUS_PER_TASK"} \
  bash -c 'exec "$PYTHON" -m rlt_scale.launcher torchrun --log-dir="$JOB_LOG_DIR/$SLURMD_NODENAME" "$@"' \
  rlt-agent "${agent[@]}"
