"""Session fixtures for the SGLang tests: one real server for the whole session.

A server takes 20-70 s to start on a 2-core CPU, so the ``sglang``-marked engine tests share one.
They are skipped, saying how to build it, when SGLang's own environment is missing
(``verl sglang setup``); the selection and environment tests run everywhere.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from verl_rollout_sglang.environment import SGLangEnvironmentError, server_python


def _sglang_python() -> str | None:
    try:
        return server_python()
    except SGLangEnvironmentError:
        return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _sglang_python():
        return
    skip = pytest.mark.skip(reason="SGLang's environment is not built (run `verl sglang setup`)")
    for item in items:
        if item.get_closest_marker("sglang"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built-in tiny Qwen2 (random init) as a model directory."""
    from verl_core.testing import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("sglang-model"))


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
def sglang_engine(model_dir: str, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One SGLang server on the tiny model, float32, for the whole session."""
    from verl_core.contracts import ModelSpec

    from verl_rollout_sglang.engine import SGLangRollout, SGLangRolloutConfig

    log_dir = tmp_path_factory.mktemp("sglang-logs")
    engine = SGLangRollout(config=SGLangRolloutConfig(log_dir=str(log_dir)),
                           model=ModelSpec(path=model_dir, dtype="float32"), tokenizer=tokenizer)
    yield engine
    engine.close()
