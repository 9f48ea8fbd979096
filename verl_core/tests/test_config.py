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
    ({"algorithm": {"kl": 0.1}}, "algorithm.kl", "did you mean"),
    ({"rollot": {}}, "rollot", "did you mean 'rollout'"),
    ({"run": {"max_steps": "ten"}}, "run.max_steps", "expected an integer"),
    ({"run": {"val_before_train": 1}}, "run.val_before_train", "expected true or false"),
    ({"rollout": {"n": 0}}, "rollout.n", "at least 1"),
    ({"rollout": {"val_n": 0}}, "rollout.val_n", "at least 1"),
    # NaN slips past every range check: before, entropy_coef=nan loaded the model and stopped at step 1 with
    # "actor loss is nan ... (lower backend.lr, or check the rewards for NaN)", exit 1.
    ({"rollout": {"temperature": float("nan")}}, "rollout.temperature", "got nan"),
    ({"algorithm": {"entropy_coef": float("nan")}}, "algorithm.entropy_coef", "got nan"),
    ({"backend": {"grad_clip": float("nan")}}, "backend.grad_clip", "got nan"),
    ({"rollout": {"max_log_prob_gap": float("nan")}}, "rollout.max_log_prob_gap", "got nan"),  # float | None
    # inf passes a range without an upper bound: temperature=inf sampled uniformly and trained on it, kl_coef=inf
    # or lr=inf stopped at step 1 on a NaN loss, blaming the learning rate.
    ({"rollout": {"temperature": float("inf")}}, "rollout.temperature", "expected a finite number, got inf"),
    ({"algorithm": {"kl_coef": float("inf")}}, "algorithm.kl_coef", "got inf"),
    ({"backend": {"lr": float("inf")}}, "backend.lr", "got inf"),
    ({"rollout": {"max_log_prob_gap": float("inf")}}, "rollout.max_log_prob_gap", "expected a finite number"),
    ({"rollout": {"val_top_p": 0}}, "rollout.val_top_p", "(0, 1]"),
    # Greedy validation gives val_n copies of one sample: their mean is one sample's reward, counted val_n times.
    ({"rollout": {"val_n": 4}}, "rollout.val_n", "set val_temperature > 0"),
    ({"rollout": {"val_top_p": 0.9}}, "rollout.val_top_p", "greedy validation"),  # would be accepted and unused
    ({"rollout": {"val_top_k": 20}}, "rollout.val_top_k", "greedy validation"),
    ({"algorithm": {"loss_agg_mode": "mean"}}, "algorithm.loss_agg_mode", "must be one of"),
    ({"backend": {"betas": [0.9]}}, "backend.betas", "expected 2 values"),
    # Each was read as 1 (a forward per token or sample) or as "no clipping" without a word.
    ({"backend": {"grad_clip": -1.0}}, "backend.grad_clip", "must be >= 0 (0 disables clipping)"),
    ({"backend": {"logits_chunk_size": 0}}, "backend.logits_chunk_size", "must be >= 1"),
    ({"backend": {"log_prob_micro_batch_size": -4}}, "backend.log_prob_micro_batch_size", "must be >= 1"),
    ({"backend": {"weight_decay": -0.1}}, "backend.weight_decay", "must be >= 0"),
    ({"backend": {"lora_rank": 8, "lora_alpha": 0}}, "backend.lora_alpha", "must be > 0"),  # trained nothing
    ({"backend": {"lora_rank": 8, "lora_dropout": 1.0}}, "backend.lora_dropout", "[0, 1)"),
    ({"backend": {"autocast": "float16"}}, "backend.autocast", "needs loss scaling"),  # FSDP has no GradScaler
    ({"backend": {"param_dtype": "float16"}}, "backend.param_dtype", "needs loss scaling"),
    ({"data": {"val_batch_size": -1}}, "data.val_batch_size", "must be >= 0"),  # validated nothing: a NaN reward
    ({"data": {"max_val_samples": -1}}, "data.max_val_samples", "must be >= 0"),  # dropped the last prompt
    ({"data": {"overlong": "truncate"}}, "data.overlong", "'truncate_left', 'truncate_right'"),
])
def test_errors_name_the_key(registry, raw, path, fragment):
    with pytest.raises(ConfigError) as info:
        resolve_config(raw, registry)
    assert info.value.path == path
    assert fragment in str(info.value)


def test_unknown_plugin_names_the_package():
    # A first-party plugin the environment does not install. Every first-party distribution is installed
    # here, so the registry is given all of them but verl-backend-megatron.
    import importlib.metadata

    others = [d for d in importlib.metadata.distributions() if d.metadata["Name"] != "verl-backend-megatron"]
    with pytest.raises(UnknownPluginError, match="pip install verl-backend-megatron"):
        resolve_config({"backend": {"name": "megatron"}}, PluginRegistry(distributions=others))


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["algorithm.kl_coef"])


