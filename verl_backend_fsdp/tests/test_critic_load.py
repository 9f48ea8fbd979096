"""Loading a critic from a causal LM says in one line that its value head is new (#34).

transformers prints a LOAD REPORT table (``score`` MISSING, ``lm_head`` UNEXPECTED) for every such load,
which reads like a broken checkpoint; it is what a new value head looks like. A checkpoint that misses
anything else still gets transformers' report.
"""

import logging

import torch
from safetensors.torch import load_file, save_file

from verl_core.interfaces import ModelSpec, Role, WorldInfo
from verl_core.testing import tiny_model_dir


def _critic(path: str):
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    torch.set_num_threads(1)
    return FSDPBackend(FSDPConfig()).create_worker(role=Role.CRITIC, model=ModelSpec(path=path),
                                                   world=WorldInfo(threads=1), seed=0)


def test_a_new_value_head_is_one_line_not_a_load_report(tmp_path, capfd, caplog):
    path = str(tiny_model_dir(tmp_path))
    with caplog.at_level(logging.WARNING, logger="verl_backend_fsdp"):
        _critic(path)
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err and "MISSING" not in out + err
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("verl_backend_fsdp")]
    assert lines == [f"critic: a new value head (score.bias, score.weight) initialised; the rest loaded from {path}"]


def test_a_checkpoint_missing_more_than_the_head_keeps_the_report(tmp_path, capfd, caplog):
    path = tiny_model_dir(tmp_path)
    weights = load_file(f"{path}/model.safetensors")
    dropped = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    del weights[dropped]
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="verl_backend_fsdp"):
        _critic(str(path))
    out, err = capfd.readouterr()
    assert "LOAD REPORT" in out + err and dropped.removeprefix("model.") in out + err
    assert not [r for r in caplog.records if r.getMessage().startswith("critic:")]
