"""Config loading, overrides and validation (all before any model loads)."""

import pytest

from verl_core.config import (
    ConfigError,
    apply_overrides,
    config_to_dict,
    dump_toml,
    load_raw_config,
    resolve_config,
)
from verl_core.registry import PluginRegistry, UnknownPluginError


@pytest.fixture(scope="module")
def registry():
    return PluginRegistry()


def test_defaults_resolve(registry):
    cfg = resolve_config({}, registry)
    assert cfg.algorithm.name == "grpo" and cfg.backend.name == "fsdp" and cfg.rollout.name == "hf"
    assert cfg.rollout.config.n == 8
    assert type(cfg.algorithm.config).__name__ == "GRPOConfig"


def test_toml_and_overrides(tmp_path, registry):
    f = tmp_path / "c.toml"
    f.write_text('[algorithm]\nname = "ppo"\ngamma = 0.9\n[run]\nmax_steps = 7\n')
    raw = apply_overrides(load_raw_config(f), ["algorithm.lam=0.95", "run.loggers=['jsonl']", "data.train=x.jsonl"])
    cfg = resolve_config(raw, registry)
    assert cfg.algorithm.config.gamma == 0.9 and cfg.algorithm.config.lam == 0.95
    assert cfg.run.max_steps == 7 and cfg.run.loggers == ["jsonl"] and cfg.data.train == "x.jsonl"


def test_int_is_accepted_for_float(registry):
    cfg = resolve_config({"backend": {"lr": 1}}, registry)
    assert cfg.backend.config.lr == 1.0 and isinstance(cfg.backend.config.lr, float)


@pytest.mark.parametrize("raw,path,fragment", [
    ({"algorithm": {"clip_ratio": 0.3}}, "algorithm.clip_ratio", "did you mean"),
    ({"rollot": {}}, "rollot", "did you mean 'rollout'"),
    ({"run": {"max_steps": "ten"}}, "run.max_steps", "expected an integer"),
    ({"run": {"val_before_train": 1}}, "run.val_before_train", "expected true or false"),
    ({"rollout": {"n": 0}}, "rollout.n", "at least 1"),
    ({"algorithm": {"loss_agg_mode": "mean"}}, "algorithm.loss_agg_mode", "must be one of"),
    ({"backend": {"betas": [0.9]}}, "backend.betas", "expected 2 values"),
    ({"data": {"overlong": "truncate"}}, "data.overlong", "'truncate_left', 'truncate_right'"),
])
def test_errors_name_the_key(registry, raw, path, fragment):
    with pytest.raises(ConfigError) as info:
        resolve_config(raw, registry)
    assert info.value.path == path
    assert fragment in str(info.value)


def test_unknown_plugin_names_the_package(registry):
    with pytest.raises(UnknownPluginError, match="pip install verl-rollout-sglang"):
        resolve_config({"rollout": {"name": "sglang"}}, registry)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["algorithm.kl_coef"])


def test_resolved_config_round_trips_through_toml(tmp_path, registry):
    cfg = resolve_config({"algorithm": {"name": "ppo", "gamma": 0.5}}, registry)
    f = tmp_path / "out.toml"
    f.write_text(dump_toml(config_to_dict(cfg)))
    again = resolve_config(load_raw_config(f), registry)
    assert config_to_dict(again) == config_to_dict(cfg)