def test_resolved_config_round_trips_through_toml(tmp_path, registry):
    cfg = resolve_config({"algorithm": {"name": "ppo", "gamma": 0.5}}, registry)
    f = tmp_path / "out.toml"
    f.write_text(dump_toml(config_to_dict(cfg)))
    again = resolve_config(load_raw_config(f), registry)
    assert config_to_dict(again) == config_to_dict(cfg)


def test_a_plugin_registers_its_own_config_section(tmp_path, monkeypatch):
    """A new section (an environment's, an executor's) is an entry point, not a core edit."""
    import sys
    import textwrap

    site = tmp_path / "site"
    (site / "verl_section_demo-1.0.dist-info").mkdir(parents=True)
    (site / "verl_section_demo-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: verl-section-demo\nVersion: 1.0\n")
    (site / "verl_section_demo-1.0.dist-info" / "entry_points.txt").write_text(
        "[verl.plugin_api]\nv3 = verl_section_demo\n\n"
        "[verl.config_sections]\nsandbox = verl_section_demo:SECTION\nbroken = verl_section_demo:NOT_A_SECTION\n")
    (site / "verl_section_demo.py").write_text(textwrap.dedent("""
        from dataclasses import dataclass
        from verl_core.config import ConfigSection

        @dataclass
        class SandboxConfig:
            timeout: float = 5.0
            def validate(self):
                if self.timeout <= 0:
                    raise ValueError("timeout: must be > 0")

        SECTION = ConfigSection(schema=SandboxConfig)
        NOT_A_SECTION = object()
    """))
    monkeypatch.syspath_prepend(str(site))
    registry = PluginRegistry(paths=[str(site), *sys.path])
    with pytest.raises(ConfigError, match="broken.*not a verl_core.config.ConfigSection"):
        resolve_config({}, registry)

    (site / "verl_section_demo-1.0.dist-info" / "entry_points.txt").write_text(
        "[verl.plugin_api]\nv3 = verl_section_demo\n\n[verl.config_sections]\nsandbox = verl_section_demo:SECTION\n")
    registry = PluginRegistry(paths=[str(site), *sys.path])
    cfg = resolve_config(apply_overrides({}, ["sandbox.timeout=2.5"]), registry)
    assert cfg.sandbox.timeout == 2.5
    assert config_to_dict(cfg)["sandbox"] == {"timeout": 2.5}
    assert list(config_to_dict(cfg))[:4] == ["run", "model", "data", "reward"]  # the core's first
    with pytest.raises(ConfigError, match="sandbox.timeout: must be > 0"):
        resolve_config({"sandbox": {"timeout": -1.0}}, registry)
    with pytest.raises(ConfigError, match="sandbox: unknown section"):
        # Not installed: an unknown section.
        resolve_config({"sandbox": {}}, PluginRegistry(paths=[p for p in sys.path if p != str(site)]))


def test_a_range_compares_an_integer_with_a_fractional_bound():
    from verl_core.config import Range

    assert Range(gt=0.5).problem(1) is None  # int.__gt__(0.5) is NotImplemented: compared as numbers
    assert Range(gt=0.5).problem(0) == "must be > 0.5, got 0"
    assert Range(ge=0, le=1, hint="a fraction").problem(1.5) == "must be >= 0 and <= 1, got 1.5 (a fraction)"


def test_a_negative_val_every_is_named_as_itself(registry):
    with pytest.raises(ConfigError, match=r"run\.val_every: must be >= 0"):
        resolve_config({"run": {"val_every": -1}}, registry)
    with pytest.raises(ConfigError, match=r"run\.save_every: must be >= 0"):
        resolve_config({"run": {"save_every": -1}}, registry)


@pytest.mark.parametrize("name", ["raw", "profile", "sections"])
def test_a_plugin_section_cannot_take_a_name_the_config_object_uses(name):
    """``Config.raw`` and ``Config.profile`` are attributes: a section of that name would be hidden behind them."""
    import dataclasses
    import types

    from verl_core.config import ConfigSection, config_sections

    @dataclasses.dataclass
    class Settings:
        x: int = 0

    class OneSection:  # the registry's two calls config_sections makes, answering one section plugin
        def list(self, kind):
            return [types.SimpleNamespace(name=name)]

        def load(self, kind, section):
            return ConfigSection(schema=Settings)

    with pytest.raises(ConfigError, match="a name the Config class uses itself"):
        config_sections(OneSection())


def test_validation_samples_with_its_own_top_p_and_top_k(registry):
    rc = resolve_config({"rollout": {"top_p": 0.5, "val_temperature": 0.6, "val_n": 4, "val_top_p": 0.9,
                                     "val_top_k": 20}}, registry).rollout.config
    val, train = rc.sampling(validation=True), rc.sampling()
    assert (val.n, val.temperature, val.top_p, val.top_k, val.greedy) == (4, 0.6, 0.9, 20, False)
    assert (train.top_p, train.top_k) == (0.5, -1)
