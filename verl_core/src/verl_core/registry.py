"""Plugin registry: how verl finds, checks and loads its plugins.

Everything pluggable in verl (training backends, rollout engines, algorithms, rewards, environments,
executors, loggers, hooks, models and datasets built by name, CLI commands, config file formats) is
provided through Python entry points, and verl-core registers its own built-ins the same way any third
party does. This module is the single place that reads those entry points.

It works in two stages on purpose:

* **Listing** (:meth:`PluginRegistry.list`, :meth:`~PluginRegistry.names`, :meth:`~PluginRegistry.info`)
  reads installed distribution metadata only. Nothing is imported, so ``verl plugins list`` stays fast
  and a plugin with a heavy or broken import (CUDA libraries, a missing optional dependency) can still
  be shown and diagnosed.
* **Loading** (:meth:`PluginRegistry.load`, :meth:`~PluginRegistry.load_all`) imports the entry point's
  object, after the metadata checks have passed.

A distribution that provides plugins declares the plugin-API version it targets in its
``pyproject.toml``::

    [project.entry-points."verl.plugin_api"]
    v3 = "my_package"

The entry point's *name* (``v3``) is the declaration; its value is ignored. A distribution without a
declaration, targeting a version this verl-core does not serve, or whose ``Requires-Dist`` on
``verl-core`` excludes the installed verl-core, is reported as ``incompatible`` and is never imported.

Example:
    >>> registry = PluginRegistry()
    >>> registry.names("algorithm")  # doctest: +SKIP
    ['grpo', 'ppo']
    >>> GRPO = registry.load("algorithm", "grpo")  # doctest: +SKIP

The registry holds no module-level state; create one where it is needed.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata as importlib_metadata
import logging
import re
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

__all__ = [
    "BUILTIN_PREFIX", "KNOWN_DISTRIBUTIONS", "provider_of", "KINDS", "PLUGIN_API_GROUP", "PLUGIN_API_VERSION",
    "SUPPORTED_PLUGIN_API_VERSIONS", "DuplicatePluginError", "IncompatiblePluginError", "PluginError",
    "PluginInfo", "PluginLoadError", "PluginRegistry", "PluginStatus", "PluginWarning", "UnknownPluginError",
    "close_names", "load_builtin",
]

logger = logging.getLogger(__name__)

#: Plugin kind -> entry-point group that provides plugins of that kind.
KINDS: dict[str, str] = {
    "backend": "verl.backends", "rollout": "verl.rollouts", "algorithm": "verl.algorithms", "reward": "verl.rewards",
    "environment": "verl.environments", "executor": "verl.executors", "logger": "verl.loggers", "hook": "verl.hooks",
    "model": "verl.models", "dataset": "verl.datasets", "command": "verl.commands",
    "config_section": "verl.config_sections", "scorer": "verl.scorers", "step_source": "verl.step_sources",
    "config_format": "verl.config_formats", "data_reader": "verl.data_readers", "run_store": "verl.run_stores",
}

#: Entry-point group in which a distribution declares the plugin API it targets.
PLUGIN_API_GROUP = "verl.plugin_api"

#: The plugin-API version this verl-core implements. v2: the rollout stage took generation out of the
#: algorithms; a v1 plugin would load and misbehave (its ``filter_batch`` is never called). v3: the
#: contracts moved from ``verl_core.interfaces`` to ``verl_core.contracts`` (one module per plugin kind),
#: the algorithms to verl-algorithms and the HF rollout to verl-rollout-hf; a v2 plugin fails to import.
PLUGIN_API_VERSION = 3

#: Plugin-API versions this verl-core can load plugins for.
SUPPORTED_PLUGIN_API_VERSIONS: frozenset[int] = frozenset({3})

#: What a plugin written for an older API renames to target this one.
_API_RENAMES = {2: "in its imports, verl_core.interfaces -> verl_core.contracts, verl_core.algorithms(.base, .grpo, "
                   ".ppo, .functional) -> verl_algorithms(...), verl_core.rollout_hf -> verl_rollout_hf, "
                   "verl_core.agent_loop -> verl_env_kit (environments subclass verl_env_kit.MultiTurnEnvironment), "
                   "kl_penalty, KL_ESTIMATORS and df.kl_in_reward(...) -> verl_algorithms (.functional, .base.kl_in_reward), "
                   "rank_mini_batch, check_sequence_length, micro_batch_weights and batch.token_groups(n), "
                   "batch.trim_padding() -> verl_kit.training (token_groups(batch, n), trim_padding(batch)); "
                   'then declare v3 = "<its_module>" under [project.entry-points."verl.plugin_api"]'}

#: Distributions the verl project ships apart from verl-core, and what they provide, for install
#: hints only (nothing here is ever loaded). A tuple names the plugins a distribution provides; ``"*"``
#: marks the distribution where further plugins of that kind live, so a new contrib algorithm never
#: edits this table: an unknown algorithm name, with verl-algo-contrib not installed, gets its hint.
KNOWN_DISTRIBUTIONS: dict[str, dict[str, tuple[str, ...] | str]] = {
    "verl-backend-fsdp": {"backend": ("fsdp",)},
    "verl-backend-megatron": {"backend": ("megatron",)},
    "verl-rollout-hf": {"rollout": ("hf",)},
    "verl-rollout-vllm": {"rollout": ("vllm", "openai")},
    "verl-rollout-sglang": {"rollout": ("sglang",)},
    "verl-executor-local": {"executor": ("local",)},
    "verl-executor-ray": {"executor": ("ray",)},
    "verl-executor-torchrun": {"executor": ("torchrun",)},
    "verl-env-tools": {"environment": ("tools",), "model": ("tiny-qwen2-tools", "tiny-qwen2-code"),
                       "dataset": ("tool-arithmetic", "code-sums"), "reward": ("tool_arithmetic", "code_tests")},
    "verl-env-openenv": {"environment": ("openenv",)},
    "verl-env-verifiers": {"environment": ("verifiers",), "dataset": ("verifiers",), "reward": ("verifiers",)},
    "verl-algorithms": {"algorithm": ("grpo", "ppo")},
    "verl-algo-contrib": {"algorithm": "*"},
    "verl-trainer-async": {"step_source": ("colocate_async", "separate_async", "auto")},
    "verl-task-arithmetic": {"model": ("tiny-qwen2-addition",), "dataset": ("addition",),
                             "reward": ("arithmetic",), "environment": ("arithmetic",)},
    "verl-reward-rules": {"reward": ("gsm8k", "math", "exact_match")},
    "verl-rewards": {"scorer": ("default",)},
    "verl-data-prepare": {"command": ("data",)},
    "verl-loggers": {"logger": ("console", "jsonl", "tensorboard", "wandb")},
    "verl-dashboard": {"command": ("dashboard", "report")},
    "verl-config-import": {"config_format": ("verl-yaml",)},
    "verl-data": {"data_reader": ("standard",)},
    "verl-run-store": {"run_store": ("local",)},
}


def provider_of(kind: str, name: str) -> str | None:
    """The first-party distribution that provides plugin ``name`` of ``kind``, if one is known."""
    for dist, kinds in KNOWN_DISTRIBUTIONS.items():
        names = kinds.get(kind, ())
        if names != "*" and name in names:
            return dist
    return None


def _home_of(kind: str) -> str | None:
    """The first-party distribution where further plugins of ``kind`` live (``"*"``), if any."""
    return next((dist for dist, kinds in KNOWN_DISTRIBUTIONS.items() if kinds.get(kind) == "*"), None)


PluginStatus = Literal["available", "incompatible", "broken", "duplicate"]

_API_DECLARATION = re.compile(r"^v(\d+)$")
_CORE_DISTRIBUTION = "verl-core"


# --------------------------------------------------------------------------- errors


class PluginError(Exception):
    """Base class of every error raised by the plugin registry.

    Attributes:
        kind: Plugin kind the error is about (e.g. ``"rollout"``).
        name: Plugin name the error is about.
    """

    def __init__(self, message: str, *, kind: str, name: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.name = name


class UnknownPluginError(PluginError, LookupError):
    """No installed plugin of the requested kind has the requested name.

    Attributes:
        installed: Names of all installed plugins of that kind.
        suggestions: Close matches to the requested name, best first.
        install_hint: ``pip install ...`` command when the name is a known first-party plugin whose
            distribution is not installed, else None.
    """

    def __init__(self, message: str, *, kind: str, name: str, installed: Sequence[str],
                 suggestions: Sequence[str], install_hint: str | None) -> None:
        super().__init__(message, kind=kind, name=name)
        self.installed = list(installed)
        self.suggestions = list(suggestions)
        self.install_hint = install_hint


class _DistributionError(PluginError):
    """A plugin error about one distribution.

    Attributes:
        distribution: Name of the distribution providing the plugin.
    """

    def __init__(self, message: str, *, kind: str, name: str, distribution: str) -> None:
        super().__init__(message, kind=kind, name=name)
        self.distribution = distribution


class IncompatiblePluginError(_DistributionError):
    """The plugin's distribution does not match this verl-core."""


