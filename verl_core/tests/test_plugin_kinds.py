"""The plugin kinds that extend verl beyond the training loop: ``builtin:`` models and datasets
(``verl.models``, ``verl.datasets``) and data readers (``verl.data_readers``). (CLI commands, ``verl.commands``,
are tested in verl-cli; rewards that claim data sources for ``reward.name = "auto"`` are tested in verl-rewards.)

Each test writes throw-away distributions (dist-info metadata plus a module) into a temporary
directory, so the real ``importlib.metadata`` discovery runs without installing anything.
"""

from __future__ import annotations

import itertools
import sys
import textwrap
from pathlib import Path

import pytest

from verl_core.registry import PluginRegistry, UnknownPluginError

_counter = itertools.count()


@pytest.fixture
def plugin(site: Path):
    """``plugin(source, {group: {name: attr}})`` writes a module and a distribution naming its attributes."""
    created: list[str] = []

    def make(source: str, entry_points: dict[str, dict[str, str]]) -> PluginRegistry:
        mod = f"_verl_kinds_plugin_{next(_counter)}"
        (site / f"{mod}.py").write_text(textwrap.dedent(source))
        created.append(mod)
        info = site / f"{mod}-1.0.dist-info"
        info.mkdir()
        name = mod.strip("_").replace("_", "-")
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        groups = {**entry_points, "verl.plugin_api": {"v3": "unused"}}
        (info / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{name} = {mod}:{attr}\n" for name, attr in eps.items()) + "\n"
            for group, eps in groups.items()))
        return PluginRegistry(paths=[str(site)], core_version="0.1.0")

    yield make
    for mod in created:
        sys.modules.pop(mod, None)


PROVIDERS = """
    from verl_core.contracts import DatasetProvider, ModelProvider

    class Tiny(ModelProvider):
        preset = {"backend": {"lr": 0.5}, "run": {"max_steps": 7}}
        def model_dir(self):
            return "/models/tiny"

    class Sums(DatasetProvider):
        splits = ("train", "test")
        def rows(self, *, split):
            if split not in self.splits:
                raise ValueError(f"no split {split!r}")
            return [{"prompt": "1+1=", "answer": "2", "split": split}]
"""


def test_builtin_models_and_datasets_resolve_through_their_plugins(plugin) -> None:
    from verl_core.config import _layered
    from verl_data import DataError, load_rows
    from verl_core.trainer import resolve_model_path

    registry = plugin(PROVIDERS, {"verl.models": {"tiny": "Tiny"}, "verl.datasets": {"sums": "Sums"}})
    assert resolve_model_path("builtin:tiny", registry) == "/models/tiny"
    assert resolve_model_path("./local-dir", registry) == "./local-dir"
    assert load_rows("builtin:sums", split="test", registry=registry)[0]["split"] == "test"
    with pytest.raises(DataError, match="builtin:sums: no split 'dev'"):
        load_rows("builtin:sums", split="dev", registry=registry)
    # A provider is asked for another row format only when it says it builds it (DatasetProvider.formats).
    with pytest.raises(DataError, match="data.train: the algorithm trains on 'preference_pairs' rows, and "
                                        "builtin:sums builds only 'prompts'; point data.train at data with "
                                        "preference_pairs"):
        load_rows("builtin:sums", registry=registry, format="preference_pairs")
    # The preset sits under the user's settings: theirs win, the rest fills in. (That resolve_config asks a builtin:
    # model for it, and a local path for none, is tested with real plugins: verl-task-arithmetic's
    # test_the_model_preset_is_layered_under_the_users_config and verl-cli's `verl config show` tests.)
    raw = _layered({"model": {"path": "builtin:tiny"}, "run": {"seed": 3}}, registry.load("model", "tiny")().preset)
    assert raw["run"] == {"max_steps": 7, "seed": 3}
    assert _layered({"run": {"max_steps": 2}}, {"run": {"max_steps": 7}})["run"] == {"max_steps": 2}


def test_an_unknown_builtin_lists_the_installed_ones_and_the_package(plugin) -> None:
    from verl_data import load_rows
    from verl_core.trainer import resolve_model_path

    registry = plugin(PROVIDERS, {"verl.models": {"tiny": "Tiny"}, "verl.datasets": {"sums": "Sums"}})
    with pytest.raises(UnknownPluginError, match=r"model.path: no built-in model 'builtin:tinny' is installed "
                                                 r"\(installed: builtin:tiny\); did you mean 'builtin:tiny'\?"):
        resolve_model_path("builtin:tinny", registry)
    # A first-party name that is not installed here: the message names the package to install.
    with pytest.raises(UnknownPluginError, match="pip install verl-task-arithmetic"):
        resolve_model_path("builtin:tiny-qwen2-addition", registry)
    with pytest.raises(UnknownPluginError, match=r"installed: builtin:sums\).*pip install verl-task-arithmetic"):
        load_rows("builtin:addition", registry=registry)


GENERATED = """
    from verl_core.contracts import DatasetProvider

    class Counting(DatasetProvider):
        argument = "a number to count to"
        splits = ("train", "test")
        def __init__(self, top, size, val_size):
            self.top, self.sizes = top, {"train": size, "test": val_size}
        @classmethod
        def from_spec(cls, argument, *, size, val_size):
            if not argument.isdigit():
                raise ValueError(f"{argument!r} is not a number; write counting:3")
            return cls(int(argument), size or 2, val_size or 1)
        def rows(self, *, split):
            return [{"prompt": f"count to {self.top}", "answer": split}] * self.sizes[split]

    class Plain(DatasetProvider):
        def rows(self, *, split):
            return []
"""


