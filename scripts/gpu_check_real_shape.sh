#!/usr/bin/env bash
# Issue 33 on one CUDA device: GRPO at Qwen2.5-0.5B's architecture (bench/real_shape.py, random init, built
# locally) at a GPU-sized batch: ours (sync, HF rollout, FSDP backend, bf16 autocast) and the raw floor (the same
# work in plain PyTorch, bf16 autocast), TRL too where it is importable; one round of 4 steps (1 warm-up), about
# 4-6 minutes on an H200. Prints tokens/s/GPU of generation, of the update and per step, beside prime-rl's
# published figure, and writes $OUT/real_shape_gpu.{json,md,log} when OUT is set.
#
# prime-rl's figure (github.com/PrimeIntellect-ai/prime-rl, benchmarks/results/BENCHMARKS.md, commit 30bf494f,
# "last updated 2026-02-07"): Qwen3-0.6B, RL Full, 11.90k tokens/s on 1x H100 80GB HBM3, 16,384-token sequences,
# activation recomputation, FlashAttention 3, MFU 11.1%, peak 12.5 GiB; the RL trainer alone on fake data
# (`--bench`, docs/benchmarking.md), so it stands beside our update, not our generation (no generation figure is
# published there for that model). bench/real_shape.py's PRIME_RL holds it for the report.
#
# verl finds its plugins through the entry points of its installed distributions, and a GPU machine without
# network has none of them: build their wheels here first (pure Python; wheels/ is kept out of git locally),
#     bash scripts/gpu_check_real_shape.sh --wheels
# and carry `wheels` to the GPU machine, where this script installs them under /tmp/verl-site.
# First the colocate_async GPU test (the producer's engine on CUDA, about a minute).
# Overrides: ONLY (configurations), SHAPE (trl_comparison.py's shape options), STEPS.
set -euo pipefail
cd "$(dirname "$0")/.."
DISTS="./verl_core ./verl_kit ./verl_run_store ./verl_executor_local ./verl_data ./verl_backend_fsdp ./verl_rollout_hf ./verl_algorithms ./plugins/verl-rewards ./verl_trainer_async"
if [ "${1:-}" = "--wheels" ]; then
  exclude="$(git rev-parse --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")" && { grep -qxF /wheels/ "$exclude" 2>/dev/null || echo /wheels/ >>"$exclude"; }
  rm -rf wheels/verl && python3 -m pip wheel -q --no-deps --no-build-isolation -w wheels/verl $DISTS
  ls wheels/verl
  exit 0
fi
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp}"
if [ -d wheels/verl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/verl-site wheels/verl/*.whl
  export PYTHONPATH="/tmp/verl-site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
if ! python3 -c "import sys, torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__); sys.exit(not torch.cuda.is_available())"; then
  echo "prepared, not run: no CUDA device that torch can use here"; exit 1
fi
if ! python3 -c "import sys, importlib.metadata as m; sys.exit('fsdp' not in {e.name for e in m.entry_points(group='verl.backends')} or 'local' not in {e.name for e in m.entry_points(group='verl.run_stores')} or 'local' not in {e.name for e in m.entry_points(group='verl.executors')})"; then
  echo "prepared, not run: verl's distributions are not installed here (run 'bash $0 --wheels' where pip works and carry wheels/)"; exit 1
fi
# colocate_async on the GPU: the producer's engine copy (thread and process) generates on CUDA, not the CPU.
python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider verl_trainer_async/tests/test_async_trainer.py \
  -k cuda_device 2>&1 | tee "$OUT/async_gpu.log" || echo "the async GPU check failed: $OUT/async_gpu.log"
ONLY="${ONLY:-ours-hf-2t-bf16,floor-hf-2t-bf16}"
if python3 -c "import trl, datasets" 2>/dev/null; then ONLY="$ONLY,trl-hf-2t-bf16"; else echo "TRL (or datasets) is not importable here: TRL left out"; fi
# 16 prompts x 8 samples of 64 + 256 tokens: the HF rollout keeps every step's full-vocabulary logits for the
# log-probs (128 x 256 x 151,936 floats = 20 GB, about three times that at its peak), which bounds the batch.
SHAPE="${SHAPE:---prompts 16 --group-size 8 --prompt-tokens 64 --max-new-tokens 256 --micro-batch 16}"
# shellcheck disable=SC2086 # SHAPE is a list of options
python3 bench/real_shape.py --device cuda $SHAPE --rounds 1 --steps "${STEPS:-4}" --only "$ONLY" --timeout 300 \
  --no-profile --results "$OUT/real_shape_gpu.json" 2>&1 | tee "$OUT/real_shape_gpu.log"
