"""Cutting a call's arguments into per-rank shards and joining the ranks' results.

What the ``"split"`` dispatch mode (:func:`verl_core.interfaces.dispatch`) does in every
multi-process executor (Ray, torchrun), as pure functions over the core's types. A ``"split"``
call cuts its first argument (a :class:`~verl_core.batch.Batch`, a tensor, or a list such as
prompt token ids) into one contiguous shard per data-parallel rank. When the length does not divide evenly, the end
is padded with copies of the last sample so that every rank runs the same number of forward and
backward passes (SPMD collectives would otherwise wait forever); padded batch rows carry a zero
``response_mask`` so they add nothing to masked losses, and padded outputs are cut off again
after the results are joined.

A batch is not cut into contiguous runs but balanced: every rank gets the same number of samples
with token totals (prompt + response) as even as a greedy longest-first assignment makes them,
so the ranks of one collective finish their forward and backward passes at about the same time.
The results are put back into the caller's order when they are joined.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from verl_core.batch import Batch

__all__ = ["Shards", "balance_batch", "split_call", "pad_and_shard", "gather_split"]


@dataclasses.dataclass
class Shards:
    """Per-rank ``(args, kwargs)`` of a split call, and the sizes needed to undo the padding."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
    real: int
    padded: int
    order: list[int] | None = None


def split_call(args: Sequence[Any], kwargs: dict[str, Any], parts: int, *, method: str, balance: bool = True) -> Shards:
    """Shard the first positional argument (or keyword ``batch``) of a ``"split"`` call over ``parts`` ranks.

    A :class:`Batch` is balanced by tokens over the ranks (:func:`balance_batch`) unless ``balance``
    is false; other values are cut into contiguous slices.
    """
    if args:
        value = args[0]
    elif "batch" in kwargs:
        value = kwargs["batch"]
    else:
        raise TypeError(f"{method} is dispatched with 'split' but was called without the batch to split "
                        f"(pass it as the first argument or as batch=...)")
    order = None
    if isinstance(value, Batch) and balance:
        shards, real, padded, order = balance_batch(value, parts)
    else:
        shards, real, padded = pad_and_shard(value, parts)
    if args:
        calls = [((shard, *args[1:]), dict(kwargs)) for shard in shards]
    else:
        calls = [((), {**kwargs, "batch": shard}) for shard in shards]
    return Shards(calls, real, padded, order)


def balance_batch(batch: Batch, parts: int) -> tuple[list[Batch], int, int, list[int]]:
    """``parts`` shards of equal size and near-equal token count; also returns the order they hold.

    ``order`` lists, shard after shard, the (padded) batch index of every sample: what
    :func:`gather_split` needs to put joined results back in the caller's order.
    """
    if parts < 1:
        raise ValueError(f"cannot shard over {parts} ranks")
    n = len(batch)
    per = math.ceil(n / parts)
    padded = per * parts
    if padded != n:
        batch = _pad_batch(batch, padded)
    tokens = (batch.prompt_mask.sum(-1) + batch.response_attention_mask.sum(-1)).tolist()
    groups: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    # Longest first, each to the lightest rank that still has room (stable: ties keep batch order).
    for i in sorted(range(padded), key=lambda i: -tokens[i]):
        rank = min((r for r in range(parts) if len(groups[r]) < per), key=lambda r: sums[r])
        groups[rank].append(i)
        sums[rank] += tokens[i]
    groups = [sorted(g) for g in groups]
    return [batch.select(g) for g in groups], n, padded, [i for g in groups for i in g]


def _pad_batch(batch: Batch, size: int) -> Batch:
    n = len(batch)
    fill = batch.select([n - 1] * (size - n))
    fill = fill.replace(response_mask=torch.zeros_like(fill.response_mask))
    return Batch.concat([batch, fill])


def pad_and_shard(value: Any, parts: int) -> tuple[list[Any], int, int]:
    """``parts`` equal contiguous shards of ``value`` (padded at the end); returns shards, real and padded length."""
    if parts < 1:
        raise ValueError(f"cannot shard over {parts} ranks")
    n = len(value)
    per = math.ceil(n / parts)
    padded = per * parts
    if isinstance(value, Batch):
        if padded != n:
            value = _pad_batch(value, padded)
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


def gather_split(results: Sequence[Any], *, real: int, padded: int, order: Sequence[int] | None = None) -> Any:
    """Join the ranks' results of a split call in rank order and drop what the padding produced.

    With ``order`` (from :func:`balance_batch`), per-sample outputs are put back in the order of
    the batch that was split.

    Per-sample outputs (batches, tensors, lists, and dataclasses or dicts of them) are
    concatenated; an output with ``k`` entries per input sample keeps ``k * real`` of them.
    Plain numbers (metrics) are averaged over the ranks, as each rank reports the mean over its
    shard.
    """
    first = results[0]
    if first is None:
        return None
    if isinstance(first, Batch):
        return _trim(Batch.concat(list(results)), real, padded, order)
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(list(results)).float().mean()
        return _trim(torch.cat(list(results)), real, padded, order)
    if isinstance(first, (bool, int, float)):
        return sum(float(r) for r in results) / len(results)
    if isinstance(first, list):
        return _trim([x for r in results for x in r], real, padded, order)
    if isinstance(first, dict):
        return {k: gather_split([r[k] for r in results], real=real, padded=padded, order=order) for k in first}
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = {f.name: gather_split([getattr(r, f.name) for r in results], real=real, padded=padded, order=order)
                  for f in dataclasses.fields(first) if f.init}
        return dataclasses.replace(first, **fields)
    return list(results)


def _trim(value: Any, real: int, padded: int, order: Sequence[int] | None = None) -> Any:
    if padded == 0 or (padded == real and order is None):
        return value
    n = len(value)
    if n % padded:
        return value  # not per-sample: nothing to cut
    k = n // padded  # entries per input sample
    if order is None:
        keep = list(range(k * real))
    else:
        position = {sample: slot for slot, sample in enumerate(order)}
        keep = [k * position[sample] + e for sample in range(real) for e in range(k)]
    if isinstance(value, Batch):
        return value.select(keep)
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(keep, dtype=torch.long)]
    return [value[i] for i in keep]
