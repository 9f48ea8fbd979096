"""The typed batch that flows between the nodes of an RL step.

One :class:`Batch` holds every sample of a step: the prompt and response tokens, the masks, and the fields
each dataflow node adds (rewards, log-probs, values, advantages, ...). Tensors are indexed by sample on their
first dimension, so a batch can be split into micro-batches, shards for data-parallel ranks, or filtered,
without knowing which fields are present.

The two tensor helpers the core's own nodes need are here too: :func:`masked_mean` and
:func:`scores_to_token_rewards` (the rollout stage's token rewards). The algorithms' loss math
(``verl_algorithms.functional``) re-exports them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

import torch

__all__ = ["Batch", "TENSOR_FIELDS", "masked_mean", "scores_to_token_rewards"]

# Fields that hold per-sample tensors (first dimension = sample). Everything else is metadata.
TENSOR_FIELDS = (
    "prompt_ids", "prompt_mask", "response_ids", "response_attention_mask", "response_mask", "group_ids", "scores",
    "token_rewards", "old_log_probs", "rollout_log_probs", "ref_log_probs", "values", "advantages", "returns",
)


@dataclass
class Batch:
    """All samples of one RL step.

    Prompts are left-padded and responses right-padded, so ``cat([prompt_ids, response_ids])`` is a contiguous
    sequence per row whose response starts at the same column for every row.

    Attributes:
        prompt_ids: ``[B, P]`` prompt token ids, left-padded.
        prompt_mask: ``[B, P]`` 1 for real prompt tokens.
        response_ids: ``[B, R]`` response token ids, right-padded.
        response_attention_mask: ``[B, R]`` 1 for every real response token (tool outputs too).
        response_mask: ``[B, R]`` 1 for response tokens that take part in losses. Padding and tokens the
            policy did not produce (tool outputs) are 0.
        group_ids: ``[B]`` samples drawn from the same prompt share a group id.
        scores: ``[B]`` sequence-level reward from the reward functions.
        token_rewards: ``[B, R]`` reward per token (score at the last token, KL penalty, ...).
        old_log_probs: ``[B, R]`` log-probs of the policy that produced the batch (training engine).
        rollout_log_probs: ``[B, R]`` log-probs reported by the rollout engine, if any.
        ref_log_probs: ``[B, R]`` log-probs under the reference policy.
        values: ``[B, R]`` critic values.
        advantages: ``[B, R]`` advantage per token.
        returns: ``[B, R]`` value targets per token.
        finish_reasons: why each response ended (``"stop"`` or ``"length"``).
        meta: per-sample metadata lists (``ground_truth``, ``data_source``, ``extra_info``, ...).
        info: batch-level values the nodes hand to each other (not split).
        extras: per-sample tensors a plugin adds beyond the fields above (a greedy baseline's score, a
            preference label, ...), keyed by name. The first dimension is the sample, so they are selected,
            split and concatenated with the batch; a 2-D extra is aligned with the response tokens
            (``[B, R]``) and right-padded with 0 when widths differ. Dataflow nodes write one with the field
            name ``"extras.<name>"``.
        multi_modal_inputs: each sample's processor tensors for the model's forward (``pixel_values``,
            ``image_grid_thw``; ``{}`` for a text-only sample), or empty when no sample has any. A list, not a
            tensor: samples have different numbers of image patches. It is selected, split, concatenated and
            moved with the samples; the ``n`` samples of one prompt share their prompt's tensors.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_attention_mask: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor
    scores: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    finish_reasons: list[str] = field(default_factory=list)
    meta: dict[str, list[Any]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    multi_modal_inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.multi_modal_inputs and len(self.multi_modal_inputs) != len(self):
            raise ValueError(f"multi_modal_inputs holds {len(self.multi_modal_inputs)} entries for {len(self)} "
                             f"samples; give one per sample ({{}} for a text-only one)")

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])

    # ----------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        """Integer tensors travel in the narrowest exact form (masks as bool, ids as int32).

        Batches cross process boundaries on every executor call; int64 masks and ids make up most of their
        bytes, and below a size threshold Ray sends arguments inline instead of through its object store.
        :meth:`__setstate__` restores the original dtypes, so a round trip is exact.
        """
        state = dict(self.__dict__)
        for name in TENSOR_FIELDS:
            if state.get(name) is not None:
                state[name] = _Narrowed.of(state[name])
        state["extras"] = {k: _Narrowed.of(v) for k, v in self.extras.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = _restored(state)
        state["extras"] = _restored(state.get("extras", {}))
        self.__dict__.update(state)

    # ----------------------------------------------------------------- views
    @property
    def input_ids(self) -> torch.Tensor:
        """``[B, P+R]`` prompt and response ids side by side."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """``[B, P+R]`` 1 for every real token (prompt or response, tool tokens included)."""
        return torch.cat([self.prompt_mask, self.response_attention_mask.to(self.prompt_mask.dtype)], dim=1)

    @property
    def response_length(self) -> int:
        return int(self.response_ids.shape[1])

    # ------------------------------------------------------------ transforms
    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-sample tensor fields that are set."""
        return {n: getattr(self, n) for n in TENSOR_FIELDS if getattr(self, n) is not None}

    def replace(self, **changes: Any) -> "Batch":
        """A copy with some fields replaced (tensors are shared, not copied)."""
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> "Batch":
        """A copy whose tensors (extras included) are on ``device``; metadata is shared."""
        device = torch.device(device)
        changes: dict[str, Any] = {n: t.to(device) for n, t in self.tensors().items()}
        changes["extras"] = {k: t.to(device) for k, t in self.extras.items()}
        changes["multi_modal_inputs"] = [{k: t.to(device) for k, t in m.items()} for m in self.multi_modal_inputs]
        return self.replace(**changes)

    def select(self, index: Sequence[int] | torch.Tensor) -> "Batch":
        """The samples at ``index``, in that order."""
        idx = torch.as_tensor(index, dtype=torch.long)
        changes: dict[str, Any] = {n: t.index_select(0, idx) for n, t in self.tensors().items()}
        ids = idx.tolist()
        changes["finish_reasons"] = [self.finish_reasons[i] for i in ids] if self.finish_reasons else []
        changes["meta"] = {k: [v[i] for i in ids] for k, v in self.meta.items()}
        changes["info"] = dict(self.info)
        changes["extras"] = {k: t.index_select(0, idx) for k, t in self.extras.items()}
        changes["multi_modal_inputs"] = [self.multi_modal_inputs[i] for i in ids] if self.multi_modal_inputs else []
        return dataclasses.replace(self, **changes)

    def split(self, size: int) -> Iterator["Batch"]:
        """Consecutive chunks of at most ``size`` samples."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        for start in range(0, len(self), size):
            yield self.select(range(start, min(start + size, len(self))))

    def chunk(self, parts: int) -> list["Batch"]:
        """``parts`` near-equal consecutive chunks."""
        n = len(self)
        bounds = [n * i // parts for i in range(parts + 1)]
        return [self.select(range(bounds[i], bounds[i + 1])) for i in range(parts)]

    @classmethod
    def concat(cls, batches: Sequence["Batch"]) -> "Batch":
        """Join batches sample-wise; response/prompt widths are padded to the widest."""
        if not batches:
            raise ValueError("cannot concatenate zero batches")
        if len(batches) == 1:
            return batches[0]
        pad_id = batches[0].info.get("pad_token_id", 0)
        p_width = max(b.prompt_ids.shape[1] for b in batches)
        r_width = max(b.response_ids.shape[1] for b in batches)
        out: dict[str, Any] = {}
        for name in TENSOR_FIELDS:
            values = [getattr(b, name) for b in batches]
            if all(v is None for v in values):
                continue
            if any(v is None for v in values):
                raise ValueError(f"cannot concatenate batches where only some have {name!r}")
            if values[0].dim() == 2:
                width = p_width if name.startswith("prompt") else r_width
                left = name.startswith("prompt")
                fill = pad_id if name in ("prompt_ids", "response_ids") else 0
                values = [_pad_to(v, width, fill, left=left) for v in values]
            out[name] = torch.cat(values, dim=0)
        out["finish_reasons"] = [r for b in batches for r in b.finish_reasons]
        keys = batches[0].meta.keys()
        out["meta"] = {k: [x for b in batches for x in b.meta.get(k, [None] * len(b))] for k in keys}
        out["info"] = dict(batches[0].info)
        out["extras"] = {}
        for name in batches[0].extras:
            values = [b.extras.get(name) for b in batches]
            if any(v is None for v in values):
                raise ValueError(f"cannot concatenate batches where only some have extras[{name!r}]")
            if values[0].dim() == 2:
                values = [_pad_to(v, r_width, 0, left=False) for v in values]
            out["extras"][name] = torch.cat(values, dim=0)
        missing = {k for b in batches[1:] for k in b.extras} - set(batches[0].extras)
        if missing:
            raise ValueError(f"cannot concatenate batches where only some have extras {sorted(missing)}")
        if any(b.multi_modal_inputs for b in batches):  # a text-only batch joins with {} per sample
            out["multi_modal_inputs"] = [m for b in batches for m in (b.multi_modal_inputs or [{}] * len(b))]
        return cls(**out)


# --------------------------------------------------------------------------- tensor helpers

def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over entries where ``mask`` is 1 (0 when the mask is empty, never NaN)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's score on its last valid response token."""
    token_rewards = torch.zeros_like(response_mask, dtype=torch.float32)
    lengths = response_mask.long().sum(-1)
    rows = torch.nonzero(lengths > 0).flatten()
    if rows.numel():
        # Last index where the mask is 1 (tool tokens can sit in between).
        positions = torch.arange(response_mask.shape[1]).expand_as(response_mask)
        last = torch.where(response_mask > 0, positions, torch.full_like(positions, -1)).max(-1).values
        token_rewards[rows, last[rows]] = scores[rows].float()
    return token_rewards