class DuplicatePluginError(PluginError):
    """Several distributions provide a plugin of the same kind and name.

    Attributes:
        distributions: Names of all distributions providing it, sorted.
    """

    def __init__(self, message: str, *, kind: str, name: str, distributions: Sequence[str]) -> None:
        super().__init__(message, kind=kind, name=name)
        self.distributions = list(distributions)


class PluginLoadError(_DistributionError):
    """Importing the plugin's entry point failed; the cause is chained."""


class PluginWarning(UserWarning):
    """Warning emitted when :meth:`PluginRegistry.load_all` skips a plugin."""


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """What the registry knows about one plugin, from metadata alone.

    Attributes:
        kind: Plugin kind, a key of :data:`KINDS`.
        name: Entry-point name, i.e. the name users select the plugin by.
        value: Entry-point value, ``"module:attr"``.
        distribution: Name of the distribution that provides the plugin.
        version: Version of that distribution.
        status: ``"available"`` (can be loaded), ``"incompatible"`` (metadata does not match this
            verl-core), ``"duplicate"`` (another distribution provides the same kind and name) or
            ``"broken"`` (an earlier load of it failed).
        message: Why the status is not ``"available"``; ``""`` otherwise.
    """

    kind: str
    name: str
    value: str
    distribution: str
    version: str
    status: PluginStatus = "available"
    message: str = ""


