"""The ``[reward]`` section: which rewards score a response, with what weights, limits and isolation.

``reward.scorer`` picks the scorer plugin (``default``: :class:`~verl_rewards.manager.RewardManager`);
the rest of ``[reward]`` fills :class:`RewardConfig`, the default scorer's ``Config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from verl_core.config import ConfigError
from verl_core.contracts import ScorerConfig

__all__ = ["RewardConfig", "RewardComponent", "REWARD_MODEL_COMPONENT"]


@dataclass
class RewardComponent:
    """One term of a weighted reward (an entry of ``reward.components``).

    Attributes:
        name: a reward plugin, ``"auto"`` (by each row's data_source), ``"file:PATH:FUNCTION"``, or
            ``"reward_model"`` (the model at ``reward.model_path``).
        weight: the term's weight in the sum.
    """

    name: str = "auto"
    weight: float = 1.0


#: The component name that refers to the reward model at ``reward.model_path``.
REWARD_MODEL_COMPONENT = "reward_model"


@dataclass
class RewardConfig(ScorerConfig):
    """How responses are scored.

    Attributes:
        name: the reward when ``components`` is empty: a ``verl.rewards`` plugin for every sample,
            ``"auto"`` to pick one by each row's data_source, or ``"file:/path/rewards.py:function"``.
        components: several rewards summed per sample with weights, e.g.
            ``[{name = "gsm8k", weight = 1.0}, {name = "reward_model", weight = 0.5}]``; each is logged as
            ``reward/<name>/mean``.
        options: settings per reward, e.g. ``{gsm8k = {mode = "strict"}}`` (checked against its Config).
        aliases: extra data_source -> reward mappings for ``"auto"``, e.g. ``{"my/gsm8k-copy" = "gsm8k"}``.
        on_error: ``"fail"`` stops the run with the row and error; ``"zero"`` scores 0 and counts it in
            ``reward/errors``.
        on_invalid: (from :class:`~verl_core.contracts.ScorerConfig`) a NaN/inf reward that reaches the
            core, from an environment or a scorer: ``"stop"`` or ``"skip"`` the rows.
        timeout: seconds one reward call may take (per response, or per batch for a batch reward); 0: none.
        isolation: ``"process"`` runs rewards in worker processes that are killed at the time limit;
            ``"none"`` runs them in the controller (no start-up cost, but a hang cannot be interrupted).
        workers: reward worker processes with ``isolation="process"``.
        model_path: a Hugging Face sequence-classification reward model, scored on the training backend
            as the ``reward_model`` component.
    """

    name: str = "auto"
    components: list[RewardComponent] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    on_error: str = "fail"
    timeout: float = 60.0
    isolation: str = "process"
    workers: int = 1
    model_path: str = ""

    def validate(self) -> None:
        super().validate()
        if self.on_error not in ("fail", "zero"):
            raise ConfigError("on_error", "must be 'fail' or 'zero'")
        if self.isolation not in ("process", "none"):
            raise ConfigError("isolation", "must be 'process' or 'none'")
        if self.timeout < 0:
            raise ConfigError("timeout", "must be >= 0 seconds (0: no limit)")
        if self.workers < 1:
            raise ConfigError("workers", "must be at least 1 process")
        for key, value in self.options.items():
            if not isinstance(value, Mapping):
                raise ConfigError(f"options.{key}", f"must be a table of settings, e.g. options.{key} = {{ ... }}")
        for key, value in self.aliases.items():
            if not isinstance(value, str) or not value:
                raise ConfigError(f"aliases.{key}", "must name a reward plugin")
        names = [c.name for c in self.components]
        for i, c in enumerate(self.components):
            if not isinstance(c, RewardComponent):
                raise ConfigError(f"components[{i}]", "must be a table like { name = \"gsm8k\", weight = 1.0 }")
            if not c.name:
                raise ConfigError(f"components[{i}].name", "must name a reward")
            if c.weight != c.weight or c.weight in (float("inf"), float("-inf")):
                raise ConfigError(f"components[{i}].weight", "must be a finite number")
        if len(set(names)) != len(names):
            raise ConfigError("components", f"a reward is listed twice: {names}")
        if self.components and self.name != "auto":
            raise ConfigError("name", "set either reward.name or reward.components, not both (add "
                                      f"{{ name = \"{self.name}\" }} to reward.components)")
        if self.model_path and self.components and REWARD_MODEL_COMPONENT not in names:
            raise ConfigError("components", f"reward.model_path is set but no component is "
                                            f"{{ name = \"{REWARD_MODEL_COMPONENT}\" }}; add it with a weight")
        if self.model_path and not self.components and self.name != "auto":
            raise ConfigError("components", f"reward.model_path and reward.name={self.name!r} are both set: "
                                            f"combine them with reward.components = [{{ name = \"{self.name}\" }}, "
                                            f"{{ name = \"{REWARD_MODEL_COMPONENT}\", weight = 1.0 }}]")
        if not self.model_path and REWARD_MODEL_COMPONENT in names:
            raise ConfigError("model_path", f"the {REWARD_MODEL_COMPONENT!r} component needs reward.model_path "
                                            f"(a sequence-classification model directory)")

    def resolved_components(self) -> list[RewardComponent]:
        """The terms of the reward: ``components``, or else the reward model, or else ``name`` alone."""
        if self.components:
            return list(self.components)
        if self.model_path:
            return [RewardComponent(REWARD_MODEL_COMPONENT, 1.0)]
        return [RewardComponent(self.name, 1.0)]
