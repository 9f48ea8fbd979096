"""What a new user trips on (issue 34): each message says what happened and what to do.

In-process CLI (``typer.testing.CliRunner``) on a tiny model directory, so nothing here builds the built-in
model or trains.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from verl_cli.cli import USER_ERROR_EXIT, app


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    from verl_core.testing import tiny_model_dir

    return tiny_model_dir(tmp_path / "model")


@pytest.fixture
def cli():
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def _error(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("error: "))


# ----------------------------------------------------------------------------- plugin names
def test_a_typo_of_grpo_suggests_grpo_and_the_runner_up(cli) -> None:
    res = cli("run", "--algo", "gpro")
    assert res.exit_code == USER_ERROR_EXIT
    # One swap from grpo (the default, in verl-core), two edits from gspo (contrib): grpo first, both shown.
    assert "Did you mean 'grpo' (or 'gspo')?" in _error(res.output), res.output


def test_close_names_rank_by_edits_then_by_how_common_the_name_is() -> None:
    from verl_core.registry import close_names

    names = ["cispo", "dapo", "gpg", "grpo", "gspo", "ppo", "rloo"]
    assert close_names("gpro", names, common={"grpo", "ppo"})[:2] == ["grpo", "gspo"]
    assert close_names("pp", names, common={"grpo", "ppo"})[0] == "ppo"
    # Equal edits: the common name first, whatever difflib's similarity says.
    assert close_names("gxpo", ["gspo", "grpo"], common={"grpo"})[0] == "grpo"
    assert close_names("gxpo", ["gspo", "grpo"], common={"gspo"})[0] == "gspo"
    assert close_names("completely_else", names) == []


# ----------------------------------------------------------------------------- config keys
def test_clip_ratio_sets_both_clip_ratios_and_the_specific_key_wins() -> None:
    from verl_core.config import apply_overrides, resolve_config
    from verl_core.registry import PluginRegistry

    registry = PluginRegistry()
    cfg = resolve_config(apply_overrides({}, ["algorithm.clip_ratio=0.3"]), registry)
    assert (cfg.algorithm.config.clip_ratio_low, cfg.algorithm.config.clip_ratio_high) == (0.3, 0.3)
    cfg = resolve_config(apply_overrides({}, ["algorithm.clip_ratio=0.2", "algorithm.clip_ratio_high=0.28"]), registry)
    assert (cfg.algorithm.config.clip_ratio_low, cfg.algorithm.config.clip_ratio_high) == (0.2, 0.28)
    assert cfg.algorithm.config.clip_ratio_c == 0.0  # never the dual-clip constant


def test_a_key_that_starts_a_family_suggests_the_family(cli) -> None:
    res = cli("config", "show", "algorithm.kl=0.1")
    assert res.exit_code == USER_ERROR_EXIT
    assert "did you mean one of 'kl_coef', 'kl_estimator', 'kl_in_reward'?" in _error(res.output), res.output


def test_config_show_lists_every_key_the_run_accepts_with_derived_defaults_explained(cli, model_dir: str) -> None:
    from verl_core.config import PluginSection, apply_overrides, resolve_config, tomllib
    from verl_core.registry import PluginRegistry

    for args, gap in (((), "0.001"), (("model.dtype=\"bfloat16\"",), "0.1"), (("rollout.max_log_prob_gap=0.5",), None)):
        res = cli("config", "show", "--model", model_dir, *args)
        assert res.exit_code == 0, res.output
        shown = tomllib.loads(res.output)  # still valid TOML
        line = next(x for x in res.output.splitlines() if "max_log_prob_gap" in x)
        if gap is None:
            assert line == "max_log_prob_gap = 0.5"
        else:
            assert line.startswith(f"# max_log_prob_gap = {gap}  # from compute dtypes"), line
            assert "unset: the weight-sync guard" in line
        cfg = resolve_config(apply_overrides({"model": {"path": model_dir}}, list(args)), PluginRegistry())
        for section, value in cfg.sections.items():
            obj = value.config if isinstance(value, PluginSection) else value
            for f in dataclasses.fields(obj) if obj is not None else ():
                in_toml = f.name in shown.get(section, {})
                in_comment = f"# {f.name} = " in res.output.split(f"[{section}]", 1)[1].split("\n[", 1)[0]
                assert in_toml or in_comment, f"{section}.{f.name} is not shown"


def test_epochs_and_max_steps_together_say_which_wins(cli, model_dir: str) -> None:
    res = cli("config", "show", "--model", model_dir, "run.epochs=2", "run.max_steps=5")
    first = res.output.splitlines()[0]
    assert "run.epochs=2 decides the number of steps" in first and "run.max_steps=5 is not used" in first, first
    res = cli("config", "show", "--model", model_dir, "run.max_steps=5")
    assert "decides the number of steps" not in res.output.splitlines()[0]


# ----------------------------------------------------------------------------- data
def test_an_empty_data_file_says_it_has_no_rows(cli, model_dir: str, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    res = cli("run", "--dry-run", "--model", model_dir, "--data", str(empty), "--output-dir", str(tmp_path / "r"),
              "reward.name=\"exact_match\"")
    assert res.exit_code == USER_ERROR_EXIT
    assert _error(res.output).startswith(f"error: {empty}: the file has no rows; it needs one row per prompt"), res.output
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")  # blank lines are no rows either
    res = cli("run", "--dry-run", "--model", model_dir, "--data", str(blank), "--output-dir", str(tmp_path / "r"))
    assert "the file has no rows" in _error(res.output)


# ----------------------------------------------------------------------------- plugins list --check
def test_plugins_list_check_says_what_it_found_for_an_incompatible_plugin(cli, site: Path) -> None:
    info = site / "verl_cli_old-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: verl-cli-old\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[verl.algorithms]\nold_algo = _verl_cli_old:Algo\n\n"
                                           "[verl.plugin_api]\nv1 = unused\n")
    res = cli("plugins", "list", "--kind", "algorithm", "--check")
    line = next(row for row in res.output.splitlines() if "old_algo" in row and row.startswith("algorithm"))
    assert line.split()[-3:] == ["not", "imported:", "incompatible"], line
    assert "algorithm/old_algo:" in res.output  # the reason, below the table
    grpo = next(row for row in res.output.splitlines() if row.startswith("algorithm") and " grpo " in row)
    assert grpo.endswith("imported OK")


# ----------------------------------------------------------------------------- export
def test_export_refuses_a_directory_that_is_not_empty_unless_forced(cli, tmp_path: Path) -> None:
    target = tmp_path / "hf"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    res = cli("export", str(tmp_path / "no-run"), str(target))
    assert res.exit_code == USER_ERROR_EXIT
    assert _error(res.output) == (f"error: {target} is not empty (notes.txt); export into a new or empty directory, "
                                  f"or pass --force to write over what is there")
    assert (target / "notes.txt").read_text() == "mine"
    # --force (and an empty directory) go on to the export itself, which here finds no checkpoint.
    for args in (("--force",), ()):
        where = target if args else tmp_path / "empty"
        where.mkdir(exist_ok=True)
        res = cli("export", str(tmp_path / "no-run"), str(where), *args)
        assert res.exit_code == USER_ERROR_EXIT and "not empty" not in res.output, res.output


# ----------------------------------------------------------------------------- dry run
def test_dry_run_of_a_good_config_describes_the_run_and_writes_nothing(cli, model_dir: str, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(8)))
    out = tmp_path / "run"
    res = cli("run", "--dry-run", "--model", model_dir, "--data", str(data), "--output-dir", str(out),
              "--algo", "ppo", "reward.name=\"exact_match\"", "data.batch_size=4")
    assert res.exit_code == 0, res.output
    text = res.output
    assert "model: " in text and "0.56M parameters" in text and "layers 2, heads 4, kv heads 2" in text
    assert "data: 8 training prompts" in text and "4 prompts x 8 samples per step" in text
    assert "prompt 0 (" in text and "What is 0+0?" in text and "ground truth: '0'" in text
    assert "  old_log_probs | ref_log_probs | values\n" in text  # PPO's dataflow
    for role in ("actor", "critic", "reference", "rollout"):
        assert f"\n  {role} " in text.split("memory per rank", 1)[1]
    assert "dry run: the run would start" in text
    assert not out.exists()
    res = cli("config", "check", "--model", model_dir, "--data", str(data), "--output-dir", str(out),
              "reward.name=\"exact_match\"", "data.batch_size=4", "run.epochs=3")
    assert res.exit_code == 0 and "steps: 6 (run.epochs=3 x 8 prompts // data.batch_size=4)" in res.output


def test_parameter_count_reads_the_weight_file_headers(model_dir: str) -> None:
    from safetensors.torch import load_file

    from verl_cli.dryrun import parameter_count

    tensors = {k: v for f in Path(model_dir).glob("*.safetensors") for k, v in load_file(f).items()}
    assert parameter_count(model_dir) == sum(t.numel() for t in tensors.values())
