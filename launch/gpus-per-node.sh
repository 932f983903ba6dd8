# Sourced by launch/slurm.sh (and tests/test_gpu_readiness.py), not run.
#
# nproc_per_node prints how many worker processes each node runs: NPROC_PER_NODE
# when set, else the node's GPUs (one worker per GPU) -- SLURM_GPUS_ON_NODE
# (Slurm sets it when the job asked for GPUs), else the GPUs `nvidia-smi -L`
# lists (its MIG lines not counted), else 1 (a CPU-only node).

gpus_on_node() {
  if [[ "${SLURM_GPUS_ON_NODE:-}" =~ ^[1-9][0-9]*$ ]]; then
    echo "$SLURM_GPUS_ON_NODE"
    return
  fi
  local n=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    # A broken driver makes nvidia-smi fail: that counts as no GPUs, not as an error.
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  fi
  if (( n > 0 )); then echo "$n"; else echo 1; fi
}

nproc_per_node() {
  if [[ -n "${NPROC_PER_NODE:-}" ]]; then
    echo "$NPROC_PER_NODE"
  else
    gpus_on_node
  fi
}
