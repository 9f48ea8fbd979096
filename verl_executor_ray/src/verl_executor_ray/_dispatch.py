"""Cutting a call's arguments into per-rank shards and joining the ranks' results.

Pure functions over the core's types, so they are tested without Ray. A ``"split"`` call cuts its
first argument (a :class:`~verl_core.batch.Batch`, a tensor, or a list such as prompt token ids)
into one contiguous shard per data-parallel rank. When the length does not divide evenly, the end
is padded with copies of the last sample so that every rank runs the same number of forward and
backward passes (SPMD collectives would otherwise wait forever); padded batch rows carry a zero
``response_mask`` so they add nothing to masked losses, and padded outputs are cut off again
after the results are joined.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from verl_core.batch import Batch

__all__ = ["Shards", "split_call", "pad_and_shard", "gather_split"]


@dataclasses.dataclass
class Shards:
    """Per-rank ``(args, kwargs)`` of a split call, and the sizes needed to undo the padding."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
    real: int
    padded: int


def split_call(args: Sequence[Any], kwargs: dict[str, Any], parts: int, *, method: str) -> Shards:
    """Shard the first positional argument (or keyword ``batch``) of a ``"split"`` call over ``parts`` ranks."""
    if args:
        shards, real, padded = pad_and_shard(args[0], parts)
        calls = [((shard, *args[1:]), dict(kwargs)) for shard in shards]
    elif "batch" in kwargs:
        shards, real, padded = pad_and_shard(kwargs["batch"], parts)
        calls = [((), {**kwargs, "batch": shard}) for shard in shards]
    else:
        raise TypeError(f"{method} is dispatched with 'split' but was called without the batch to split "
                        f"(pass it as the first argument or as batch=...)")
    return Shards(calls, real, padded)


def pad_and_shard(value: Any, parts: int) -> tuple[list[Any], int, int]:
    """``parts`` equal contiguous shards of ``value`` (padded at the end); returns shards, real and padded length."""
    if parts < 1:
        raise ValueError(f"cannot shard over {parts} ranks")
    n = len(value)
    per = math.ceil(n / parts)
    padded = per * parts
    if isinstance(value, Batch):
        if padded != n:
            fill = value.select([n - 1] * (padded - n))
            fill = fill.replace(response_mask=torch.zeros_like(fill.response_mask))
            value = Batch.concat([value, fill])
        return [value.select(range(i * per, (i + 1) * per)) for i in range(parts)], n, padded
    if isinstance(value, torch.Tensor):
        if padded != n:
            value = torch.cat([value, value[-1:].expand(padded - n, *value.shape[1:])])
        return [value[i * per:(i + 1) * per] for i in range(parts)], n, padded
    if isinstance(value, (list, tuple)):
        items = list(value) + [value[-1]] * (padded - n)
        return [items[i * per:(i + 1) * per] for i in range(parts)], n, padded
    raise TypeError(f"cannot split a {type(value).__name__} across ranks; 'split' takes a Batch, a tensor or a "
                    f"list")


def gather_split(results: Sequence[Any], *, real: int, padded: int) -> Any:
    """Join the ranks' results of a split call in rank order and drop what the padding produced.

    Per-sample outputs (batches, tensors, lists, and dataclasses or dicts of them) are
    concatenated; an output with ``k`` entries per input sample keeps ``k * real`` of them.
    Plain numbers (metrics) are averaged over the ranks, as each rank reports the mean over its
    shard.
    """
    first = results[0]
    if first is None:
        return None
    if isinstance(first, Batch):
        return _trim(Batch.concat(list(results)), real, padded)
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(list(results)).float().mean()
        return _trim(torch.cat(list(results)), real, padded)
    if isinstance(first, (bool, int, float)):
        return sum(float(r) for r in results) / len(results)
    if isinstance(first, list):
        return _trim([x for r in results for x in r], real, padded)
    if isinstance(first, dict):
        return {k: gather_split([r[k] for r in results], real=real, padded=padded) for k in first}
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = {f.name: gather_split([getattr(r, f.name) for r in results], real=real, padded=padded)
                  for f in dataclasses.fields(first) if f.init}
        return dataclasses.replace(first, **fields)
    return list(results)


def _trim(value: Any, real: int, padded: int) -> Any:
    if padded == real or padded == 0:
        return value
    n = len(value)
    if n % padded:
        return value  # not per-sample: nothing to cut
    keep = n // padded * real
    if isinstance(value, Batch):
        return value.select(range(keep))
    return value[:keep]
