#!/usr/bin/env bash
# The GPU checks of issues #13 and #17 on one CUDA GPU, in a few minutes (bench/gpu_check.py says
# what each measures): bf16 steps against CPU fp32, tokens/s and MFU, peak memory against the cost
# model, generation on the device, a checkpoint round trip, mask-free attention at T=16384.
#   bash bench/gpu_check.sh            # results: bench/results/gpu_check.json (and $OUT/ if set)
# Sets up .venv first when it is missing (torch before anything else, as the Makefile does).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  # On a GPU machine the CUDA build of torch is wanted: plain pip resolves it there.
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  .venv/bin/pip install -q -e '.[test]'
fi
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
status=0
timeout "${GPU_CHECK_TIMEOUT:-480}" .venv/bin/python bench/gpu_check.py "$@" || status=$?
if [[ -n "${OUT:-}" ]]; then cp bench/results/gpu_check*.json "$OUT"/ 2>/dev/null || true; fi
exit $status
