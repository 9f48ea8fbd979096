"""The local run store against the run-store contract (the real filesystem, real locks, a real second process),
and a run that keeps its store: a resume through another one is refused."""

import importlib.metadata
import json

import pytest

from verl_core.contracts import ConfigError
from verl_core.registry import PluginRegistry
from verl_core.run_state import saved_config
from verl_core.testing import RunStoreConformance, tiny_model_dir
from verl_run_store import LocalRunStore


class TestLocalRunStore(RunStoreConformance):
    store_name = "local"

    @pytest.fixture
    def store(self):
        return LocalRunStore


def test_a_run_resumes_only_through_the_store_it_recorded(tmp_path):
    """Another installed store (here the local one under a second name) must not take over a run, neither as
    ``from_checkpoint(store=...)`` nor as a ``run.store`` override."""
    site = tmp_path / "site"
    info = site / "other_store-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: other-store\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[verl.run_stores]\nelsewhere = verl_run_store:LocalRunStore\n\n"
                                           "[verl.plugin_api]\nv3 = verl_run_store\n")
    registry = PluginRegistry(distributions=[*importlib.metadata.distributions(),
                                             *importlib.metadata.distributions(path=[str(site)])])
    model = tiny_model_dir(tmp_path)
    run_dir = tmp_path / "run"
    conformance = TestLocalRunStore()
    store = LocalRunStore(run_dir)
    conformance.claim(store, model)
    store.save(1, lambda d: (d / "trainer_state.json").write_text(json.dumps({"step": 1})), info={})
    store.release()

    assert saved_config(run_dir, [], registry, given=set()).run.store == "local"
    with pytest.raises(ConfigError, match=r"^run.store: .* is kept by run store 'local'.*store='local'"):
        saved_config(run_dir, [], registry, given=set(), store="elsewhere")
    with pytest.raises(ConfigError, match=r"^run.store: .* is kept by run store 'local'"):
        saved_config(run_dir, ['run.store="elsewhere"'], registry, given=set())
