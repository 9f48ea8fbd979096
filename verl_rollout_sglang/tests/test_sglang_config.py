"""The sglang rollout's settings, checked when the config resolves (no SGLang server needed)."""

from __future__ import annotations

from typing import Any

import pytest

from verl_core.config import ConfigError, resolve_config
from verl_core.registry import PluginRegistry

URL = "http://127.0.0.1:30000"


@pytest.mark.parametrize("settings, key", [
    ({"threads": 4}, "rollout.threads"),
    ({"mem_fraction_static": 0.8}, "rollout.mem_fraction_static"),
    ({"server_args": {"chunked-prefill-size": 512}}, "rollout.server_args"),
    ({"log_level": "info", "startup_timeout_s": 60.0}, "rollout.startup_timeout_s"),
])
def test_a_launch_setting_beside_base_url_is_refused_not_ignored(settings: dict[str, Any], key: str) -> None:
    # A running server keeps the settings it was started with: before, these were accepted and did nothing.
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as caught:
        resolve_config({"rollout": {"name": "sglang", "base_url": URL, **settings}}, PluginRegistry())
    assert "only apply to a server verl launches" in str(caught.value)
    assert all(name in str(caught.value) for name in settings)


def test_base_url_takes_the_client_settings() -> None:
    cfg = resolve_config({"rollout": {"name": "sglang", "base_url": URL, "max_concurrency": 8, "dtype": "float32",
                                      "request_timeout_s": 30.0, "weight_sync": "disk"}}, PluginRegistry())
    assert cfg.rollout.config.max_concurrency == 8 and cfg.rollout.config.base_url == URL
