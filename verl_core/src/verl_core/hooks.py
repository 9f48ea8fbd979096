"""Lifecycle hooks: what plugins can observe while a run goes.

Hooks carry events (run and step start/end, metrics, validation, checkpoints); they never change the
dataflow (a step's batch is theirs to read, and the metrics they measure on it join the step's). A plugin
may report events of its own through the relay ``verl_run_start`` hands it: verl-loggers' ``health`` and
``samples`` plugins do (``verl_health``, ``verl_samples``). Implementations come from the ``verl.loggers`` entry points chosen in ``run.loggers`` and from
every installed ``verl.hooks`` plugin (minus ``run.disable_hooks``). A hook plugin that fails to load is
reported and skipped; the run goes on without it.

Writing one::

    from verl_core.hooks import hookimpl

    class SlackNotifier:
        @hookimpl
        def verl_run_end(self, step, status, error):
            ...
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Sequence

import pluggy

from verl_core.registry import PluginError, PluginRegistry

__all__ = ["PROJECT", "hookspec", "hookimpl", "HookSpecs", "build_plugin_manager", "SAMPLE_FIELDS", "sample_records"]

PROJECT = "verl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
log = logging.getLogger(__name__)


class HookSpecs:
    """Every hook a plugin can implement. Arguments are passed by keyword."""

    @hookspec
    def verl_run_start(self, config: Any, run_dir: Path, start_step: int, max_steps: int, hooks: Any) -> None:
        """The run is set up and about to validate/train; ``start_step`` > 0 after a resume. ``hooks`` is the
        run's hook relay, for a plugin that reports events of its own (``hooks.verl_health(...)``)."""

    @hookspec
    def verl_step_start(self, step: int) -> None:
        """An RL step begins (``step`` counts from 1)."""

    @hookspec
    def verl_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """An RL step finished; ``metrics`` holds everything measured in it."""

    @hookspec
    def verl_step_batch(self, step: int, batch: Any, tokenizer: Any) -> dict[str, float] | None:
        """Step ``step`` trained on ``batch`` (a scored :class:`~verl_core.batch.Batch`: read it, never change
        it), before its metrics are emitted; the metrics a plugin returns join the step's."""

    @hookspec
    def verl_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Metrics are emitted (after each step and after each validation)."""

    @hookspec
    def verl_validation_start(self, step: int, samples: int) -> None:
        """A validation pass of ``samples`` generations begins at ``step``."""

    @hookspec
    def verl_validation_end(self, step: int, metrics: dict[str, float], samples: list[dict[str, Any]]) -> None:
        """A validation pass finished at ``step`` (0 = before training); ``samples`` holds every sample it
        generated, as :func:`sample_records` makes them."""

    @hookspec
    def verl_samples(self, step: int, split: str, samples: list[dict[str, Any]]) -> None:
        """Generated samples of ``split`` (``"val"``: a validation; ``"train"``: a few of a step), one dict
        per sample with the keys of :data:`SAMPLE_FIELDS` (plus ``transcript`` with an environment: the
        multi-turn messages, tool calls included)."""

    @hookspec
    def verl_health(self, step: int, check: str, message: str) -> None:
        """A health check failed at ``step`` (``check``: ``flat_rewards``, ``all_truncated``, ``kl``,
        ``no_validation``, ``weight_sync_gap``); ``message`` says what it means and what to do."""

    @hookspec
    def verl_checkpoint_saved(self, step: int, path: Path) -> None:
        """A complete checkpoint was written and made the latest."""

    @hookspec
    def verl_run_rewound(self, step: int, reason: str) -> None:
        """The run went back to its checkpoint of ``step`` (worker groups restarted after ``reason``);
        steps after it run again, so what was reported for them is void."""

    @hookspec
    def verl_run_end(self, step: int, status: str, error: BaseException | None) -> None:
        """The run stopped: ``status`` is ``"completed"``, ``"failed"`` or ``"interrupted"``."""


def build_plugin_manager(registry: PluginRegistry, *, loggers: Sequence[str],
                         disable_hooks: Sequence[str] = ()) -> pluggy.PluginManager:
    """A plugin manager with the chosen loggers and the installed hook plugins registered.

    Loggers were selected by the user, so one that cannot load is an error; hook plugins were merely
    installed, so a broken one only produces a warning.
    """
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(HookSpecs)
    for name in loggers:
        pm.register(_instantiate(registry.load("logger", name)), name=f"logger:{name}")
    for name in [n for n in registry.names("hook") if n not in disable_hooks]:
        try:
            plugin = _instantiate(registry.load("hook", name))
        except PluginError as exc:
            warnings.warn(f"hook plugin {name!r} skipped: {exc}", stacklevel=2)
            continue
        pm.register(plugin, name=f"hook:{name}")
    return pm


#: Every sample record's keys, in the order tables show them (``transcript`` only with an environment).
SAMPLE_FIELDS = ("step", "split", "index", "group", "data_source", "prompt", "response", "ground_truth", "reward",
                 "response_tokens", "finish_reason")


def _plain(value: Any) -> Any:
    """A JSON-friendly copy: tensors become numbers or lists, numpy scalars numbers (torch not imported here)."""
    if isinstance(value, (str, bytes)) or not callable(getattr(value, "item", None)):
        return value
    if type(value).__module__ == "torch":
        return value.tolist()
    try:
        return value.item()
    except (TypeError, ValueError):
        return str(value)


def sample_records(*, step: int, split: str, prompts: Sequence[str], responses: Sequence[str],
                   rewards: Sequence[float], meta: dict[str, Sequence[Any]], response_tokens: Sequence[int],
                   finish_reasons: Sequence[str], groups: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """One record per sample; a ``transcript`` in ``meta`` comes along."""
    transcripts = meta.get("transcript")
    out = []
    for i in range(len(responses)):
        record = {
            "step": step, "split": split, "index": int(i), "group": int(groups[i]) if groups is not None else None,
            "data_source": _plain((meta.get("data_source") or [None] * len(responses))[i]),
            "prompt": prompts[i], "response": responses[i],
            "ground_truth": _plain((meta.get("ground_truth") or [None] * len(responses))[i]),
            "reward": float(rewards[i]), "response_tokens": int(response_tokens[i]),
            "finish_reason": finish_reasons[i] if i < len(finish_reasons) else None,
        }
        if transcripts is not None and transcripts[i] is not None:
            record["transcript"] = transcripts[i]  # the multi-turn messages, tool calls and tool outputs
        out.append(record)
    return out


def _instantiate(obj: Any) -> Any:
    # An entry point may name a class (instantiated here) or a module/object with hookimpls.
    return obj() if isinstance(obj, type) else obj
