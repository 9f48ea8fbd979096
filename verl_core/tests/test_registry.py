"""Tests for verl_core.registry against real distribution metadata.

Each test writes throw-away ``*.dist-info`` directories (METADATA plus
entry_points.txt) and plugin modules into a temporary directory, so discovery
goes through the real ``importlib.metadata`` machinery without installing
anything.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from verl_core import registry as registry_module
from verl_core.registry import (
    DuplicatePluginError,
    IncompatiblePluginError,
    PluginError,
    PluginInfo,
    PluginLoadError,
    PluginRegistry,
    PluginWarning,
    UnknownPluginError,
)

CORE_VERSION = "0.1.0"
_counter = itertools.count()


def write_dist(
    root: Path,
    name: str,
    version: str = "1.0",
    *,
    entry_points: Mapping[str, Mapping[str, str]],
    api: str | None = "v3",
    requires: Sequence[str] = (),
) -> Path:
    """Write a minimal ``<name>-<version>.dist-info`` directory under ``root``.

    Args:
        root: Directory that acts as a site-packages / sys.path entry.
        name: Distribution name.
        version: Distribution version.
        entry_points: Group -> {entry-point name: value}.
        api: Name of the ``verl.plugin_api`` declaration, or None to omit it.
        requires: ``Requires-Dist`` lines.

    Returns:
        The dist-info directory.
    """
    groups = {group: dict(eps) for group, eps in entry_points.items()}
    if api is not None:
        groups.setdefault("verl.plugin_api", {})[api] = "unused"
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {line}" for line in requires]
    (info / "METADATA").write_text("\n".join(metadata) + "\n")
    text = "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
        for group, eps in groups.items()
    )
    (info / "entry_points.txt").write_text(text)
    return info


@pytest.fixture
def module(site: Path) -> Iterator[Callable[[str], str]]:
    """Factory writing a uniquely named module into ``site``; returns its name.

    Unique names keep tests independent of each other's ``sys.modules``.
    """
    created: list[str] = []

    def make(source: str) -> str:
        name = f"_verl_test_plugin_{next(_counter)}"
        (site / f"{name}.py").write_text(textwrap.dedent(source))
        created.append(name)
        return name

    yield make
    for name in created:
        sys.modules.pop(name, None)


def make_registry(*paths: Path) -> PluginRegistry:
    return PluginRegistry(paths=[str(p) for p in paths], core_version=CORE_VERSION)


# --------------------------------------------------------------------- listing


def test_list_reads_metadata_without_importing(site: Path, module) -> None:
    mod = module("raise RuntimeError('must not be imported while listing')\nclass R: pass\n")
    eps = {"verl.rollouts": {"fake": f"{mod}:R"}}
    write_dist(site, "verl-rollout-fake", "2.3", entry_points=eps)
    reg = make_registry(site)

    infos = reg.list()

    assert infos == [
        PluginInfo(
            kind="rollout",
            name="fake",
            value=f"{mod}:R",
            distribution="verl-rollout-fake",
            version="2.3",
            status="available",
            message="",
        )
    ]
    assert reg.names("rollout") == ["fake"]
    assert reg.info("rollout", "fake") == infos[0]
    assert mod not in sys.modules


def test_list_is_sorted_and_filters_by_kind(site: Path) -> None:
    write_dist(
        site,
        "verl-zoo",
        entry_points={
            "verl.rewards": {"b": "m:b", "a": "m:a"},
            "verl.algorithms": {"z": "m:z"},
            "some.other.group": {"ignored": "m:x"},
        },
    )
    reg = make_registry(site)

    assert [(i.kind, i.name) for i in reg.list()] == [
        ("algorithm", "z"),
        ("reward", "a"),
        ("reward", "b"),
    ]
    assert [i.name for i in reg.list("reward")] == ["a", "b"]
    assert reg.list("hook") == []


def test_distributions_can_be_injected(site: Path) -> None:
    write_dist(site, "verl-x", entry_points={"verl.hooks": {"h": "m:h"}})
    dists = importlib.metadata.distributions(path=[str(site)])
    reg = PluginRegistry(distributions=dists, core_version=CORE_VERSION)

    assert reg.names("hook") == ["h"]


def test_paths_and_distributions_are_exclusive(site: Path) -> None:
    with pytest.raises(ValueError):
        PluginRegistry(paths=[str(site)], distributions=[])


def test_unknown_kind_is_a_value_error(site: Path) -> None:
    reg = make_registry(site)
    with pytest.raises(ValueError, match="unknown plugin kind 'rollouts'"):
        reg.list("rollouts")
    with pytest.raises(ValueError):
        reg.load("rollouts", "hf")


def test_core_version_defaults_to_running_verl_core() -> None:
    try:
        expected = importlib.metadata.version("verl-core")
    except importlib.metadata.PackageNotFoundError:
        from verl_core._version import __version__ as expected

    assert PluginRegistry(paths=[]).core_version == expected


# --------------------------------------------------------------------- loading


def test_load_imports_once_and_caches(site: Path, module) -> None:
    mod = module("IMPORTS = []\nIMPORTS.append(1)\nclass Algo: pass\n")
    write_dist(site, "verl-algo-x", entry_points={"verl.algorithms": {"x": f"{mod}:Algo"}})
    reg = make_registry(site)

    first = reg.load("algorithm", "x")
    # Dropping the module proves the second call is served from the cache.
    sys.modules.pop(mod)
    second = reg.load("algorithm", "x")

    assert first is second
    assert first.__name__ == "Algo"
    assert first.__module__ == mod


def test_registries_do_not_share_state(site: Path, module) -> None:
    mod = module("class A: pass\n")
    write_dist(site, "verl-a", entry_points={"verl.algorithms": {"a": f"{mod}:A"}})
    first = make_registry(site)
    empty = make_registry(site.parent)  # no dist-info there

    assert first.names("algorithm") == ["a"]
    assert empty.names("algorithm") == []


# ------------------------------------------------------------------ duplicates


def test_same_name_from_two_distributions_is_a_duplicate(site: Path, module) -> None:
    mod = module("class A: pass\nclass B: pass\nclass C: pass\n")
    write_dist(site, "verl-one", entry_points={"verl.rollouts": {"fast": f"{mod}:A"}})
    write_dist(
        site,
        "verl-two",
        entry_points={"verl.rollouts": {"fast": f"{mod}:B", "other": f"{mod}:C"}},
    )
    reg = make_registry(site)

    fast = [i for i in reg.list("rollout") if i.name == "fast"]
    assert sorted(i.distribution for i in fast) == ["verl-one", "verl-two"]
    assert all(i.status == "duplicate" for i in fast)
    by_dist = {i.distribution: i.message for i in fast}
    assert "verl-two" in by_dist["verl-one"]
    assert "verl-one" in by_dist["verl-two"]
    assert reg.names("rollout") == ["other"]

    with pytest.raises(DuplicatePluginError) as excinfo:
        reg.load("rollout", "fast")
    assert "verl-one" in str(excinfo.value) and "verl-two" in str(excinfo.value)
    assert excinfo.value.distributions == ["verl-one", "verl-two"]
    # The conflict is confined to that name.
    assert reg.load("rollout", "other").__name__ == "C"


def test_same_distribution_twice_on_path_is_not_a_duplicate(
    tmp_path: Path, site: Path, module
) -> None:
    mod = module("class R: pass\n")
    eps = {"verl.rollouts": {"r": f"{mod}:R"}}
    editable = tmp_path / "editable"
    editable.mkdir()
    # Spelled differently: distribution names compare after normalization.
    write_dist(editable, "Verl_Rollout_R", "1.1.dev0", entry_points=eps)
    write_dist(site, "verl-rollout-r", "1.0", entry_points=eps)
    reg = make_registry(editable, site)

    [info] = reg.list()
    assert info.status == "available"
    assert info.version == "1.1.dev0"  # the first on the path wins, as for imports
    assert reg.load("rollout", "r").__name__ == "R"


def test_incompatible_copy_does_not_make_a_duplicate(site: Path, module) -> None:
    mod = module("class New: pass\n")
    write_dist(site, "verl-new", entry_points={"verl.rollouts": {"r": f"{mod}:New"}})
    write_dist(site, "verl-stale", entry_points={"verl.rollouts": {"r": "nowhere:Old"}}, api="v0")
    reg = make_registry(site)

    statuses = {i.distribution: i.status for i in reg.list()}
    assert statuses == {"verl-new": "available", "verl-stale": "incompatible"}
    assert reg.info("rollout", "r").distribution == "verl-new"
    assert reg.load("rollout", "r").__name__ == "New"


# ---------------------------------------------------------------- broken plugins


def test_load_all_skips_broken_plugin_and_loads_the_rest(site: Path, module) -> None:
    good = module("def score(x):\n    return 1.0\n")
    bad = module("raise RuntimeError('boom: missing CUDA')\n")
    write_dist(
        site,
        "verl-rewards-mixed",
        entry_points={"verl.rewards": {"good": f"{good}:score", "bad": f"{bad}:score"}},
    )
    reg = make_registry(site)

    with pytest.warns(PluginWarning, match="bad"):
        loaded = reg.load_all("reward")

    assert list(loaded) == ["good"]
    assert loaded["good"](None) == 1.0
    status = {i.name: i for i in reg.list("reward")}
    assert status["good"].status == "available"
    assert status["bad"].status == "broken"
    assert "RuntimeError: boom: missing CUDA" in status["bad"].message
    assert reg.names("reward") == ["good"]

    # Asking for it explicitly afterwards still reports the original cause.
    with pytest.raises(PluginLoadError) as excinfo:
        reg.load("reward", "bad")
    assert isinstance(excinfo.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    ("source", "attr", "cause"),
    [
        (
            "raise ImportError('no module named flash_attn')\n",
            "X",
            "ImportError: no module named flash_attn",
        ),
        ("class X: pass\n", "Missing", "AttributeError"),
    ],
)
def test_loading_broken_plugin_names_distribution_and_cause(
    site: Path, module, source: str, attr: str, cause: str
) -> None:
    mod = module(source)
    eps = {"verl.backends": {"bad": f"{mod}:{attr}"}}
    write_dist(site, "verl-backend-bad", "0.3", entry_points=eps)
    reg = make_registry(site)

    with pytest.raises(PluginLoadError) as excinfo:
        reg.load("backend", "bad")

    err = excinfo.value
    assert (err.kind, err.name, err.distribution) == ("backend", "bad", "verl-backend-bad")
    assert "verl-backend-bad" in str(err)
    assert cause in str(err)
    assert err.__cause__ is not None
    assert reg.info("backend", "bad").status == "broken"


# -------------------------------------------------------------- compatibility


def test_missing_api_declaration_is_refused_before_import(site: Path, module) -> None:
    mod = module("raise RuntimeError('must not be imported')\n")
    write_dist(site, "verl-undeclared", entry_points={"verl.loggers": {"l": f"{mod}:L"}}, api=None)
    reg = make_registry(site)

    info = reg.info("logger", "l")
    assert info.status == "incompatible"
    assert '[project.entry-points."verl.plugin_api"] v3 = "<their_module>"' in info.message
    assert reg.names("logger") == []
    with pytest.raises(IncompatiblePluginError) as excinfo:
        reg.load("logger", "l")
    assert excinfo.value.distribution == "verl-undeclared"
    assert mod not in sys.modules


@pytest.mark.parametrize(
    ("api", "advice"),
    # v1: written before Core v2's rollout stage; refused with the advice to upgrade the plugin. v2: before the
    # contracts moved (Core v3); the advice says what to rename.
    [("v4", "upgrade verl-core"), ("v1", "upgrade verl-other-api to a release targeting v3"),
     ("v2", "rename in its imports, verl_core.interfaces -> verl_core.contracts")],
)
def test_unsupported_api_version_is_refused_before_import(
    site: Path, module, api: str, advice: str
) -> None:
    mod = module("raise RuntimeError('must not be imported')\n")
    write_dist(site, "verl-other-api", entry_points={"verl.executors": {"e": f"{mod}:E"}}, api=api)
    reg = make_registry(site)

    info = reg.info("executor", "e")
    assert info.status == "incompatible"
    assert f"targets plugin API {api}" in info.message
    assert f"this verl-core (version {CORE_VERSION}) serves v3" in info.message
    assert advice in info.message
    with pytest.raises(IncompatiblePluginError, match=f"targets plugin API {api}"):
        reg.load("executor", "e")
    # Incompatible plugins are skipped quietly: they are not load failures.
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        assert reg.load_all("executor") == {}
    assert mod not in sys.modules


def test_supporting_several_api_versions_is_compatible(site: Path) -> None:
    info = write_dist(site, "verl-multi", entry_points={"verl.hooks": {"h": "m:h"}}, api="v3")
    with (info / "entry_points.txt").open("a") as f:
        f.write("[verl.plugin_api]\nv3 = unused\n")
    reg = make_registry(site)

    assert reg.info("hook", "h").status == "available"


@pytest.mark.parametrize(
    ("requirement", "status"),
    [
        ("verl-core>=0.2", "incompatible"),
        ("verl_core<0.1", "incompatible"),
        ("verl-core>=0.1,<0.2", "available"),
        ("verl-core", "available"),
        ("verl-core>=9; extra == 'dev'", "available"),
        ("verl-core>=9; python_version < '3'", "available"),
        ("torch>=99", "available"),
    ],
)
def test_requires_dist_on_verl_core_is_checked(
    site: Path, module, requirement: str, status: str
) -> None:
    mod = module("raise RuntimeError('must not be imported')\n")
    write_dist(
        site,
        "verl-env-x",
        entry_points={"verl.environments": {"x": f"{mod}:Env"}},
        requires=[requirement],
    )
    reg = make_registry(site)

    info = reg.info("environment", "x")
    assert info.status == status
    if status == "incompatible":
        assert "requires verl-core" in info.message
        assert f"verl-core {CORE_VERSION} is installed" in info.message
        with pytest.raises(IncompatiblePluginError):
            reg.load("environment", "x")
    assert mod not in sys.modules


# --------------------------------------------------------------- unknown names


def test_unknown_name_lists_installed_and_suggests_closest(site: Path) -> None:
    write_dist(
        site,
        "verl-core-like",
        entry_points={"verl.algorithms": {"grpo": "m:GRPO", "ppo": "m:PPO"}},
    )
    reg = make_registry(site)

    with pytest.raises(UnknownPluginError) as excinfo:
        reg.load("algorithm", "grop")

    err = excinfo.value
    assert isinstance(err, LookupError)
    assert err.installed == ["grpo", "ppo"]
    assert err.suggestions[0] == "grpo"
    assert err.install_hint is None
    message = str(err)
    assert "grpo, ppo" in message
    assert "Did you mean 'grpo'?" in message
    with pytest.raises(UnknownPluginError):
        reg.info("algorithm", "grop")


def test_missing_first_party_plugin_says_what_to_install(site: Path) -> None:
    write_dist(site, "verl-core-like", entry_points={"verl.rollouts": {"hf": "m:HF"}})
    reg = make_registry(site)

    with pytest.raises(UnknownPluginError) as excinfo:
        reg.load("rollout", "vllm")

    assert excinfo.value.install_hint == "pip install verl-rollout-vllm"
    assert "pip install verl-rollout-vllm" in str(excinfo.value)
    assert "Installed rollout plugins: hf." in str(excinfo.value)


def test_the_default_algorithm_missing_says_to_install_verl_algorithms(site: Path) -> None:
    # The core ships no algorithm: GRPO and PPO are verl-algorithms', and a core without it says so.
    with pytest.raises(UnknownPluginError) as excinfo:
        make_registry(site).load("algorithm", "grpo")
    assert excinfo.value.install_hint == "pip install verl-algorithms"
    assert "'grpo' is provided by a separate package: pip install verl-algorithms" in str(excinfo.value)


def test_misspelled_first_party_plugin_suggests_it_with_install_hint(site: Path) -> None:
    reg = make_registry(site)

    with pytest.raises(UnknownPluginError) as excinfo:
        reg.load("rollout", "vlm")

    message = str(excinfo.value)
    assert "No rollout plugins are installed." in message
    assert "Did you mean 'vllm'? (pip install verl-rollout-vllm)" in message


def test_unknown_algorithm_points_at_the_contrib_package_only_when_it_is_missing(site: Path) -> None:
    # The hint table names no contrib algorithm: a new one never edits the core.
    assert registry_module.KNOWN_DISTRIBUTIONS["verl-algo-contrib"] == {"algorithm": "*"}
    write_dist(site, "verl-core-like", entry_points={"verl.algorithms": {"grpo": "m:GRPO"}})
    with pytest.raises(UnknownPluginError) as excinfo:
        make_registry(site).load("algorithm", "dapo")
    assert excinfo.value.install_hint == "pip install verl-algo-contrib"
    assert "More algorithm plugins come with verl-algo-contrib" in str(excinfo.value)
    with pytest.raises(UnknownPluginError) as excinfo:  # close to a core name, still a contrib one
        make_registry(site).load("algorithm", "gspo")
    assert "Did you mean 'grpo'?" in str(excinfo.value) and "pip install verl-algo-contrib" in str(excinfo.value)

    write_dist(site, "verl-algo-contrib", entry_points={"verl.algorithms": {"rloo": "c:RLOO"}})
    with pytest.raises(UnknownPluginError) as excinfo:
        make_registry(site).load("algorithm", "dapo")
    assert excinfo.value.install_hint is None and "verl-algo-contrib" not in str(excinfo.value)


# ------------------------------------------------------------------ public API


def test_errors_share_a_base_class_and_are_exported() -> None:
    for cls in (UnknownPluginError, IncompatiblePluginError, DuplicatePluginError, PluginLoadError):
        assert issubclass(cls, PluginError)
        assert cls.__name__ in registry_module.__all__
    assert "PluginRegistry" in registry_module.__all__
    assert registry_module.PLUGIN_API_VERSION == 3
    assert registry_module.SUPPORTED_PLUGIN_API_VERSIONS == frozenset({3})
    assert registry_module.provider_of("rollout", "openai") == "verl-rollout-vllm"
