"""Selecting the engines: lazy imports, config validation and the install hint (no vLLM needed)."""

from __future__ import annotations

import socket
import subprocess
import sys
from typing import Any

import pytest

from verl_core.contracts import ModelSpec
from verl_rollout_vllm.external import OpenAIRollout, OpenAIRolloutConfig, ServerError


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", **__import__("os").environ})


def test_importing_the_plugins_does_not_import_vllm() -> None:
    res = _python("import sys, verl_rollout_vllm.engine, verl_rollout_vllm.external\n"
                  "from verl_core.registry import PluginRegistry\n"
                  "r = PluginRegistry(); r.load('rollout', 'vllm'); r.load('rollout', 'openai')\n"
                  "print('vllm' in sys.modules)")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "False"


def test_selecting_vllm_without_vllm_fails_with_the_install_command() -> None:
    # sys.modules["vllm"] = None makes vLLM unimportable, as on a machine without it.
    res = _python("import sys; sys.modules['vllm'] = None\n"
                  "from verl_cli.cli import main\n"
                  "sys.argv = ['verl', 'config', 'show', '--rollout', 'vllm']\n"
                  "main()")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "pip install 'verl-rollout-vllm[cpu]'" in res.stderr + res.stdout
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("settings, key", [
    ({"kv_cache_gb": -1}, "rollout.kv_cache_gb"),
    ({"tensor_parallel_size": 0}, "rollout.tensor_parallel_size"),
    ({"kv_cache_sz": 1}, "rollout.kv_cache_sz"),
])
def test_bad_vllm_settings_name_the_key(settings: dict[str, Any], key: str) -> None:
    from verl_core.config import ConfigError, resolve_config
    from verl_core.registry import PluginRegistry

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve_config({"rollout": {"name": "vllm", **settings}}, PluginRegistry())


@pytest.mark.parametrize("settings, on_cpu, size, warned", [
    ({}, True, 1.0, ""),                                               # CPU needs a size: 1 GiB
    ({"kv_cache_gb": 0.25}, True, 0.25, ""),
    ({"gpu_memory_utilization": 0.8}, True, 1.0, "no effect on CPU"),  # a verl config's key, said not dropped
    ({}, False, None, ""),                                             # GPU: sized by gpu_memory_utilization
    ({"gpu_memory_utilization": 0.8}, False, None, ""),
    ({"kv_cache_gb": 0}, False, None, ""),
    ({"kv_cache_gb": 4, "gpu_memory_utilization": 0.8}, False, 4, "then sizes nothing"),
])
def test_kv_cache_size_follows_the_setting_the_user_gave_and_names_one_that_has_no_effect(
        settings: dict[str, Any], on_cpu: bool, size: float | None, warned: str,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, kv_cache_gb defaulted to 1 GiB everywhere: on a GPU, vLLM then ignored gpu_memory_utilization
    # (imported from a verl config as 0.4-0.9) and ran a 7B model with a 1 GiB cache.
    from verl_rollout_vllm.engine import VLLMRolloutConfig, _kv_cache_gb

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with caplog.at_level("WARNING", logger="verl_rollout_vllm.engine"):
        assert _kv_cache_gb(VLLMRolloutConfig(**settings), on_cpu) == size
    assert (warned in caplog.text) if warned else not caplog.text, caplog.text


def test_openai_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="sync_dir"):
        OpenAIRolloutConfig(weight_sync="checkpoint").validate()
    with pytest.raises(ValueError, match="weight_sync"):
        OpenAIRolloutConfig(weight_sync="sometimes").validate()
    with pytest.raises(ValueError, match="base_url"):
        OpenAIRolloutConfig(base_url="127.0.0.1:8000").validate()


def test_unreachable_server_fails_fast_with_the_fix() -> None:
    from verl_core.testing import build_byte_tokenizer

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = OpenAIRolloutConfig(base_url=f"http://127.0.0.1:{port}", max_retries=0)
    with pytest.raises(ServerError, match="start one first"):
        OpenAIRollout(config=config, model=ModelSpec(path=""), tokenizer=build_byte_tokenizer())
