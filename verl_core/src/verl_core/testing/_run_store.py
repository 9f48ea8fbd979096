"""Conformance tests for :class:`~verl_core.contracts.RunStore` implementations.

Subclass :class:`RunStoreConformance`, set :attr:`~RunStoreConformance.store_name` to the name the store is
registered under (``verl.run_stores``; it must be installed: a second process builds it from the config, as a
second ``verl run`` would) and provide the fixture ``store``: a callable ``(run_dir, keep=0)`` that returns a
new store of that run directory (the store class itself, usually). The suite writes
checkpoints as the core does (a directory ``write`` fills), claims directories with configs of a tiny
local model (:func:`~verl_core.testing.tiny_model_dir`) and checks what the contract promises: whole
checkpoints only, corrupt ones never resumed, one run per directory, a resume only of what it holds,
and the run's own copy of its model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from verl_core.config import apply_overrides, resolve_config
from verl_core.contracts import CheckpointError, CheckpointWriteError, ConfigError, RunStore
from verl_core.registry import PluginRegistry
from verl_core.testing._factories import tiny_model_dir

__all__ = ["RunStoreConformance"]


def _writer(payload: bytes, *, fail: bool = False):
    def write(directory: Path) -> None:
        (directory / "actor").mkdir(parents=True)
        (directory / "actor" / "weights.bin").write_bytes(payload)
        (directory / "trainer_state.json").write_text(json.dumps({"payload": len(payload)}))
        if fail:
            raise OSError(28, "No space left on device")
    return write


class RunStoreConformance:
    """The :class:`~verl_core.contracts.RunStore` contract; fixture ``store`` (see the module docstring)."""

    #: The name the store is registered under (``run.store``).
    store_name = "local"
    #: Files the store rewrites only to hold the directory, left out where the suite checks that nothing changed.
    lock_files: tuple[str, ...] = ("run.lock",)

    @pytest.fixture
    def model_dir(self, tmp_path_factory: pytest.TempPathFactory) -> str:
        return tiny_model_dir(tmp_path_factory.mktemp("run-store-model"))

    def overrides(self, run_dir: Path, model: str, *overrides: str) -> list[str]:
        """A run of ``model`` into ``run_dir`` kept by this store, with ``overrides``."""
        return [f"run.output_dir={json.dumps(str(run_dir))}", f"model.path={json.dumps(model)}",
                f"run.store={json.dumps(self.store_name)}", *overrides]

    def config(self, run_dir: Path, model: str, *overrides: str) -> Any:
        registry = PluginRegistry()
        return resolve_config(apply_overrides({}, self.overrides(run_dir, model, *overrides)), registry), registry

    def claim(self, store: RunStore, model_dir: str, *overrides: str) -> Any:
        cfg, registry = self.config(store.run_dir, model_dir, *overrides)
        store.claim(cfg, registry, model_path=model_dir, model=None, tokenizer=None, critic=None)
        return cfg

    def files(self, run_dir: Path) -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name not in self.lock_files}

    def second_run(self, run_dir: Path, model_dir: str, *overrides: str) -> str:
        """Another process claims ``run_dir`` as a second ``verl run`` would (then lets it go): "claimed", or
        the message it was refused with."""
        probe = f"""if True:
            import json
            from verl_core.assembly import run_store
            from verl_core.config import apply_overrides, resolve_config
            from verl_core.contracts import ConfigError
            from verl_core.registry import PluginRegistry
            registry = PluginRegistry()
            cfg = resolve_config(apply_overrides({{}}, {self.overrides(run_dir, model_dir, *overrides)!r}), registry)
            store = run_store(registry, cfg)
            try:
                store.claim(cfg, registry, model_path={model_dir!r}, model=None, tokenizer=None, critic=None)
            except ConfigError as exc:
                print("refused:", exc)
            else:
                store.release()
                print("claimed")
        """
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, f"the second run failed otherwise than by a refusal: {out.stderr[-3000:]}"
        return out.stdout.strip().splitlines()[-1]

    # ------------------------------------------------------------------ checkpoints
    def test_a_saved_checkpoint_is_the_latest_and_holds_what_was_written(self, store, tmp_path):
        s = store(tmp_path / "run")
        assert s.latest() is None
        first = s.save(1, _writer(b"one"), info={"model": "m"})
        second = s.save(2, _writer(b"two"), info={"model": "m"})
        assert first != second and s.latest() == second and s.latest(verify=False) == second
        assert (second / "actor" / "weights.bin").read_bytes() == b"two"
        again, found = type(s).find(tmp_path / "run")
        assert found == second and again.run_dir == s.run_dir
        assert type(s).find(first)[1] == first

    def test_a_failed_write_leaves_nothing_and_the_latest_unchanged(self, store, tmp_path):
        s = store(tmp_path / "run")
        kept = s.save(1, _writer(b"one"), info={})
        before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
        with pytest.raises(CheckpointWriteError):
            s.save(2, _writer(b"two", fail=True), info={})
        assert s.latest() == kept
        assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == before

    def test_keep_drops_the_oldest(self, store, tmp_path):
        s = store(tmp_path / "run", keep=2)
        paths = [s.save(step, _writer(bytes([step])), info={}) for step in (1, 2, 3)]
        assert not paths[0].exists() and paths[1].exists() and paths[2].exists()

    def test_a_corrupt_checkpoint_is_never_resumed(self, store, tmp_path):
        s = store(tmp_path / "run")
        good = s.save(1, _writer(b"good weights"), info={})
        bad = s.save(2, _writer(b"weights here"), info={})
        (bad / "actor" / "weights.bin").write_bytes(b"weights HERE")  # same size, other bytes
        with pytest.raises(CheckpointError, match="weights.bin"):
            type(s).find(bad)
        with pytest.raises(CheckpointError, match="weights.bin"):
            store(tmp_path / "run").latest(fallback=False)
        assert store(tmp_path / "run").latest() == good  # the one before it
        assert store(tmp_path / "run").latest() == good  # and the corrupt one stays set aside
        with pytest.raises(CheckpointError):
            type(s).find(tmp_path / "nothing-here")

    # ------------------------------------------------------------------ the directory
    def test_one_run_at_a_time_holds_the_directory_from_claim_to_release(self, store, tmp_path, model_dir):
        run_dir = tmp_path / "run"
        s = store(run_dir)
        s.hold()  # before claim: nothing to hold (a rank that only serves the controller)
        assert self.second_run(run_dir, model_dir, "run.seed=7") == "claimed"
        s = store(run_dir)
        assert s.recorded_config()["run"]["seed"] == 7
        self.claim(s, model_dir, "run.seed=7")
        try:
            refused = self.second_run(run_dir, model_dir, "run.seed=7")
            assert refused.startswith("refused: run.output_dir"), f"a second run claimed a held directory: {refused}"
            s.release()
            assert self.second_run(run_dir, model_dir, "run.seed=7") == "claimed"  # released
            s.hold()
            assert self.second_run(run_dir, model_dir, "run.seed=7").startswith("refused: run.output_dir")
        finally:
            s.release()

    def test_a_resume_that_would_train_something_else_is_refused_and_changes_nothing(self, store, tmp_path,
                                                                                   model_dir):
        run_dir = tmp_path / "run"
        s = store(run_dir)
        self.claim(s, model_dir, "run.seed=7")
        s.save(1, _writer(b"one"), info={})
        s.release()
        before = self.files(run_dir)
        other, registry = self.config(run_dir, model_dir, "run.seed=8")
        again = store(run_dir)
        with pytest.raises(ConfigError, match="seed"):
            again.check(other, registry)
        with pytest.raises(ConfigError, match="seed"):
            again.claim(other, registry, model_path=model_dir, model=None, tokenizer=None, critic=None)
        assert self.files(run_dir) == before
        assert self.second_run(run_dir, model_dir, "run.seed=7") == "claimed"  # the refused claim holds nothing
        same, registry = self.config(run_dir, model_dir, "run.seed=7", "run.max_steps=99")
        again.check(same, registry)  # a safe change resumes
        again.claim(same, registry, model_path=model_dir, model=None, tokenizer=None, critic=None)
        again.release()

    def test_the_run_keeps_its_own_copy_of_its_model(self, store, tmp_path, model_dir):
        s = store(tmp_path / "run")
        self.claim(s, model_dir)
        s.release()
        copies = s.model_copies({"path": model_dir})
        assert set(copies) == {"path"} and (Path(copies["path"]) / "config.json").is_file()
        assert s.model_copies({"path": "/somewhere/else"}) == {}
        assert s.stand_in("model.path", model_dir) == model_dir  # still there: itself
        gone = str(Path(model_dir).with_name("moved-away"))
        os.replace(model_dir, gone)
        try:
            assert s.stand_in("model.path", model_dir) == copies["path"]
        finally:
            os.replace(gone, model_dir)
