"""Data readers: where a run's prompts come from (``data.reader``), and the rows they hand the core."""

from __future__ import annotations

import abc
from typing import Any


__all__ = ["DataError", "DataReader"]


class DataError(ValueError):
    """Data that cannot be used, with the file and the fix."""


class DataReader(abc.ABC):
    """Reads and renders a run's prompts: ``data.reader`` names one (verl-data's ``standard`` reads files,
    dataset directories, Hub ids and ``builtin:`` / generated datasets).

    Registered under ``verl.data_readers``; verl builds it with no arguments. It reads the ``data``
    section (:class:`~verl_core.config.DataConfig`). Each row it returns is a dict that the core checks
    once, where it enters (:func:`verl_core.boundary.check_prompt_rows`):

    * ``prompt_ids``: the prompt's token ids, a non-empty list of ints in the tokenizer's vocabulary
      (a :class:`~verl_core.contracts.PromptIds` carrying a prompt's images);
    * ``prompt_text``: the rendered prompt; ``prompt_messages``: its chat messages (a list, may be empty);
    * ``data_source``: a non-empty string (it picks the reward); ``ground_truth``: anything, for the reward;
    * ``extra_info`` and ``raw`` (the row's columns as read: preference pairs, images, ...): dicts.
    """

    @abc.abstractmethod
    def check(self, spec: str, key: str, registry: Any) -> None:
        """Raise :class:`DataError` naming ``key`` (``data.train`` / ``data.val``) and the fix when ``spec``
        cannot be read. Cheap: it runs before any model loads (``verl config check`` too)."""

    @abc.abstractmethod
    def load(self, config: Any, tokenizer: Any, *, model_path: str | None, registry: Any,
             format: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, float]]:
        """``(train_rows, val_rows, stats)`` for ``config`` (the ``data`` section), rendered with ``tokenizer``.

        ``format`` is the algorithm's :attr:`~verl_core.contracts.Requirements.data`, asked of the
        training set; ``model_path`` the policy's model directory (where a vision-language model's image
        processor is); ``stats`` the ``data/...`` numbers for the metrics. :class:`DataError` for data
        that cannot be used.
        """
