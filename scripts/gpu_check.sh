#!/usr/bin/env bash
# The checks that need a CUDA device, as one command for a GPU machine that already has PyTorch,
# transformers and peft (no installation, no network): the FSDP backend on CUDA (fp32 exactness
# against plain PyTorch, CPU offload, bf16 mixed precision, packed sequences). Writes the log to
# $OUT/gpu.log when OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/verl_core/src:$PWD/verl_backend_fsdp/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider verl_backend_fsdp/tests/test_gpu.py 2>&1 | tee "${OUT:-/tmp}/gpu.log"
