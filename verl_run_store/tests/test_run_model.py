"""The run directory's copy of its model (issue 31): what it holds, what it stands for, the model check.

Real tiny models on disk (``verl_core.testing``); no training, no weights loaded by the check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from verl_core.config import ConfigError
from verl_run_store.run_model import (CRITIC_COPY, MODEL_COPY, check_same_model, copied_keys, copy_overrides,
                                 stands_for, write_run_models)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoTokenizer

    from verl_core.testing import tiny_model_dir, tiny_text_model_dir

    root = tmp_path_factory.mktemp("models")
    actor, other = tiny_model_dir(root), tiny_text_model_dir(root)  # hidden 128 vs 32, one tokenizer
    return actor, other, AutoTokenizer.from_pretrained(actor)


def _model_section(path: str, tokenizer: str = "", critic_path: str = "") -> SimpleNamespace:
    return SimpleNamespace(path=path, tokenizer=tokenizer, critic_path=critic_path)


def test_a_directory_model_is_linked_with_its_tokenizer_and_stands_for_its_source(tmp_path, models) -> None:
    actor, other, tok = models
    run = tmp_path / "run"
    run.mkdir()
    write_run_models(run, _model_section(actor, critic_path=other), model=None, tokenizer=tok, critic=None)
    copy = run / MODEL_COPY
    names = {p.name for p in copy.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"} <= names
    # The weights are the model directory's file (a hard link on one filesystem), not a second copy.
    assert os.stat(copy / "model.safetensors").st_ino == os.stat(Path(actor) / "model.safetensors").st_ino
    assert json.loads((run / CRITIC_COPY / "config.json").read_text())["hidden_size"] == 32
    from transformers import AutoTokenizer

    assert tok.chat_template and AutoTokenizer.from_pretrained(copy).chat_template == tok.chat_template
    saved = {"path": actor, "critic_path": other}
    assert copied_keys(run, saved) == {"path", "critic_path"}
    assert copy_overrides(run, saved, given={"critic_path"}) == [f"model.path={json.dumps(str(copy))}"]
    assert stands_for(run, "model.path", actor, str(copy)) and not stands_for(run, "model.path", other, str(copy))
    assert copied_keys(run, {"path": other}) == set()  # a copy stands only for what it was made from
    # Written once: a second segment leaves it as it is.
    before = (copy / "verl_model.json").read_text()
    write_run_models(run, _model_section(other), model=None, tokenizer=tok, critic=None)
    assert (copy / "verl_model.json").read_text() == before


def test_objects_are_saved_and_builtin_or_hub_models_are_not_copied(tmp_path, models) -> None:
    from transformers import AutoModelForCausalLM

    actor, _, tok = models
    module = AutoModelForCausalLM.from_pretrained(actor)
    run = tmp_path / "run"
    run.mkdir()
    write_run_models(run, _model_section("<object: Qwen2ForCausalLM>", "<object: Tok>"), model=module,
                     tokenizer=tok, critic=None)
    assert AutoModelForCausalLM.from_pretrained(run / MODEL_COPY).config.hidden_size == 128
    assert copied_keys(run, {"path": "<object: Qwen2ForCausalLM>", "tokenizer": "<object: Tok>"}) == {"path",
                                                                                                        "tokenizer"}
    for source in ("builtin:tiny-qwen2-addition", "someone/some-model"):
        other = tmp_path / source.replace(":", "_").replace("/", "_")
        other.mkdir()
        write_run_models(other, _model_section(source), model=None, tokenizer=tok, critic=None)
        assert list(other.iterdir()) == []


def test_a_resume_with_another_model_fails_naming_what_differs_before_weights_load(tmp_path, models) -> None:
    from transformers import AutoModelForCausalLM

    actor, other, tok = models
    run = tmp_path / "run"
    run.mkdir()
    write_run_models(run, _model_section(actor), model=None, tokenizer=tok, critic=None)
    check_same_model(run, "auto", path=actor, module=None, tokenizer=tok)  # the same model passes
    check_same_model(run, "auto", path=str(run / MODEL_COPY), module=None, tokenizer=tok)
    check_same_model(run, "auto", path=actor, module=AutoModelForCausalLM.from_pretrained(actor), tokenizer=tok)
    with pytest.raises(ConfigError, match=r"(?s)model.path: .*another model.*hidden_size: 128 -> 32.*"
                                          r"parameters \(\d+\): .*\[\d+, 128\] -> \[\d+, 32\]"):
        check_same_model(run, "auto", path=other, module=None, tokenizer=tok)
    check_same_model(run, "never", path=other, module=None, tokenizer=tok)  # starting over: nothing to match

    class OtherTemplate:  # the same vocabulary with another chat template
        chat_template = "{{ messages }}"
        get_vocab = staticmethod(tok.get_vocab)

    with pytest.raises(ConfigError, match=r"tokenizer \(vocabulary or chat template\): hash \w+ -> \w+"):
        check_same_model(run, "auto", path=actor, module=None, tokenizer=OtherTemplate())


def test_a_deleted_model_directory_is_replaced_by_the_runs_copy_of_it(tmp_path, models) -> None:
    import shutil

    from verl_run_store.run_model import stand_in
    from verl_core.testing import tiny_model_dir

    _, _, tok = models
    source = tiny_model_dir(tmp_path / "models")
    run = tmp_path / "run"
    run.mkdir()
    write_run_models(run, _model_section(source), model=None, tokenizer=tok, critic=None)
    assert stand_in(run, "model.path", source) == source  # still there: used as it is
    shutil.rmtree(tmp_path / "models")
    assert stand_in(run, "model.path", source) == str(run / MODEL_COPY)
    assert stand_in(run, "model.path", str(tmp_path / "never-copied")) == str(tmp_path / "never-copied")
    assert stand_in(run, "model.critic_path", source) == source  # no critic copy stands for it


def test_lengths_fitted_to_a_deleted_model_come_from_its_copy_in_the_default_run_directory(
        tmp_path, models, monkeypatch) -> None:
    """The same ``verl run --model <dir>`` again, its model deleted and no run.output_dir given: the prompt and
    response lengths are fitted to the copy (64 positions), as in the first run, not left at 512 + 64."""
    import shutil

    from verl_core.config import RunConfig, resolve_config
    from verl_core.registry import PluginRegistry
    from verl_core.testing import tiny_model_dir

    _, _, tok = models
    source = tiny_model_dir(tmp_path / "models")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / RunConfig.output_dir
    run.mkdir(parents=True)
    write_run_models(run, _model_section(source), model=None, tokenizer=tok, critic=None)
    registry = PluginRegistry()
    first = resolve_config({"model": {"path": source}}, registry)
    shutil.rmtree(tmp_path / "models")
    again = resolve_config({"model": {"path": source}}, registry)
    assert (again.data.max_prompt_length, again.rollout.config.max_new_tokens) == (48, 16)
    assert (first.data.max_prompt_length, first.rollout.config.max_new_tokens) == (48, 16)
