"""Reward functions: how they are named, found, configured and called.

This module is the part of the reward system that needs no torch, because it also runs inside the
reward worker processes (:mod:`verl_rewards.workers`), which should start in well under a second.

Naming a reward (``reward.name`` or a ``reward.components`` entry):

* an installed ``verl.rewards`` plugin: ``"gsm8k"``, ``"math"``, ``"exact_match"`` (``verl-reward-rules``),
  ``"arithmetic"`` (``verl-task-arithmetic``), or any third-party name;
* ``"auto"``: each row's ``data_source`` picks the plugin, through ``reward.aliases``, then a plugin of that
  name, then a plugin that lists it in its ``data_sources`` attribute (``"openai/gsm8k"`` -> ``"gsm8k"``);
* ``"file:/path/to/rewards.py:function"``: a function (or class) in a Python file, for quick experiments.

The shapes a reward may take, sync or ``async`` alike:

* a **per-sample** function: any parameter named ``response`` (or verl's ``solution_str``) marks it. It is
  called once per response with the keyword arguments it names among ``response``/``solution_str``,
  ``ground_truth``, ``data_source``, ``extra_info`` and ``prompt`` (all of them if it takes ``**kwargs``);
* a **batch** function: anything else. It is called with one :class:`RewardInput` for many responses and
  returns one score per response;
* a **class** with a ``Config`` dataclass: built as ``cls(config)`` from the ``reward.options.<name>`` table
  (validated like every other config section), and the instance is then one of the two shapes above.

A score is a number (``bool`` counts), or a dict with a ``"score"`` key as verl's reward functions return.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import functools
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

from verl_core.config import ConfigError, build_dataclass
from verl_core.contracts import RewardError, RewardInput

__all__ = [
    "RewardInput",
    "RewardSpecError",
    "RewardError",
    "LoadedReward",
    "per_sample",
    "batch_reward",
    "load_reward",
    "resolve_data_source",
    "call_sample",
    "as_score",
]

# Per-sample argument names and the RewardInput field each one reads.
_SAMPLE_ARGS = {
    "response": "responses",
    "solution_str": "responses",
    "ground_truth": "ground_truths",
    "data_source": "data_sources",
    "extra_info": "extra_infos",
    "prompt": "prompts",
}
# What a per-sample function taking **kwargs receives (one name per field).
_CANONICAL_ARGS = ("response", "ground_truth", "data_source", "extra_info", "prompt")


class RewardSpecError(ConfigError):
    """A reward that cannot be used as configured; ``path`` is the config key at fault."""


class per_sample:  # noqa: N801 - used as a decorator, named like one
    """Mark ``fn(response, ground_truth, ...) -> float`` as a per-sample reward.

    Functions with a ``response`` parameter are per-sample anyway; the decorator is for functions that
    name their first parameter differently (it is then passed the response) and for readability.
    Calling the wrapped object with a :class:`RewardInput` scores the whole batch, so it also satisfies
    :class:`~verl_core.contracts.RewardFunction`. It pickles by reference to ``fn``, so reward worker
    processes can receive it.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, inputs: RewardInput) -> list[float]:
        if inspect.iscoroutinefunction(self.fn):
            raise TypeError(f"{self.__name__} is async; score it through the RewardManager")
        return [as_score(call_sample(self.fn, inputs, i, positional=True)) for i in range(len(inputs))]

    def __reduce__(self) -> tuple[Any, ...]:
        return (per_sample, (self.fn,))


