"""The ``standard`` data reader (``data.reader``, the default): :mod:`verl_data.rows` behind the core's
:class:`~verl_core.contracts.DataReader` contract."""

from __future__ import annotations

from typing import Any

from verl_core.contracts import DataReader
from verl_data.rows import build_datasets, check_data_source

__all__ = ["StandardReader"]


class StandardReader(DataReader):
    """Prompts from a parquet / jsonl / json file, a dataset directory, a Hub id, or a ``builtin:`` or
    ``<provider>:<argument>`` dataset, rendered with the tokenizer's chat template; rows with images by the
    model's image-text processor (:func:`verl_data.images.load_processor`)."""

    def check(self, spec: str, key: str, registry: Any) -> None:
        check_data_source(spec, key, registry)

    def load(self, config: Any, tokenizer: Any, *, model_path: str | None, registry: Any,
             format: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, float]]:
        from verl_data.images import load_processor
        from verl_kit.progress import Progress

        with Progress("data preparation", total=2, unit="splits") as bar:  # tokenizing can take a while
            train, val, stats = build_datasets(config, tokenizer, registry, format=format,
                                               processor=load_processor(model_path, tokenizer))
            bar.update(2, train_prompts=len(train), val_prompts=len(val))
        return train, val, stats
