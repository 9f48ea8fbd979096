"""The ``samples`` hook plugin (``verl.hooks``, on whenever verl-loggers is installed; ``run.disable_hooks =
["samples"]`` leaves it out): what the model said, to what, and what it was scored.

It hands ``run.val_samples`` of each validation's samples and ``run.train_samples`` of each training step's
(decoded from its batch) to the ``verl_samples`` hook, spread evenly over them; the ``jsonl`` logger writes
them under ``<run_dir>/samples/``, TensorBoard as text, wandb as a table, and ``verl dashboard`` shows them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from verl_core.kit import hookimpl, sample_records

__all__ = ["SampleReporter", "spread", "batch_samples"]


def spread(total: int, limit: int) -> list[int]:
    """``limit`` indices spread evenly over ``range(total)`` (all of them for ``limit < 0`` or ``>= total``)."""
    if limit < 0 or limit >= total:
        return list(range(total))
    if limit == 0:
        return []
    return [i * total // limit for i in range(limit)]


def batch_samples(batch: Any, tokenizer: Any, *, step: int, limit: int) -> list[dict[str, Any]]:
    """``limit`` samples of a training step's batch, spread over its groups, decoded."""
    indices = spread(len(batch), limit)
    if not indices or batch.scores is None:
        return []
    rows = torch.tensor(indices)
    prompt_ids, prompt_mask = batch.prompt_ids[rows], batch.prompt_mask[rows].bool()
    response_ids, response_mask = batch.response_ids[rows], batch.response_attention_mask[rows].bool()
    prompts = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(prompt_ids, prompt_mask)],
                                     skip_special_tokens=True)
    responses = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(response_ids, response_mask)],
                                       skip_special_tokens=True)
    meta = {k: [v[i] for i in indices] for k, v in batch.meta.items() if isinstance(v, list) and len(v) == len(batch)}
    finish = [batch.finish_reasons[i] for i in indices] if batch.finish_reasons else []
    records = sample_records(step=step, split="train", prompts=prompts, responses=responses,
                             rewards=batch.scores[rows].tolist(), meta=meta,
                             response_tokens=response_mask.sum(-1).tolist(), finish_reasons=finish,
                             groups=batch.group_ids[rows].tolist())
    for record, i in zip(records, indices):
        record["index"] = i
    return records


class SampleReporter:
    """Picks the samples a run reports (``run.val_samples``, ``run.train_samples``) and hands them on."""

    def __init__(self) -> None:
        self._hooks: Any = None
        self.val_samples = self.train_samples = 0

    @hookimpl
    def verl_run_start(self, config: Any, run_dir: Path, hooks: Any) -> None:
        self._hooks = hooks
        self.val_samples, self.train_samples = config.run.val_samples, config.run.train_samples

    @hookimpl
    def verl_step_batch(self, step: int, batch: Any, tokenizer: Any) -> None:
        if self._hooks is not None and self.train_samples:
            self._hooks.verl_samples(step=step, split="train",
                                     samples=batch_samples(batch, tokenizer, step=step, limit=self.train_samples))

    @hookimpl(tryfirst=True)  # the samples are out before the sinks close the validation
    def verl_validation_end(self, step: int, samples: list[dict[str, Any]]) -> None:
        chosen = [samples[i] for i in spread(len(samples), self.val_samples)]
        if self._hooks is not None and chosen:
            self._hooks.verl_samples(step=step, split="val", samples=chosen)