def batch_reward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn(inputs: RewardInput) -> list[float]`` as a batch reward (for names that look per-sample)."""
    fn.__verl_batch__ = True  # type: ignore[attr-defined]
    return fn


# ----------------------------------------------------------------------------- loading
@dataclass
class LoadedReward:
    """A reward ready to call, plus what a worker process needs to rebuild it.

    Attributes:
        label: the name shown in metrics and errors (``gsm8k``, ``my_fn`` for ``file:x.py:my_fn``).
        spec: the name it was configured with.
        fn: the callable (a function or an instance).
        per_sample: called once per response (else once per batch with a :class:`RewardInput`).
        is_async: calls return awaitables.
        positional_response: a :class:`per_sample`-wrapped function: the response goes first, positionally.
        target: the object or ``("file", path, attribute)`` a worker process rebuilds ``fn`` from.
        options: the validated ``reward.options`` entry the reward was built with.
    """

    label: str
    spec: str
    fn: Callable[..., Any]
    per_sample: bool
    is_async: bool
    positional_response: bool = False
    target: Any = None
    options: dict[str, Any] = field(default_factory=dict)


def load_reward(spec: str, *, registry: Any = None, options: Mapping[str, Any] | None = None,
                path: str = "reward.name") -> LoadedReward:
    """Find and build the reward named ``spec`` (see the module docstring for the forms).

    Args:
        spec: a plugin name or ``file:PATH:FUNCTION``.
        registry: the :class:`~verl_core.registry.PluginRegistry` to find plugins in.
        options: settings for a reward class's ``Config`` (the ``reward.options.<name>`` table).
        path: the config key that named the reward, for error messages.

    Raises:
        RewardSpecError: the file, function or options are wrong (plugin lookups raise the registry's errors).
    """
    options = dict(options or {})
    if spec.startswith("file:"):
        file, attr = _split_file_spec(spec, path)
        obj = _load_from_file(file, attr, path)
        target: Any = ("file", file, attr)
        label = attr
    else:
        if registry is None:
            from verl_core.registry import PluginRegistry

            registry = PluginRegistry()
        obj = registry.load("reward", spec)
        target = obj
        label = spec
    return _build(obj, label=label, spec=spec, target=target, options=options, path=path)


def rebuild_reward(target: Any, options: Mapping[str, Any], *, label: str, spec: str) -> LoadedReward:
    """Rebuild a reward from :attr:`LoadedReward.target` (inside a worker process)."""
    if isinstance(target, tuple) and len(target) == 3 and target[0] == "file":
        obj = _load_from_file(target[1], target[2], "reward.name")
    else:
        obj = target
    return _build(obj, label=label, spec=spec, target=target, options=dict(options), path="reward.name")


def _split_file_spec(spec: str, path: str) -> tuple[str, str]:
    body = spec[len("file:"):]
    file, sep, attr = body.rpartition(":")
    if not sep or not file or not attr.isidentifier():
        raise RewardSpecError(path, f"{spec!r} should look like 'file:/path/to/rewards.py:function_name'")
    resolved = Path(file).expanduser()
    if not resolved.is_file():
        raise RewardSpecError(path, f"reward file {file!r} does not exist")
    return str(resolved.resolve()), attr


@functools.lru_cache(maxsize=None)
def _load_module_from_file(file: str) -> Any:
    # A stable, unique module name per file, so pickling and tracebacks show something meaningful.
    name = "verl_reward_file_" + "".join(c if c.isalnum() else "_" for c in Path(file).stem) + f"_{abs(hash(file))}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise RewardSpecError("reward.name", f"cannot import {file!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise RewardSpecError("reward.name", f"importing {file} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _load_from_file(file: str, attr: str, path: str) -> Any:
    module = _load_module_from_file(file)
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardSpecError(path, f"{file} has no {attr!r}; callables there: {public}")
    return getattr(module, attr)


def _build(obj: Any, *, label: str, spec: str, target: Any, options: dict[str, Any], path: str) -> LoadedReward:
    if inspect.isclass(obj):
        config_cls = getattr(obj, "Config", None)
        if config_cls is not None and dataclasses.is_dataclass(config_cls):
            try:
                config = build_dataclass(config_cls, options, f"reward.options.{label}")
            except ConfigError as exc:
                raise RewardSpecError(exc.path, str(exc).split(": ", 1)[-1]) from None
            obj = obj(config)
        elif options:
            raise RewardSpecError(f"reward.options.{label}", f"reward {spec!r} takes no options")
        else:
            obj = obj()
    elif options:
        raise RewardSpecError(f"reward.options.{label}", f"reward {spec!r} is a function and takes no options; "
                                                          f"give it a Config dataclass to make it configurable")
    if not callable(obj):
        raise RewardSpecError(path, f"reward {spec!r} is a {type(obj).__name__}, not a callable")
    positional = isinstance(obj, per_sample)
    fn = obj.fn if positional else obj
    return LoadedReward(label=label, spec=spec, fn=fn, per_sample=positional or _looks_per_sample(fn),
                        is_async=_is_async(fn), positional_response=positional, target=target, options=options)


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _looks_per_sample(fn: Callable[..., Any]) -> bool:
    if getattr(fn, "__verl_batch__", False):
        return False
    sig = _signature(fn)
    return sig is not None and any(name in sig.parameters for name in ("response", "solution_str"))


def _is_async(fn: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)
    return not inspect.isfunction(fn) and call is not None and inspect.iscoroutinefunction(call)


# ----------------------------------------------------------------------------- routing
def resolve_data_source(data_source: str, *, registry: Any, aliases: Mapping[str, str] | None = None) -> str:
    """The reward plugin name that scores rows of ``data_source`` (for ``reward.name = "auto"``).

    ``aliases`` (``reward.aliases``) first, then a plugin of that name, then a plugin whose
    ``data_sources`` attribute lists it (case-insensitively; an entry may be a shell pattern such as
    ``"reasoning_gym/*"``, for sources named after their task). Only the last step imports plugins:
    every installed reward, a broken one skipped with a warning.

    Raises:
        RewardSpecError: no alias and no plugin matches; the message lists the plugins and the fixes.
    """
    user = dict(aliases or {})
    if data_source in user:
        return user[data_source]
    names = registry.names("reward")
    if data_source in names:
        return data_source
    for name, plugin in sorted(registry.load_all("reward").items()):
        if any(fnmatch.fnmatchcase(data_source.lower(), str(s).lower()) for s in getattr(plugin, "data_sources", ())):
            return name
    raise RewardSpecError(
        "reward.name", f"no reward for data_source {data_source!r} (reward.name='auto' picks one per row). "
                       f"Installed rewards: {sorted(names)}. Map it with reward.aliases = {{ \"{data_source}\" = "
                       f"\"<reward>\" }}, or score every row with one reward: reward.name = \"<reward>\"")


# ----------------------------------------------------------------------------- calling
def call_sample(fn: Callable[..., Any], inputs: RewardInput, i: int, *, positional: bool = False) -> Any:
    """Call a per-sample reward on row ``i`` of ``inputs`` with the arguments it names.

    With ``positional`` (a :class:`per_sample`-wrapped function) the first two positional parameters get
    the response and the ground truth whatever their names, as ``fn(response, ground_truth)``.
    """
    values = {
        "response": inputs.responses[i],
        "ground_truth": inputs.ground_truths[i],
        "data_source": inputs.data_sources[i],
        "extra_info": inputs.extra_infos[i] if inputs.extra_infos else {},
        "prompt": inputs.prompts[i],
    }
    values["solution_str"] = values["response"]
    sig = _signature(fn)
    if sig is None:  # builtins and C callables: the classic two-argument form
        return fn(values["response"], values["ground_truth"])
    params = list(sig.parameters.values())
    args: list[Any] = []
    if positional:
        plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for value in (values["response"], values["ground_truth"]):
            if params and params[0].kind in plain and (not args or params[0].name not in values):
                args.append(value)
                params = params[1:]
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    kwargs = {p.name: values[p.name] for p in params if p.kind in named and p.name in values}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        taken = {"response", "ground_truth"}.intersection(["response", "ground_truth"][:len(args)])
        for key in _CANONICAL_ARGS:
            if key not in taken and key not in kwargs and not (key == "response" and "solution_str" in kwargs):
                kwargs[key] = values[key]
    return fn(*args, **kwargs)


def as_score(value: Any) -> float:
    """One reward value as a float: numbers, bools, or a dict with a ``"score"`` key.

    Raises:
        TypeError: not a number; ValueError: NaN or infinite.
    """
    if isinstance(value, Mapping):
        if "score" not in value:
            raise TypeError(f"returned a dict without a 'score' key: {sorted(value)}")
        value = value["score"]
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        value = value.item()  # numpy / torch scalars
    if not isinstance(value, (int, float)):
        raise TypeError(f"returned {type(value).__name__} {value!r}; a reward must be a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"returned {out}; a reward must be finite")
    return out


async def gather_with_timeout(awaitables: Sequence[Awaitable[Any]], timeout: float | None) -> list[Any]:
    """Await all concurrently; each result is the value or the exception it raised (``TimeoutError`` too)."""

    async def one(aw: Awaitable[Any]) -> Any:
        try:
            return await asyncio.wait_for(aw, timeout) if timeout else await aw
        except asyncio.TimeoutError:
            return TimeoutError(f"exceeded reward.timeout={timeout:g}s")
        except Exception as exc:  # noqa: BLE001 - reported per row by the caller
            return exc

    return list(await asyncio.gather(*(one(a) for a in awaitables)))
