"""Generated samples as plain records: what the model said, to what, and what it was scored.

The trainer turns a validation pass and a few samples of each training step into one dict per sample
and hands them to the ``verl_samples`` hook; the ``jsonl`` logger writes them under ``<run_dir>/samples/``,
TensorBoard as text, wandb as a table, and ``verl dashboard`` shows them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from verl_core.batch import Batch

__all__ = ["SAMPLE_FIELDS", "sample_records", "batch_samples", "spread", "flat_group_fraction", "step_report"]

#: Every record's keys, in the order tables show them (``transcript`` only with an environment).
SAMPLE_FIELDS = ("step", "split", "index", "group", "data_source", "prompt", "response", "ground_truth", "reward",
                 "response_tokens", "finish_reason")


def spread(total: int, limit: int) -> list[int]:
    """``limit`` indices spread evenly over ``range(total)`` (all of them for ``limit < 0`` or ``>= total``)."""
    if limit < 0 or limit >= total:
        return list(range(total))
    if limit == 0:
        return []
    return [i * total // limit for i in range(limit)]


def _plain(value: Any) -> Any:
    """A JSON-friendly copy: tensors and numpy scalars become numbers or lists."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):
        try:
            return value.item()
        except (TypeError, ValueError):
            return str(value)
    return value


def sample_records(*, step: int, split: str, prompts: Sequence[str], responses: Sequence[str],
                   rewards: Sequence[float], meta: dict[str, Sequence[Any]], response_tokens: Sequence[int],
                   finish_reasons: Sequence[str], groups: Sequence[int] | None = None,
                   indices: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """One record per chosen sample (``indices``, default all); a ``transcript`` in ``meta`` comes along."""
    chosen = range(len(responses)) if indices is None else indices
    transcripts = meta.get("transcript")
    out = []
    for i in chosen:
        record = {
            "step": step, "split": split, "index": int(i), "group": int(groups[i]) if groups is not None else None,
            "data_source": _plain((meta.get("data_source") or [None] * len(responses))[i]),
            "prompt": prompts[i], "response": responses[i],
            "ground_truth": _plain((meta.get("ground_truth") or [None] * len(responses))[i]),
            "reward": float(rewards[i]), "response_tokens": int(response_tokens[i]),
            "finish_reason": finish_reasons[i] if i < len(finish_reasons) else None,
        }
        if transcripts is not None and transcripts[i] is not None:
            record["transcript"] = transcripts[i]  # the multi-turn messages, tool calls and tool outputs
        out.append(record)
    return out


def batch_samples(batch: Batch, tokenizer: Any, *, step: int, limit: int) -> list[dict[str, Any]]:
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


def flat_group_fraction(batch: Batch) -> float | None:
    """The share of the batch's groups whose samples all got the same reward (no learning signal for
    group-relative advantages); ``None`` without scores."""
    if batch.scores is None or not len(batch):
        return None
    flat = total = 0
    for g in torch.unique(batch.group_ids):
        scores = batch.scores[batch.group_ids == g]
        total += 1
        flat += int(bool((scores == scores[0]).all()))
    return flat / total


def step_report(t: Any, ctx: Any, *, epoch: float, seconds: float) -> dict[str, float]:
    """The metrics of the step trainer ``t`` just ran in ``ctx`` (the dataflow's, the algorithm's own, flat
    groups, throughput, memory), after handing ``run.train_samples`` of its samples to the hooks."""
    b, m = ctx.batch, dict(ctx.metrics)
    flat = flat_group_fraction(b)
    if flat is not None:
        m["reward/flat_group_frac"] = flat  # groups whose samples all scored the same (health check)
    if t.config.run.train_samples:
        t.hooks.hook.verl_samples(step=ctx.step, split="train", samples=batch_samples(
            b, t.tokenizer, step=ctx.step, limit=t.config.run.train_samples))
    m.update(t.algorithm.step_metrics(b, m))  # its KL figures, say
    tokens = int(b.prompt_mask.sum() + b.response_attention_mask.sum())
    m.update({"epoch": float(epoch), "timing/step": seconds,
              "throughput/samples_per_sec": len(ctx.prompts) * ctx.sampling.n / seconds,
              "throughput/tokens_per_sec": tokens / seconds})
    if "memory/actor_peak_gb" not in m:  # backends may report it with the update (one call fewer)
        m["memory/actor_peak_gb"] = float(t.actor.peak_memory_gb())
    return m
