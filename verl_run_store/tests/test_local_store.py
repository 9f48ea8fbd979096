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


def test_a_run_that_rewound_keeps_its_own_checkpoints_and_sets_the_later_ones_aside(tmp_path, caplog):
    """``run.resume=<step 20>`` in a directory that also holds step 30, then saves step 25: by step number, pruning
    kept the abandoned step 30 and deleted the rewound run's own checkpoints, and ``latest`` fell back to step 30."""
    from verl_run_store.checkpoints import CheckpointManager

    manager = CheckpointManager(tmp_path, keep=2)
    for step in (10, 20, 30):
        manager.save(step, lambda d: (d / "f").write_text("x"), info={})
    assert [p.name for p in manager.complete()] == ["step_000020", "step_000030"]
    manager.save(25, lambda d: (d / "f").write_text("rewound"), info={})  # the run resumed from step 20
    assert [p.name for p in manager.complete()] == ["step_000020", "step_000025"]
    assert (manager.root / "rewound-step_000030" / "f").read_text() == "x"  # kept, never taken
    assert "they were set aside as rewound-step_000030 (kept" in caplog.text
    (manager.root / "latest").unlink()
    assert manager.latest().name == "step_000025"
    for step in (30, 35):  # the rewound run goes on: pruned as usual, its step 30 the new one
        manager.save(step, lambda d: (d / "f").write_text("rewound"), info={})
    assert [p.name for p in manager.complete()] == ["step_000030", "step_000035"]
    assert (manager.root / "step_000030" / "f").read_text() == "rewound"
    assert sorted(p.name for p in manager.root.glob("rewound-*")) == ["rewound-step_000030"]


def test_a_checkpoint_published_but_not_yet_named_latest_is_replaced_not_set_aside(tmp_path):
    """A kill between a checkpoint's rename and ``latest``: the resume takes the one before it and saves the same
    step again, which is the same history, not a rewind (nothing is set aside, so nothing leaks)."""
    from verl_run_store.checkpoints import CheckpointManager

    manager = CheckpointManager(tmp_path, keep=2)
    for step in (10, 20):
        manager.save(step, lambda d: (d / "f").write_text("first"), info={})
    (manager.root / "latest").write_text("step_000010\n")  # as the kill left it
    manager.save(20, lambda d: (d / "f").write_text("again"), info={})
    assert [p.name for p in manager.complete()] == ["step_000010", "step_000020"]
    assert (manager.root / "step_000020" / "f").read_text() == "again"
    assert not list(manager.root.glob("rewound-*"))
