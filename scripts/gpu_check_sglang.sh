#!/usr/bin/env bash
# The SGLang engine's GPU checks (seeded sampling, sleep/wake, tensor and distributed weight
# transports), for a GPU machine with SGLang's environment built (`verl sglang setup --full`, or
# VERL_SGLANG_PYTHON naming an interpreter with sglang 0.5.23). Writes $OUT/gpu_sglang.log when OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/verl_core/src:$PWD/verl_rollout_sglang/src:$PWD/plugins/verl-task-arithmetic/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider verl_rollout_sglang/tests/test_gpu_sglang.py 2>&1 \
  | tee "${OUT:-/tmp}/gpu_sglang.log"
