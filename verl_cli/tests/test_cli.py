"""The ``verl`` command line in-process (``typer.testing.CliRunner``): user errors, ``config show``, ``plugins list``.

Runs that would train are stopped by their error before any model loads, so these tests stay fast.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from verl_cli.cli import USER_ERROR_EXIT, app


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    """A tiny model directory, so that no test here builds the built-in model."""
    from verl_core.testing import tiny_model_dir

    return tiny_model_dir(tmp_path / "model")


@pytest.fixture
def cli():
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(app, list(args))

    return invoke


def test_a_model_path_that_cannot_load_exits_2_naming_the_key_before_anything_loads(cli, tmp_path: Path,
                                                                                     model_dir: str) -> None:
    out = tmp_path / "run"
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    a_file = tmp_path / "weights.bin"
    a_file.write_text("")
    cases = {str(tmp_path / "no" / "model"): "does not exist; give a local Hugging Face model directory",
             str(not_a_model): "has no config.json, so it is not a Hugging Face model directory",
             str(a_file): "is a file; give a Hugging Face model directory"}
    for model, message in cases.items():
        res = cli("run", "--model", model, "--output-dir", str(out))
        assert res.exit_code == USER_ERROR_EXIT, res.output
        assert f"error: model.path: {model!r} {message}" in res.output
        assert not out.exists()  # refused before the run directory (or anything else) was made
    res = cli("run", "--model", model_dir, "--output-dir", str(out), f"model.tokenizer='{tmp_path / 'no-tok'}'")
    assert res.exit_code == USER_ERROR_EXIT
    assert "error: model.tokenizer: " in res.output and "does not exist" in res.output


def test_missing_data_exits_2_naming_the_key(cli, tmp_path: Path, model_dir: str) -> None:
    missing = tmp_path / "train.jsonl"
    res = cli("run", "--model", model_dir, "--data", str(missing), "--output-dir", str(tmp_path / "run"))
    assert res.exit_code == USER_ERROR_EXIT, res.output
    assert f"error: data.train: data file {str(missing)!r} does not exist" in res.output
    res = cli("run", "--model", model_dir, "--output-dir", str(tmp_path / "run"), f"data.val='{missing}'")
    assert res.exit_code == USER_ERROR_EXIT and "error: data.val: data file" in res.output
    assert not (tmp_path / "run").exists()


def test_config_show_names_the_defaults_profile_it_resolved(cli, model_dir: str, tmp_path: Path) -> None:
    from verl_core.config import tomllib

    res = cli("config", "show")
    assert res.exit_code == 0, res.output
    first = res.output.splitlines()[0]
    assert first.startswith("# profile: built-in task (the preset of builtin:tiny-qwen2-addition sets backend.lr, "
                            "rollout.max_new_tokens, data.max_prompt_length, run.max_steps"), first
    assert tomllib.loads(res.output)["backend"]["lr"] == 1e-4  # still valid TOML
    res = cli("config", "show", "backend.lr=0.01")
    first = res.output.splitlines()[0]
    assert "backend.lr" not in first and "sets rollout.max_new_tokens" in first  # what the user set is not the preset's
    from verl_core.testing import tiny_text_model_dir

    res = cli("config", "show", "--model", tiny_text_model_dir(tmp_path))  # 1024 positions: the defaults fit
    assert res.output.splitlines()[0] == "# profile: own model (each section's defaults; no builtin: model preset)"
    shown = tomllib.loads(res.output)
    assert (shown["backend"]["lr"], shown["data"]["max_prompt_length"], shown["run"]["max_steps"]) == (1e-6, 512, 60)
    assert shown["rollout"]["max_new_tokens"] == 64
    # 64 positions: 512 + 64 tokens cannot fit, so the lengths follow the model (what you set still wins).
    res = cli("config", "show", "--model", model_dir, "rollout.max_new_tokens=8")
    assert res.output.splitlines()[0] == ("# profile: own model (each section's defaults; data.max_prompt_length and "
                                          "rollout.max_new_tokens fitted to its max_position_embeddings=64)")
    shown = tomllib.loads(res.output)
    assert (shown["data"]["max_prompt_length"], shown["rollout"]["max_new_tokens"], shown["backend"]["lr"]) == (
        48, 8, 1e-6)


def test_plugins_list_check_imports_each_plugin_and_shows_the_broken_ones(cli, site: Path) -> None:
    import json
    import sys

    (site / "_verl_cli_broken.py").write_text("raise ImportError('needs the package frobnicate')\n")
    (site / "_verl_cli_fine.py").write_text("class Algo:\n    pass\n")
    for mod in ("_verl_cli_broken", "_verl_cli_fine"):
        info = site / f"{mod}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {mod.strip('_').replace('_', '-')}\n"
                                       f"Version: 1.0\n")
        (info / "entry_points.txt").write_text(f"[verl.algorithms]\n{mod.strip('_')} = {mod}:Algo\n\n"
                                               f"[verl.plugin_api]\nv3 = unused\n")
    try:
        # Listing reads metadata only: the broken module is not imported, so it looks available.
        res = cli("plugins", "list", "--kind", "algorithm")
        assert res.exit_code == 0, res.output
        line = next(row for row in res.output.splitlines() if "verl_cli_broken" in row)
        assert line.split()[-1] == "available"
        assert "_verl_cli_broken" not in sys.modules
        res = cli("plugins", "list", "--kind", "algorithm", "--check")
        assert res.exit_code == 1, res.output
        line = next(row for row in res.output.splitlines() if row.startswith("algorithm") and "verl_cli_broken" in row)
        assert line.split()[-3:] == ["broken", "import", "failed"]  # STATUS, then CHECK: what the check found
        assert ("algorithm/verl_cli_broken: import of _verl_cli_broken:Algo failed: ImportError: needs the package "
                "frobnicate") in res.output
        fine = next(row for row in res.output.splitlines() if row.startswith("algorithm") and "verl_cli_fine" in row)
        assert fine.split()[-3:] == ["available", "imported", "OK"]
        assert res.output.splitlines()[0].split()[-1] == "CHECK"
        summary = res.output.splitlines()[-1]
        assert summary.startswith("check: ") and "1 import failed" in summary and "imported OK" in summary
        res = cli("plugins", "list", "--kind", "algorithm", "--check", "--json")
        rows = {r["name"]: r for r in json.loads(res.output)}
        assert res.exit_code == 1 and rows["verl_cli_broken"]["status"] == "broken"
        assert (rows["verl_cli_broken"]["check"], rows["verl_cli_fine"]["check"]) == ("import failed", "imported OK")
        assert "frobnicate" in rows["verl_cli_broken"]["message"]
        assert {r["status"] for name, r in rows.items() if name != "verl_cli_broken"} == {"available"}
    finally:
        for mod in ("_verl_cli_broken", "_verl_cli_fine"):
            sys.modules.pop(mod, None)


def test_a_config_no_installed_config_format_reads_exits_2_naming_the_package(cli, site: Path, tmp_path: Path) -> None:
    """verl's and TRL's YAML come through a ``verl.config_formats`` plugin (verl-config-import); without one,
    ``verl run -c x.yaml`` and ``verl config import`` say what to install, exit 2, no traceback."""
    # An empty verl-config-import first on the path hides an installed one: the registry counts the first copy.
    info = site / "verl_config_import-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: verl-config-import\nVersion: 0.0\n")
    path = tmp_path / "ppo_trainer.yaml"
    path.write_text("data:\n  train_batch_size: 2\n")
    for args in (("run", "-c", str(path)), ("config", "import", str(path)),
                 ("config", "import", "data.train_batch_size=2")):
        res = cli(*args)
        assert res.exit_code == USER_ERROR_EXIT, res.output
        assert "no installed config format reads" in res.output and "pip install verl-config-import" in res.output
        assert "Traceback" not in res.output
    ours = tmp_path / "ours.cfg"  # our TOML by another name is still read as TOML
    ours.write_text("[run]\nmax_steps = 3\n")
    res = cli("config", "show", "-c", str(ours))
    assert res.exit_code == 0 and "max_steps = 3" in res.output, res.output
