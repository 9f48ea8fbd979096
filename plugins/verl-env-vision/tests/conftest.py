import pytest


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    """An untrained tiny Qwen2-VL with its tokenizer and image processor (built in seconds, no warm start)."""
    from verl_env_vision.task import build_untrained

    path = tmp_path_factory.mktemp("tiny-vlm")
    build_untrained(path)
    return str(path)


@pytest.fixture(scope="session")
def processor(vlm_dir):
    from transformers import AutoTokenizer

    from verl_data import load_processor

    return load_processor(vlm_dir, AutoTokenizer.from_pretrained(vlm_dir))
