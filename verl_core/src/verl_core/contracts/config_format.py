"""Config file formats other than TOML (``verl run -c x.yaml``, ``verl config import``)."""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Sequence


__all__ = ["ConfigFormat"]


class ConfigFormat(abc.ABC):
    """A config file format other than verl's TOML, for ``verl run -c FILE`` and ``verl config import FILE``.

    Registered under ``verl.config_formats``; the CLI builds each installed one with no arguments and
    uses the first, by name, that ``reads`` the file (verl-config-import's ``verl-yaml``: verl's
    ``ppo_trainer.yaml`` and TRL's GRPOConfig/PPOConfig as YAML or JSON).
    """

    @abc.abstractmethod
    def reads(self, path: Path | None) -> bool:
        """Whether this format reads ``path``, judged by its name alone; None: dotted overrides, no file."""

    @abc.abstractmethod
    def read(self, path: Path | None, *, overrides: Sequence[str] = (),
             registry: Any) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """``path`` and the format's own dotted ``overrides`` as our raw config (``{section: {key: value}}``)
        and the lines that tell the user how each key got there. ``ConfigError`` for what it cannot read."""
