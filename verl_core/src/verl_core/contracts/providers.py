"""Models and datasets built by name (``builtin:<name>``)."""

from __future__ import annotations

import abc
from typing import Any, ClassVar


__all__ = ["ModelProvider", "DatasetProvider"]


class ModelProvider(abc.ABC):
    """A model verl can build locally by name: ``model.path = "builtin:<name>"``.

    Registered under ``verl.models`` with the name after ``builtin:``; verl builds it with no
    arguments. ``preset`` holds the settings the model was tuned with, by config section
    (``{"backend": {"lr": 1e-4}}``); they are layered under the user's config, whose settings win,
    as a Hugging Face model ships its generation config.
    """

    preset: ClassVar[dict[str, dict[str, Any]]] = {}

    @abc.abstractmethod
    def model_dir(self) -> str:
        """The local Hugging Face model directory, built and cached on first use."""


class DatasetProvider(abc.ABC):
    """A dataset verl can build locally by name: ``data.train`` / ``data.val = "builtin:<name>"``.

    Registered under ``verl.datasets`` with the name after ``builtin:``; verl builds it with no
    arguments. With ``data.train`` a ``builtin:`` dataset and no ``data.val``, validation reads
    its ``data.val_split`` split.

    ``formats`` lists the row formats (:attr:`Requirements.data`) the provider can build. Training
    asks for the algorithm's format, and validation for ``"prompts"``; ``rows`` is passed
    ``format=`` only when it is not ``"prompts"``, so a provider of prompts alone needs no such argument.

    A provider that generates its rows from an argument says what it takes in ``argument`` (e.g.
    ``"a reasoning-gym task"``) and serves ``data.train = "<name>:<argument>"`` (``reasoning_gym:chain_sum``):
    verl builds it with :meth:`from_spec` instead, and reads its ``train`` and ``test`` splits.
    """

    splits: ClassVar[tuple[str, ...]] = ("train",)
    formats: ClassVar[tuple[str, ...]] = ("prompts",)
    argument: ClassVar[str] = ""

    @classmethod
    def from_spec(cls, argument: str, *, size: int, val_size: int) -> DatasetProvider:
        """The provider of ``<name>:<argument>``, making ``size`` training and ``val_size`` test rows
        (``data.size`` / ``data.val_size``; 0: its own default), the same rows each time.

        Checks the argument without making rows (``verl config check`` calls it), raising ``ValueError``
        with the fix for a bad one.
        """
        raise NotImplementedError(f"{cls.__qualname__} takes no argument (its argument attribute is empty)")

    @abc.abstractmethod
    def rows(self, *, split: str) -> list[dict[str, Any]]:
        """The rows of ``split`` in the verl row format (``format=...``: with that format's columns too);
        ``ValueError`` for a split it lacks."""
