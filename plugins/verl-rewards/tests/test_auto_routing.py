"""``reward.name = "auto"``: a row's data_source picks the reward plugin that claims it.

The rewards live in a throw-away distribution (dist-info metadata plus a module) in a temporary
directory, so the real ``importlib.metadata`` discovery runs without installing anything.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from verl_core.registry import PluginRegistry
from verl_rewards import RewardSpecError, resolve_data_source

REWARDS = """
    def claims(response, ground_truth):
        return 1.0
    claims.data_sources = ("Org/Set-A",)

    def plain(response, ground_truth):
        return 0.0
"""


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    mod = "_verl_rewards_routing_plugin"
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent(REWARDS))
    info = tmp_path / f"{mod}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: verl-rewards-routing-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[verl.rewards]\nclaims = {mod}:claims\nplain = {mod}:plain\n\n"
                                           f"[verl.plugin_api]\nv3 = {mod}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield PluginRegistry(paths=[str(tmp_path)], core_version="0.1.0")
    sys.modules.pop(mod, None)


def test_auto_routes_a_data_source_to_the_reward_that_claims_it(registry) -> None:
    assert resolve_data_source("org/set-a", registry=registry) == "claims"  # case-insensitive
    assert resolve_data_source("plain", registry=registry) == "plain"  # a reward's own name
    assert resolve_data_source("Org/Set-A", registry=registry, aliases={"Org/Set-A": "plain"}) == "plain"
    with pytest.raises(RewardSpecError, match="no reward for data_source 'other'"):
        resolve_data_source("other", registry=registry)


def test_options_for_an_installed_reward_the_run_does_not_use_are_refused(registry) -> None:
    # They were accepted and never read: the run's data routes to `claims`, so `plain` never loads.
    from verl_rewards import RewardConfig
    from verl_rewards.manager import RewardManager

    config = RewardConfig(options={"plain": {"scale": 2.0}}, isolation="none")
    with pytest.raises(RewardSpecError, match=r"reward.options.plain: this run scores with no 'plain' reward "
                                              r"\(it scores with \['claims'\]\)"):
        RewardManager(registry=registry, data_sources=["Org/Set-A"], config=config)
    # Before the data's sources are known, an installed reward's name is all there is to check.
    RewardManager(registry=registry, config=config).close()
