"""Cutting a call's arguments into per-rank shards and joining the ranks' results.

What the ``"split"`` dispatch mode (:func:`verl_core.contracts.dispatch`) does in every
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

With model parallelism (:class:`~verl_core.contracts.WorldInfo` mesh fields) a split call is cut
into one shard per *data-parallel group*; every rank of a group gets its group's shard, and
:class:`Mesh` says which rank's result stands for each group.

The training backends also take from here what they share with an engine generating on their
module (the Hugging Face rollout): joining the process group (:func:`ensure_process_group`) and the
``autocast`` settings (``backend.autocast``, ``rollout.autocast``): one set of accepted values, one
error, one context (:func:`check_autocast`, :func:`autocast`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any, Sequence

import torch

from verl_core.batch import Batch

__all__ = ["Mesh", "Shards", "balance_batch", "split_call", "pad_and_shard", "gather_split", "ensure_process_group",
           "AUTOCAST_CHOICES", "check_autocast", "autocast"]


@dataclasses.dataclass
class Shards:
    """Per-rank ``(args, kwargs)`` of a split call, and the sizes needed to undo the padding."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
    real: int
    padded: int
    order: list[int] | None = None


@dataclasses.dataclass(frozen=True)
class Mesh:
    """How a worker group's ranks map onto data-parallel groups.

    Attributes:
        dp_size: data-parallel groups: the shards a ``"split"`` call is cut into.
        shard_of: per rank, the shard (data-parallel group) it is given.
        readers: per data-parallel group in order, the rank whose result is read.
    """

    dp_size: int
    shard_of: tuple[int, ...]
    readers: tuple[int, ...]

    @classmethod
    def of(cls, worlds: Sequence[Any]) -> "Mesh":
        """From the ranks' :class:`~verl_core.contracts.WorldInfo` in rank order (pure data parallel
        when they name no mesh)."""
        dp_size = worlds[0].dp_size
        readers: list[list[int]] = [[] for _ in range(dp_size)]
        for rank, world in enumerate(worlds):
            if world.dp_size != dp_size or not 0 <= world.dp_rank < dp_size:
                raise ValueError(f"rank {rank} places itself in data-parallel group {world.dp_rank} of "
                                 f"{world.dp_size}, rank 0 in one of {dp_size}: the workers disagree on the mesh")
            if world.is_output_rank:
                readers[world.dp_rank].append(rank)
        bad = [d for d, r in enumerate(readers) if len(r) != 1]
        if bad:
            raise ValueError(f"data-parallel group {bad[0]} has {len(readers[bad[0]])} output ranks; each group "
                             f"needs exactly one (tensor rank 0 of its last pipeline stage)")
        return cls(dp_size, tuple(w.dp_rank for w in worlds), tuple(r[0] for r in readers))

    @property
    def is_data_parallel(self) -> bool:
        """Every rank is its own data-parallel group (no model parallelism)."""
        return self.shard_of == tuple(range(len(self.shard_of)))

    def per_rank(self, shards: "Shards") -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """Each rank's ``(args, kwargs)``: its data-parallel group's shard."""
        return [shards.calls[d] for d in self.shard_of]

    def read(self, results: Sequence[Any]) -> list[Any]:
        """The per-group results, in group order, out of all ranks' results."""
        return [results[r] for r in self.readers]


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
    """``parts`` shards of equal size and near-equal token count (image patches count as tokens);
    also returns the order they hold.

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
    if batch.multi_modal_inputs:  # the vision tower's work too: each image patch it encodes
        tokens = [t + sum(int(v.shape[0]) for k, v in m.items() if k.startswith("pixel_values"))
                  for t, m in zip(tokens, batch.multi_modal_inputs)]
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


def ensure_process_group(world: Any) -> None:
    """Join (or start) the ``torch.distributed`` group a backend's worker at ``world`` (a
    :class:`~verl_core.contracts.WorldInfo`) trains in: NCCL on CUDA, gloo otherwise.

    An executor that started the processes has exported the ``env://`` rendezvous; a one-rank group
    without one needs none (an in-memory store). A group already initialised with another size is
    an error, not silently reused.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != world.world_size:
            raise RuntimeError(f"torch.distributed is initialised with world size {dist.get_world_size()}, "
                               f"but this worker group has {world.world_size} ranks")
        return
    backend = "nccl" if world.device.startswith("cuda") else "gloo"
    if world.world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, rank=world.rank, world_size=world.world_size)


#: What an ``autocast`` setting accepts: off, or the lower-precision dtype the forwards run in.
AUTOCAST_CHOICES = ("off", "bfloat16", "float16")


def check_autocast(value: str) -> None:
    """Raise ``ValueError`` naming the field when ``value`` is not an ``autocast`` choice."""
    if value not in AUTOCAST_CHOICES:
        raise ValueError(f"autocast: must be 'off', 'bfloat16' or 'float16', not {value!r}")


def autocast(device_type: str, value: str) -> contextlib.AbstractContextManager:
    """The forwards' lower-precision region for ``value`` (a null context when ``"off"``). Backward runs
    outside it, as autocast wants: each op's backward in the dtype its forward ran in."""
    if value == "off":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, value))
