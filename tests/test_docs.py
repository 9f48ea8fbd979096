"""The plugin guide (docs/writing-plugins.md) against the code it describes, so it cannot drift."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "docs" / "writing-plugins.md").read_text()
TEMPLATE = ROOT / "plugins" / "verl-algo-template"


def _signature_block() -> str:
    start = GUIDE.index("Reuse instead of copying")
    block = GUIDE[start:].split("```python\n", 1)[1]
    return block.split("```", 1)[0]


def test_the_functional_signatures_in_the_guide_are_the_real_ones() -> None:
    from verl_algorithms import functional as F

    # One entry per function; continuation lines (indented) belong to the line above.
    entries = re.sub(r"\n\s+", " ", _signature_block()).strip().splitlines()
    documented = {}
    for entry in entries:
        name, params = re.match(r"(\w+)\((.*?)\) ->", entry).groups()
        documented[name] = [p.split("=")[0].strip() for p in params.split(",") if p.strip() and p.strip() != "*"]
    functions = {n for n in F.__all__ if inspect.isfunction(getattr(F, n))}
    assert set(documented) == functions  # every helper, and nothing that is not one
    for name, params in documented.items():
        assert params == list(inspect.signature(getattr(F, name)).parameters), name


def test_the_rename_table_lists_every_file_of_the_template_that_names_it() -> None:
    names = ("verl_algo_template", "verl-algo-template", "my_algo")
    naming = {str(p.relative_to(TEMPLATE)) for p in TEMPLATE.rglob("*")
              if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p)
              and any(n in p.read_text() for n in names)}
    table = GUIDE[GUIDE.index("| file | what names them |"):].split("\n\n", 1)[0]
    listed = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))
    assert naming <= listed, naming - listed
    assert listed - naming == {"src/verl_algo_template/"}  # the folder itself
    for path in listed:
        assert (TEMPLATE / path).exists(), path


def test_the_guide_names_the_entropy_knob_the_base_config_already_has() -> None:
    from dataclasses import fields

    from verl_algorithms.base import PPOFamilyConfig

    defaults = {f.name: f.default for f in fields(PPOFamilyConfig)}
    assert "`entropy_coef` (default 0.0) is already a field of `PPOFamilyConfig`" in GUIDE
    assert defaults["entropy_coef"] == 0.0


def test_every_setting_the_environment_guide_names_exists() -> None:
    """docs/writing-environments.md names settings as `section.key`; each must be a key of the config
    `verl config show --env tools` resolves (the tools settings are the environment's own)."""
    from verl_core.config import config_to_dict, resolve_config
    from verl_core.registry import PluginRegistry

    guide = (ROOT / "docs" / "writing-environments.md").read_text()
    resolved = config_to_dict(resolve_config({"environment": {"name": "tools"}}, PluginRegistry()))
    named = set(re.findall(r"`([a-z_]+)\.([a-z_]+)(?: = [^`]*)?`", guide))
    settings = {(section, key) for section, key in named if section in resolved}
    assert len(settings) >= 15, settings  # the guide names settings; the pattern still finds them
    missing = sorted(f"{s}.{k}" for s, k in settings if k not in resolved[s])
    assert not missing, f"the environment guide names settings that do not exist: {missing}"