def test_a_provider_that_takes_an_argument_serves_name_colon_argument(plugin) -> None:
    """``data.train = "<name>:<argument>"``: the provider's from_spec gets the argument and data.size /
    data.val_size; a bad argument, a provider without one and an unknown name fail naming the key."""
    from verl_core.config import ConfigError, DataConfig, build_dataclass
    from verl_data import DataError, check_data_source, load_rows

    registry = plugin(GENERATED, {"verl.datasets": {"counting": "Counting", "plain": "Plain"}})
    rows = load_rows("counting:3", size=5, registry=registry)
    assert len(rows) == 5 and rows[0] == {"prompt": "count to 3", "answer": "train"}
    assert len(load_rows("counting:3", split="test", registry=registry)) == 1  # the provider's default
    check_data_source("counting:3", "data.val", registry=registry)
    with pytest.raises(DataError, match=r"data.val: 'counting:x': 'x' is not a number; write counting:3"):
        check_data_source("counting:x", "data.val", registry=registry)
    with pytest.raises(DataError, match=r"data.train: the dataset 'plain' takes no argument; use "
                                        r"data.train = 'builtin:plain'"):
        check_data_source("plain:3", "data.train", registry=registry)
    with pytest.raises(UnknownPluginError, match=r"data.train: 'countin:3' is '<provider>:<argument>' data, .*"
                                                 r"'countin'.*counting"):
        check_data_source("countin:3", "data.train", registry=registry)
    # data.size / data.val_size are for generated data only: accepted and ignored elsewhere is an error.
    assert build_dataclass(DataConfig, {"train": "counting:3", "size": 5, "val_size": 2}, "data").size == 5
    for values, key in (({"train": "rows.jsonl", "size": 5}, "data.size"),
                        ({"train": "builtin:addition", "val_size": 5}, "data.val_size"),
                        ({"train": "counting:3", "val": "val.jsonl", "val_size": 5}, "data.val_size"),
                        ({"train": "counting:3", "size": -1}, "data.size")):
        with pytest.raises(ConfigError, match=f"^{key}: "):
            build_dataclass(DataConfig, values, "data")


READERS = """
    from verl_core.contracts import DataError, DataReader

    class Shifted(DataReader):
        def check(self, spec, key, registry):
            if spec == "missing":
                raise DataError(f"{key}: {spec!r} is not there")
        def load(self, config, tokenizer, *, model_path, registry, format):
            row = {"prompt_ids": [5, 6], "prompt_text": "hi", "prompt_messages": [], "ground_truth": "1",
                   "data_source": "x", "extra_info": {}, "raw": {}}
            return [row, {**row, "prompt_ids": [5, 400]}], [], {}
"""


def test_a_data_reader_plugin_is_checked_before_models_and_its_rows_where_they_enter(plugin) -> None:
    """``data.reader`` names a ``verl.data_readers`` plugin: an unknown name says so with the installed ones, its
    ``check`` runs on data.train / data.val before any model loads, and a row it returns with a token id outside
    the vocabulary stops the run naming the plugin, the split, the row, what was expected and what came."""
    from types import SimpleNamespace

    from verl_core.assembly import check_sources, data_reader, load_data
    from verl_core.config import DataConfig
    from verl_core.contracts import DataError, ModelSpec
    from verl_core.boundary import PluginOutputError
    from verl_core.testing import build_byte_tokenizer

    registry = plugin(READERS, {"verl.data_readers": {"shifted": "Shifted"}})
    with pytest.raises(UnknownPluginError, match=r"^data.reader: no data_reader plugin named 'shfted' is installed"
                                                 r".*shifted"):
        data_reader(registry, "shfted")
    t = SimpleNamespace(config=SimpleNamespace(data=DataConfig(reader="shifted", val="missing"),
                                               rollout=SimpleNamespace(name="hf")),
                        registry=registry, tokenizer=build_byte_tokenizer(), model_spec=ModelSpec(path=""),
                        _model_obj=object())
    with pytest.raises(DataError, match="^data.val: 'missing' is not there"):
        check_sources(t, "", "")
    vocab = len(t.tokenizer)
    with pytest.raises(PluginOutputError, match=rf"^data_reader 'shifted' \(verl-kinds-plugin-\d+ 1.0\) returned list "
                                                rf"\[400\] as prompt_ids of training row 1; expected token ids in "
                                                rf"\[0, {vocab}\), the model's vocabulary. Nothing was trained"):
        load_data(t)



def test_an_unknown_run_store_is_refused_with_the_config_naming_the_installed_ones() -> None:
    """``run.store`` names a ``verl.run_stores`` plugin; a typo fails when the config resolves (before any
    model loads, ``verl config check`` too), naming the key, the installed stores and the closest one."""
    from verl_core.config import resolve_config

    registry = PluginRegistry()
    assert resolve_config({"run": {"store": "local"}}, registry).run.store == "local"
    with pytest.raises(UnknownPluginError, match=r"^run.store: no run_store plugin named 'lcoal' is installed") as exc:
        resolve_config({"run": {"store": "lcoal"}}, registry)
    assert "local" in exc.value.installed and exc.value.suggestions == ["local"]


def test_a_name_that_left_the_kit_says_where_it_went() -> None:
    with pytest.raises(ImportError, match="to verl-run-store: from verl_run_store import CheckpointManager"):
        from verl_core.kit import CheckpointManager  # noqa: F401
