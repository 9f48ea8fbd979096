"""Validation: every validation prompt generated with the validation sampling and scored, as the run's
loop asks for it (``run.val_every``, the first and the last step); its metrics and its samples go to the
hooks (verl-loggers' ``samples`` plugin hands ``run.val_samples`` of them to ``verl_samples``)."""

from __future__ import annotations

import time
from typing import Any

import torch

from verl_core.boundary import check_scores, finite_rows
from verl_core.contracts import ENV_REWARDS
from verl_core.hooks import sample_records
from verl_core.rollout_stage import generate

__all__ = ["validate"]


def validate(t: Any) -> dict[str, float]:
    """Generate for every validation prompt of trainer ``t`` with the validation sampling, score it, and
    report the metrics and the samples to the hooks."""
    rc = t.config.rollout.config
    sampling = rc.sampling(seed=t.config.run.seed, validation=True)
    rows = t.val_rows
    chunk = t.config.data.val_batch_size or len(rows)
    texts: list[str] = []
    meta: dict[str, list[Any]] = {"ground_truth": [], "data_source": [], "extra_info": [], "prompt_text": [],
                                  "prompt_messages": []}
    t.hooks.hook.verl_validation_start(step=t.step, samples=len(rows) * sampling.n)
    start = time.perf_counter()
    env_rewards = []
    shown: dict[str, list[Any]] = {"tokens": [], "finish": [], "transcript": []}  # for the samples
    for s in range(0, len(rows), chunk):
        part = rows[s:s + chunk]
        batch = generate(t.step_context(t.step, part), part, sampling)  # as the step's rollout stage does
        if t.make_environment is not None:  # whole trajectories, tools and all
            env_rewards.append(batch.extras[ENV_REWARDS].sum(-1))
        mask = batch.response_attention_mask.bool()
        texts += t.tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(batch.response_ids, mask)],
                                          skip_special_tokens=True)
        shown["tokens"] += mask.sum(-1).tolist()
        shown["finish"] += batch.finish_reasons
        shown["transcript"] += batch.meta.get("transcript", [])
        for k in meta:
            meta[k] += [r.get(k) for r in part for _ in range(sampling.n)]
    scores, reward_metrics = t.reward.score_texts(texts, meta)
    scores = check_scores(scores, len(texts), source=t.boundary.scorer, step=t.step)
    parts = [(t.boundary.scorer, scores)]
    if env_rewards:
        parts.append((t.boundary.environment, torch.cat(env_rewards)))
        scores = scores + parts[-1][1]
    # A non-finite reward stops here as in training; skipped rows leave the mean, not the count.
    keep = finite_rows(scores, parts=parts, on_invalid=t.boundary.on_invalid, step=t.step)
    mean = float(scores.mean() if keep is None else scores[keep].mean())
    metrics = {"val/reward_mean": mean, "val/samples": float(len(texts)),
               "timing/validation": time.perf_counter() - start}
    metrics.update({f"val/{k.split('/', 1)[1]}": v for k, v in reward_metrics.items() if k.endswith("/mean")})
    metrics["val/reward_errors"] = reward_metrics.get("reward/errors", 0.0)
    samples = _records(t, texts, meta, scores, shown)
    t.hooks.hook.verl_validation_end(step=t.step, metrics=metrics, samples=samples)
    t.hooks.hook.verl_metrics(step=t.step, metrics=metrics)
    return metrics


def _records(t: Any, texts: list[str], meta: dict[str, list[Any]], scores: torch.Tensor,
             shown: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every sample of the validation as a record (:func:`~verl_core.hooks.sample_records`); a prompt is
    decoded once for its ``n`` samples."""
    if shown["transcript"]:
        meta = {**meta, "transcript": shown["transcript"]}
    per_row = len(texts) // max(1, len(t.val_rows))
    prompts = t.tokenizer.batch_decode([r["prompt_ids"] for r in t.val_rows], skip_special_tokens=True)
    return sample_records(step=t.step, split="val", prompts=[prompts[i // per_row] for i in range(len(texts))],
                          responses=texts, rewards=scores.tolist(), meta=meta, response_tokens=shown["tokens"],
                          finish_reasons=shown["finish"], groups=[i // per_row for i in range(len(texts))])