def _pad_to(t: torch.Tensor, width: int, fill: float, *, left: bool) -> torch.Tensor:
    missing = width - t.shape[1]
    if missing == 0:
        return t
    pad = torch.full((t.shape[0], missing), fill, dtype=t.dtype)
    return torch.cat([pad, t], dim=1) if left else torch.cat([t, pad], dim=1)


def _restored(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v.restore() if isinstance(v, _Narrowed) else v for k, v in values.items()}


class _Narrowed(NamedTuple):
    """An integer tensor stored in a narrower dtype for pickling, with the dtype to restore."""

    tensor: torch.Tensor
    dtype: torch.dtype

    @staticmethod
    def of(tensor: torch.Tensor) -> Any:
        if tensor.dtype not in (torch.int64, torch.int32) or tensor.numel() == 0 or tensor.device.type != "cpu":
            return tensor
        lo, hi = int(tensor.min()), int(tensor.max())
        if lo >= 0 and hi <= 1:
            return _Narrowed(tensor.bool(), tensor.dtype)
        if tensor.dtype == torch.int64 and -(2**31) <= lo and hi < 2**31:
            return _Narrowed(tensor.int(), tensor.dtype)
        return tensor

    def restore(self) -> torch.Tensor:
        return self.tensor.to(self.dtype)

