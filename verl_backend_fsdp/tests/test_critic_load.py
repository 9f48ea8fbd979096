"""Loading a critic from a causal LM says in one line that its value head is new (#34).

transformers prints a LOAD REPORT table (``score`` MISSING, ``lm_head`` UNEXPECTED) for every such load,
which reads like a broken checkpoint; it is what a new value head looks like. A checkpoint that misses
anything else still gets transformers' report.
"""

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.testing import tiny_model_dir


@pytest.fixture(autouse=True)
def _transformers_warnings():
    """transformers prints its report at warning level; an earlier test in the process may have lowered it."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    yield
    hf_logging.set_verbosity(before)


def _critic(path: str):
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    torch.set_num_threads(1)
    return FSDPBackend(FSDPConfig()).create_worker(role=Role.CRITIC, model=ModelSpec(path=path),
                                                   world=WorldInfo(threads=1), seed=0)


def _transformers_messages(load) -> str:
    """What transformers logs during ``load()``, read where it logs it: its own stream handler may write to a
    stream an earlier test's capture replaced, so the terminal output alone would depend on the test order."""
    seen: list[str] = []
    collect = logging.Handler()
    collect.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("transformers").addHandler(collect)
    try:
        load()
    finally:
        logging.getLogger("transformers").removeHandler(collect)
    return "\n".join(seen)


def test_a_new_value_head_is_one_line_not_a_load_report(tmp_path, capfd, caplog):
    path = str(tiny_model_dir(tmp_path))
    with caplog.at_level(logging.WARNING, logger="verl_backend_fsdp"):
        report = _transformers_messages(lambda: _critic(path))
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in report + out + err and "MISSING" not in report + out + err
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("verl_backend_fsdp")]
    assert lines == [f"critic: a new value head (score.bias, score.weight) initialised; the rest loaded from {path}"]


def test_a_checkpoint_missing_more_than_the_head_keeps_the_report(tmp_path, capfd, caplog):
    path = tiny_model_dir(tmp_path)
    weights = load_file(f"{path}/model.safetensors")
    dropped = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    del weights[dropped]
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="verl_backend_fsdp"):
        report = _transformers_messages(lambda: _critic(str(path)))
    assert "LOAD REPORT" in report and dropped.removeprefix("model.") in report
    assert not [r for r in caplog.records if r.getMessage().startswith("critic:")]
