"""Every config shipped in examples/ validates against the installed plugins (no model loads)."""

from pathlib import Path

import pytest

from verl_core.config import load_raw_config, resolve_config
from verl_core.registry import PluginRegistry

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_config_validates(path):
    cfg = resolve_config(load_raw_config(path), PluginRegistry())
    assert cfg.run.output_dir.startswith("runs/")


def test_there_are_examples():
    assert len(EXAMPLES) >= 3