class _DistMeta(NamedTuple):
    """The few metadata fields of one distribution the registry needs.

    Kept separate from ``importlib.metadata.Distribution`` so that every check works on plain data,
    whatever the metadata came from.
    """

    name: str
    version: str
    requires: tuple[str, ...]
    entry_points: tuple[importlib_metadata.EntryPoint, ...]


def _read_distribution(dist: importlib_metadata.Distribution) -> _DistMeta | None:
    """Extract the fields the registry needs, or None for unusable metadata."""
    # Half-uninstalled or corrupt dist-info directories exist in the wild; they must not stop
    # discovery of everything else.
    try:
        name = dist.metadata["Name"]
        if not name:
            return None
        return _DistMeta(name=name, version=dist.version or "", requires=tuple(dist.requires or ()),
                         entry_points=tuple(dist.entry_points))
    except Exception as exc:  # noqa: BLE001 - any metadata defect means "skip it"
        logger.warning("Ignoring distribution with unreadable metadata: %s", exc)
        return None


def _installed_core_version() -> str:
    """Version of the running verl-core, even when it is not installed."""
    try:
        return importlib_metadata.version(_CORE_DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError:
        # Running from a source checkout (PYTHONPATH=src) has no dist-info.
        from verl_core._version import __version__

        return __version__


def _api_problem(dist: _DistMeta, core_version: str) -> str | None:
    """Return why ``dist`` targets an unsupported plugin API, or None if it is fine."""
    matches = (_API_DECLARATION.match(ep.name) for ep in dist.entry_points if ep.group == PLUGIN_API_GROUP)
    declared = {int(match.group(1)) for match in matches if match}
    if not declared:
        return (f"{dist.name} {dist.version} does not declare the verl plugin API it targets; its author should add "
                f'to pyproject.toml: [project.entry-points."{PLUGIN_API_GROUP}"] '
                f'v{PLUGIN_API_VERSION} = "<their_module>"')
    if declared & SUPPORTED_PLUGIN_API_VERSIONS:
        return None
    targets = ", ".join(f"v{v}" for v in sorted(declared))
    serves = ", ".join(f"v{v}" for v in sorted(SUPPORTED_PLUGIN_API_VERSIONS))
    if min(declared) > max(SUPPORTED_PLUGIN_API_VERSIONS):
        advice = f"upgrade verl-core, or downgrade {dist.name} to a release targeting {serves}"
    else:
        advice = f"upgrade {dist.name} to a release targeting {serves}, or downgrade verl-core"
        if max(declared) in _API_RENAMES:
            advice += f"; to port it, rename {_API_RENAMES[max(declared)]}"
    return (f"{dist.name} {dist.version} targets plugin API {targets}; "
            f"this verl-core (version {core_version}) serves {serves}; {advice}")


def _core_requirement_problem(dist: _DistMeta, core_version: str) -> str | None:
    """Return why ``dist``'s Requires-Dist excludes this verl-core, or None."""
    try:
        installed = Version(core_version)
    except InvalidVersion:
        return None  # Cannot compare; refusing every plugin would be worse.
    for line in dist.requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue  # Bad metadata elsewhere is not ours to judge.
        if canonicalize_name(req.name) != _CORE_DISTRIBUTION:
            continue
        # Requirements behind an extra (`extra == "x"`) evaluate False with an empty extra, so only
        # unconditional requirements are enforced.
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            return (f"{dist.name} {dist.version} requires {_CORE_DISTRIBUTION}{req.specifier}, but verl-core "
                    f"{core_version} is installed; install a {dist.name} release compatible with verl-core "
                    f"{core_version}, or a verl-core matching {req.specifier}")
    return None


@dataclasses.dataclass(eq=False, slots=True)
class _Entry:
    """Mutable registry slot for one plugin: its info plus how to load it."""

    info: PluginInfo
    entry_point: importlib_metadata.EntryPoint
    failure: BaseException | None = None


# Lower sorts first: which entry `info()` reports when several share a name.
_STATUS_RANK = {"available": 0, "duplicate": 1, "broken": 2, "incompatible": 3}


# --------------------------------------------------------------------------- registry


class PluginRegistry:
    """Discovers, checks and loads verl plugins from entry points.

    Discovery is lazy: metadata is read on first use and then cached for the life of the registry.
    Loaded objects are cached too. Every method taking a ``kind`` raises ``ValueError`` for one that is
    not a key of :data:`KINDS`.

    Args:
        paths: Directories to search for distributions, like ``sys.path`` entries. Defaults to
            ``sys.path``.
        distributions: Distributions to use instead of searching ``paths``, e.g.
            ``importlib.metadata.distributions(path=[...])`` or custom ``importlib.metadata.Distribution``
            subclasses in tests. Mutually exclusive with ``paths``.
        core_version: verl-core version to check plugins against. Defaults to the running verl-core's
            version.
    """

    def __init__(self, paths: Sequence[str] | None = None, *,
                 distributions: Iterable[importlib_metadata.Distribution] | None = None,
                 core_version: str | None = None) -> None:
        if paths is not None and distributions is not None:
            raise ValueError("pass either `paths` or `distributions`, not both")
        self._paths = None if paths is None else [str(p) for p in paths]
        self._distributions = None if distributions is None else list(distributions)
        self._core_version = core_version
        self._entries: dict[tuple[str, str], list[_Entry]] | None = None
        self._loaded: dict[tuple[str, str], Any] = {}
        # Executors may load plugins from several threads; one import per plugin.
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ public

    @property
    def core_version(self) -> str:
        """The verl-core version plugins are checked against."""
        if self._core_version is None:
            self._core_version = _installed_core_version()
        return self._core_version

    def list(self, kind: str | None = None) -> list[PluginInfo]:
        """List plugins from metadata, without importing any of them.

        ``kind`` restricts the listing to one kind. Returns one :class:`PluginInfo` per (kind, name,
        distribution), sorted by kind, then name, then distribution.
        """
        if kind is not None:
            _check_kind(kind)
        infos = [entry.info for (entry_kind, _), slot in self._discover().items()
                 if kind is None or entry_kind == kind for entry in slot]
        return sorted(infos, key=lambda i: (i.kind, i.name, i.distribution.lower()))

    def names(self, kind: str) -> list[str]:
        """Return the sorted names of the available plugins of ``kind``."""
        return sorted({i.name for i in self.list(kind) if i.status == "available"})

    def info(self, kind: str, name: str) -> PluginInfo:
        """Return what is known about one plugin, without importing it.

        When several distributions provide the name, the entry reported is the usable one if any,
        otherwise the first by distribution name. Raises :class:`UnknownPluginError` if no plugin of
        that kind has that name.
        """
        return self._slot(kind, name)[0].info

    def load(self, kind: str, name: str) -> Any:
        """Import and return the object a plugin's entry point refers to.

        The result is cached: later calls return the same object.

        Raises:
            UnknownPluginError: If no plugin of that kind has that name.
            DuplicatePluginError: If several distributions provide it.
            IncompatiblePluginError: If its distribution does not match this verl-core; it is not imported.
            PluginLoadError: If importing it fails, now or earlier.
        """
        with self._lock:
            key = (kind, name)
            if key in self._loaded:
                return self._loaded[key]
            slot = self._slot(kind, name)
            entry = slot[0]
            info = entry.info
            if info.status == "duplicate":
                dists = sorted({e.info.distribution for e in slot if e.info.status == "duplicate"})
                raise DuplicatePluginError(f"{kind} plugin {name!r} is provided by several distributions: "
                                           f"{', '.join(dists)}; uninstall all but one of them",
                                           kind=kind, name=name, distributions=dists)
            if info.status == "incompatible":
                raise IncompatiblePluginError(f"{kind} plugin {name!r} from {info.distribution} {info.version} "
                                              f"cannot be used: {info.message}",
                                              kind=kind, name=name, distribution=info.distribution)
            if info.status == "broken":
                # Do not retry: a half-executed module import is rarely recoverable, and the caller
                # wants the original cause.
                raise self._load_error(entry) from entry.failure
            try:
                obj = entry.entry_point.load()
            except Exception as exc:
                entry.failure = exc
                message = f"import of {info.value} failed: {type(exc).__name__}: {exc}"
                entry.info = dataclasses.replace(info, status="broken", message=message)
                raise self._load_error(entry) from exc
            self._loaded[key] = obj
            return obj

    def load_all(self, kind: str) -> dict[str, Any]:
        """Load every available plugin of ``kind``, skipping ones that fail.

        A plugin that fails to import is reported with a :class:`PluginWarning` and marked ``"broken"``
        in later listings; it never prevents the others from loading. Incompatible and duplicate plugins
        are skipped and logged. Returns plugin name -> loaded object, for the plugins that loaded.
        """
        loaded: dict[str, Any] = {}
        for info in self.list(kind):
            if info.name in loaded:
                continue
            if info.status not in ("available", "broken"):
                logger.warning("Skipping %s plugin %r from %s: %s", kind, info.name, info.distribution, info.message)
                continue
            try:
                loaded[info.name] = self.load(kind, info.name)
            except PluginError as exc:
                warnings.warn(f"Skipping {kind} plugin {info.name!r}: {exc}", PluginWarning, stacklevel=2)
        return loaded

    # ----------------------------------------------------------------- private

    def _slot(self, kind: str, name: str) -> list[_Entry]:
        _check_kind(kind)
        slot = self._discover().get((kind, name))
        if not slot:
            raise self._unknown_error(kind, name)
        return sorted(slot, key=lambda e: (_STATUS_RANK[e.info.status], e.info.distribution))

    def _load_error(self, entry: _Entry) -> PluginLoadError:
        info = entry.info
        cause = entry.failure
        return PluginLoadError(f"failed to load {info.kind} plugin {info.name!r} ({info.value}) from distribution "
                               f"{info.distribution} {info.version}: {type(cause).__name__}: {cause}",
                               kind=info.kind, name=info.name, distribution=info.distribution)

    def _unknown_error(self, kind: str, name: str) -> UnknownPluginError:
        discovered = self._discover()
        installed = sorted({n for (k, n) in discovered if k == kind})
        named = {n for kinds in KNOWN_DISTRIBUTIONS.values() if kinds.get(kind, "*") != "*" for n in kinds[kind]}
        common = {n for (k, n), slot in discovered.items() if k == kind
                  and any(canonicalize_name(e.info.distribution) == _CORE_DISTRIBUTION for e in slot)}
        suggestions = close_names(name, sorted(set(installed) | named), common=common)
        parts = [f"no {kind} plugin named {name!r} is installed."]
        parts.append(f"Installed {kind} plugins: {', '.join(installed)}." if installed
                     else f"No {kind} plugins are installed.")
        install_hint = None
        provider = provider_of(kind, name)
        home = _home_of(kind)
        dists = {canonicalize_name(e.info.distribution) for slot in discovered.values() for e in slot}
        if provider:
            install_hint = f"pip install {provider}"
            parts.append(f"{name!r} is provided by a separate package: {install_hint}")
        else:
            if suggestions:
                best = suggestions[0]
                # The runner-up too when it is about as close (`gpro`: `grpo`, one swap, or `gspo`, two edits).
                near = [s for s in suggestions[1:2] if _edit_distance(name, s) <= _edit_distance(name, best) + 1]
                hint = f"Did you mean {best!r}" + "".join(f" (or {s!r})" for s in near) + "?"
                if best not in installed and provider_of(kind, best):
                    hint += f" (pip install {provider_of(kind, best)})"
                parts.append(hint)
            # Also after a suggestion: `gspo` looks like `grpo`, but lives in the contrib package.
            if home and canonicalize_name(home) not in dists:
                command = f"pip install {home}"
                install_hint = None if suggestions else command  # a likely typo is not an install problem
                parts.append(f"More {kind} plugins come with {home}, which is not installed: {command}")
        return UnknownPluginError(" ".join(parts), kind=kind, name=name, installed=installed,
                                  suggestions=suggestions, install_hint=install_hint)

    def _iter_distributions(self) -> Iterable[importlib_metadata.Distribution]:
        if self._distributions is not None:
            return self._distributions
        if self._paths is not None:
            return importlib_metadata.distributions(path=self._paths)
        return importlib_metadata.distributions()

    def _discover(self) -> dict[tuple[str, str], list[_Entry]]:
        with self._lock:
            if self._entries is None:
                self._entries = self._build_entries()
            return self._entries

    def _build_entries(self) -> dict[tuple[str, str], list[_Entry]]:
        group_to_kind = {group: kind for kind, group in KINDS.items()}
        core_version = self.core_version
        entries: dict[tuple[str, str], list[_Entry]] = {}
        seen: set[str] = set()
        for raw in self._iter_distributions():
            dist = _read_distribution(raw)
            if dist is None:
                continue
            # The same distribution can sit on the path twice (an editable install plus a
            # site-packages copy); the first one is what `import` would find, so it alone counts.
            canonical = canonicalize_name(dist.name)
            if canonical in seen:
                continue
            seen.add(canonical)
            plugin_eps = [ep for ep in dist.entry_points if ep.group in group_to_kind]
            if not plugin_eps:
                continue
            problem = _api_problem(dist, core_version) or _core_requirement_problem(dist, core_version)
            names_in_dist: set[tuple[str, str]] = set()
            for ep in plugin_eps:
                key = (group_to_kind[ep.group], ep.name)
                if key in names_in_dist:
                    continue  # A repeated line in one entry_points.txt is not a conflict.
                names_in_dist.add(key)
                info = PluginInfo(kind=key[0], name=ep.name, value=ep.value, distribution=dist.name,
                                  version=dist.version, status="incompatible" if problem else "available",
                                  message=problem or "")
                entries.setdefault(key, []).append(_Entry(info, ep))
        for slot in entries.values():
            _mark_duplicates(slot)
        return entries


def _edit_distance(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) from ``a`` to ``b``: ``gpro`` is one from
    ``grpo`` and one from ``gspo``, where difflib's ratio prefers ``gspo``."""
    rows = [list(range(len(b) + 1))]
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def close_names(word: str, options: Iterable[str], *, common: Iterable[str] = (), n: int = 3) -> list[str]:
    """Options ``word`` is likely a typo of, best first: fewest edits, then the ``common`` ones (the core's
    own plugins, a section's default), then difflib's similarity. At most a third of the word may differ."""
    common = set(common)
    limit = max(1, len(word) // 3)
    scored = []
    for option in set(options):
        distance = _edit_distance(word.lower(), option.lower())
        similar = difflib.SequenceMatcher(None, word, option).ratio()
        if distance <= limit or similar >= 0.6:
            scored.append((distance, option not in common, -similar, option))
    return [option for *_, option in sorted(scored)[:n]]


def _mark_duplicates(slot: list[_Entry]) -> None:
    """Flag usable entries that share a kind and name across distributions.

    Incompatible entries can never be loaded, so they do not make a name ambiguous: a stale plugin
    left installed must not block its replacement.
    """
    usable = [e for e in slot if e.info.status == "available"]
    if len(usable) < 2:
        return
    for entry in usable:
        info = entry.info
        others = ", ".join(sorted(e.info.distribution for e in usable if e is not entry))
        message = f"{info.kind} plugin {info.name!r} is also provided by {others}; uninstall all but one of them"
        entry.info = dataclasses.replace(info, status="duplicate", message=message)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; expected one of: {', '.join(KINDS)}")


#: Prefix of the model and dataset names that plugins build locally (``model.path = "builtin:<name>"``).
BUILTIN_PREFIX = "builtin:"


def load_builtin(registry: PluginRegistry, kind: Literal["model", "dataset"], spec: str, *, key: str) -> Any:
    """Build the ``model`` or ``dataset`` provider named by ``spec`` (``"builtin:<name>"``).

    ``spec`` is the configured name, ``builtin:`` included; ``key`` is the config key that named it, for
    the error message. Raises :class:`UnknownPluginError` when no such provider is installed; the message
    lists the installed ``builtin:`` names and the package that provides the requested one, when known.
    """
    name = spec[len(BUILTIN_PREFIX):]
    try:
        return registry.load(kind, name)()
    except UnknownPluginError as exc:
        installed = ", ".join(BUILTIN_PREFIX + n for n in exc.installed) or "none"
        if exc.install_hint:
            hint = f"; it is provided by a separate package: {exc.install_hint}"
        elif exc.suggestions:
            hint = f"; did you mean {BUILTIN_PREFIX + exc.suggestions[0]!r}?"
        else:
            hint = f"; built-in {kind}s come from packages with verl.{kind}s entry points"
        raise UnknownPluginError(f"{key}: no built-in {kind} {spec!r} is installed (installed: {installed}){hint}",
                                 kind=kind, name=name, installed=exc.installed, suggestions=exc.suggestions,
                                 install_hint=exc.install_hint) from None
