"""What the training backends share about cutting a step's batch: micro-batches and their loss weights.

FSDP and Megatron (and a backend of yours) import these rather than each writing its own:
:func:`rank_mini_batch` (a rank's share of ``algorithm.mini_batch_size``), :func:`token_groups`
(micro-batches packed to a token budget), :func:`trim_padding` (no compute on all-padding columns),
:func:`check_sequence_length` (a batch longer than the model's positions, refused by its settings) and
:func:`micro_batch_weights`: the weights that make the gradient of a mini-batch the same however it is
cut into micro-batches and ranks (``docs/loss-math.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from verl_core.batch import Batch
from verl_core.contracts import LossFn

__all__ = ["rank_mini_batch", "token_groups", "trim_padding", "check_sequence_length", "micro_batch_weights"]


def rank_mini_batch(mini_batch_size: int, rank_samples: int, dp_size: int) -> int:
    """Samples per optimizer step on one data-parallel rank. ``mini_batch_size`` counts samples over all
    ranks (as verl's ``ppo_mini_batch_size``; 0: the whole batch) and every rank holds an equal shard,
    so each steps on its share and all take the same number of optimizer steps."""
    if not mini_batch_size:
        return rank_samples
    if mini_batch_size % dp_size:
        raise ValueError(f"algorithm.mini_batch_size={mini_batch_size} is not a multiple of the {dp_size} "
                         f"data-parallel ranks; set it to a multiple, e.g. {dp_size * max(1, mini_batch_size // dp_size)}")
    return mini_batch_size // dp_size


def check_sequence_length(batch: Batch, max_positions: int | None) -> None:
    """Refuse a batch whose prompt plus response is longer than the model's positions, naming the settings."""
    total = batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    if max_positions and total > max_positions:
        raise ValueError(f"sequence length {total} (prompt {batch.prompt_ids.shape[1]} + response "
                         f"{batch.response_ids.shape[1]}) exceeds the model's max_position_embeddings="
                         f"{max_positions}; lower data.max_prompt_length or rollout.max_new_tokens")


def micro_batch_weights(loss_fn: LossFn, micro_batches: Sequence[Batch], *, dp_size: int = 1,
                        sum_over_ranks: Callable[[float], float] | None = None) -> list[float]:
    """The factor each micro-batch's loss (and its metrics) is multiplied by before its backward.

    A mini-batch cut into micro-batches, on each of ``dp_size`` data-parallel ranks whose gradients
    are averaged, must give the gradient of the loss over the whole mini-batch, however it was cut.
    Each micro-batch's loss is a mean over its ``loss_fn.units``, so it counts by its units over the
    units of the mini-batch on all ranks (``sum_over_ranks`` adds this rank's total to its peers'),
    times ``dp_size`` to undo the average over ranks. A token-mean loss is thus divided by the
    mini-batch's global token count, as verl does, not by each micro-batch's.
    """
    units_of = getattr(loss_fn, "units", None)
    units = [float(units_of(m)) if units_of is not None else float(len(m)) for m in micro_batches]
    total = sum(units) if sum_over_ranks is None else float(sum_over_ranks(sum(units)))
    return [u * dp_size / total if total > 0 else 0.0 for u in units]


def token_groups(batch: Batch, budget: int) -> list[list[int]]:
    """Consecutive sample indices packed into groups of at most ``budget`` real tokens (prompt +
    response; a longer sample is a group of its own): token-budget micro-batches."""
    lengths = (batch.prompt_mask.sum(-1) + batch.response_attention_mask.sum(-1)).tolist()
    groups: list[list[int]] = [[]]
    tokens = 0
    for i, n in enumerate(lengths):
        if groups[-1] and tokens + n > budget:
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += n
    return groups


def trim_padding(batch: Batch) -> Batch:
    """Drop prompt columns that are padding in every row and response columns past the longest response,
    so compute is not spent on padding. Right-pad results back to ``response_length`` of the original batch
    where a full-width output is needed."""
    prompt_cols = torch.nonzero(batch.prompt_mask.any(0)).flatten()
    start = int(prompt_cols[0]) if prompt_cols.numel() else batch.prompt_ids.shape[1] - 1
    resp_cols = torch.nonzero(batch.response_attention_mask.any(0)).flatten()
    width = int(resp_cols[-1]) + 1 if resp_cols.numel() else 1
    changes: dict[str, Any] = {}
    for name, t in batch.tensors().items():
        if t.dim() == 2:
            changes[name] = t[:, start:] if name.startswith("prompt") else t[:, :width]
    # 2-D extras are response-aligned, so they lose the same columns.
    changes["extras"] = {k: t[:, :width] if t.dim() == 2 else t for k, t in batch.extras.items()}
    return dataclasses.replace(batch, **changes)
