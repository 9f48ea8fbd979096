#!/usr/bin/env bash
# The Megatron backend's CUDA checks (NCCL, unpatched: the CPU shims must stay out) as one command for a
# GPU machine with PyTorch and transformers. megatron-core is not on such a machine and it has no network:
# carry a wheel directory built here (`pip download --no-deps megatron-core==0.16.1 psutil -d wheels/megatron`)
# and this script installs from it. Writes the log to $OUT/gpu_megatron.log when OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/verl_core/src:$PWD/verl_backend_fsdp/src:$PWD/verl_backend_megatron/src${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install --no-index --no-deps --find-links wheels/megatron megatron-core==0.16.1 psutil
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider verl_backend_megatron/tests/test_megatron_gpu.py 2>&1 \
  | tee "${OUT:-/tmp}/gpu_megatron.log"
