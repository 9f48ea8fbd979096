"""The rollout stage: one place that turns the step's prompts into a scored batch, for every algorithm.

:func:`run` is the body of the dataflow's ``rollout`` node. In order:

1. **generate**: the rollout engine samples ``rollout.n`` responses per prompt (token ids in and
   out; nothing is re-tokenised);
2. **reward**: the run's :class:`~verl_core.contracts.RewardScorer` (``reward.scorer``) scores every
   response; the score sits on its last token;
3. **filter**: the algorithm's :attr:`~verl_core.contracts.RolloutRequest.filter` keeps the groups
   worth training on; while fewer groups than the step's prompts survive, more prompts are drawn and
   generated (at most ``max_extra_rounds`` times: DAPO's dynamic sampling, arXiv:2503.14476);
4. **greedy baseline**: on request, one greedy response per prompt is scored and its reward kept in
   ``batch.extras["baseline_scores"]`` (ReMax, arXiv:2310.10505);
5. **release**: an engine that can free its memory (``supports_memory_release``) does so until the
   trainer's closing weight sync wakes it.

Algorithms never re-implement these steps; they ask for options through the request. With an
environment (``[environment]``), step 1 is the environment class's episode runner
(:meth:`~verl_core.contracts.Environment.run_episodes`, the multi-turn loop of verl-env-kit): the
batch then holds whole trajectories with tool output masked out, and the environment's per-turn
rewards are added to the reward stage's scores (on the turns' last tokens).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from verl_core.batch import Batch, scores_to_token_rewards
from verl_core.boundary import check_response_budget, check_scores, finite_rows
from verl_core.contracts import ENV_REWARDS, PromptIds, RolloutRequest
from verl_core.rollout_utils import check_log_prob_gap, generate_batch

if TYPE_CHECKING:
    from verl_core.step_context import StepContext

__all__ = ["run", "produce", "generate", "BASELINE", "ENGINE_CHECK_SAMPLES"]

#: ``batch.extras`` key of the greedy baseline's scores.
BASELINE = "baseline_scores"
#: Samples the stage checks the engine's log-probs on, whatever the algorithm does with the batch later.
ENGINE_CHECK_SAMPLES = 4


def run(ctx: "StepContext", request: RolloutRequest) -> Batch:
    """The step's scored batch (generate, score, filter and resample, greedy baseline).

    An engine with its own copy of the weights is checked against the trainer on a few samples
    (one small forward pass), so the weight-sync guard holds for every algorithm: those that never
    recompute old log-probs (GPG, ``use_rollout_log_probs``) and those that rebuild the batch (SPIN).
    """
    if ctx.produced is not None:
        # An overlapping trainer mode: the producer already ran this stage (produce()) on its own engine.
        return ctx.produced
    batch = produce(ctx, request)
    if ctx.actor is not None and batch.rollout_log_probs is not None and not ctx.rollout.shares_actor_weights:
        part = batch.select(list(range(min(ENGINE_CHECK_SAMPLES, len(batch)))))
        check_log_prob_gap(ctx, ctx.actor.compute_log_probs(part).log_probs, part)
    if ctx.rollout.supports_memory_release:
        # Free the engine's weights and KV cache while the step trains; the trainer wakes it for
        # the closing weight sync, or when the step fails (vLLM's sleep mode on GPU).
        ctx.rollout.release_memory()
        ctx.engine_released = True
    return batch


def produce(ctx: "StepContext", request: RolloutRequest) -> Batch:
    """Steps 1-4 (generate, score, filter and resample, greedy baseline) on ``ctx.rollout``.

    The overlapping trainer modes' producer calls this on its own engine (verl-trainer-async),
    the synchronous step through :func:`run`.
    """
    if request.max_extra_rounds < 0:
        raise ValueError(f"RolloutRequest.max_extra_rounds must be >= 0, got {request.max_extra_rounds}")
    batch = _generate_scored(ctx, request)
    if request.greedy_baseline:
        batch = batch.replace(extras={**batch.extras, BASELINE: _greedy_baseline(ctx, batch)})
    return batch


def _timed_add(ctx: "StepContext", key: str, start: float) -> None:
    ctx.metrics[key] = ctx.metrics.get(key, 0.0) + time.perf_counter() - start


def generate(ctx: "StepContext", prompts, sampling) -> Batch:
    """Step 1 alone: the engine's batch, or the environment's episodes (their response budget checked)."""
    start = time.perf_counter()
    if ctx.make_environment is not None:
        # The trainer's make_environment is a functools.partial of the environment class.
        batch = ctx.make_environment.func.run_episodes(
            ctx.rollout, prompts, sampling, ctx.make_environment, ctx.environment_config,
            pad_id=ctx.rollout.tokenizer.pad_token_id, metrics=ctx.metrics, boundary=ctx.boundary, step=ctx.step)
        check_response_budget(batch, source=ctx.boundary.environment, step=ctx.step)
    else:
        batch = generate_batch(ctx.rollout, prompts, sampling, boundary=ctx.boundary, step=ctx.step)
    _timed_add(ctx, "timing/generate", start)
    return batch


def _scored(ctx: "StepContext", batch: Batch, *, record: bool = True) -> Batch:
    """``batch`` with its scores and token rewards; ``record`` adds the reward metrics to the step's.

    Rows whose reward is not finite stop the step, or with ``reward.on_invalid = "skip"`` are dropped
    (``reward/invalid_rows``) before anything else sees them."""
    start = time.perf_counter()
    scores, metrics = ctx.reward.score(batch)
    scores = check_scores(scores, len(batch), source=ctx.boundary.scorer, step=ctx.step)
    _timed_add(ctx, "timing/reward", start)
    parts = [(ctx.boundary.scorer, scores)]
    env_rewards = batch.extras.get(ENV_REWARDS)
    if env_rewards is not None:
        parts.append((ctx.boundary.environment, env_rewards))
    total = scores if env_rewards is None else scores + env_rewards.sum(-1)
    keep = finite_rows(total, parts=parts, on_invalid=ctx.boundary.on_invalid, step=ctx.step)
    ctx.metrics["reward/invalid_rows"] = ctx.metrics.get("reward/invalid_rows", 0.0) + (
        0.0 if keep is None else float(len(batch) - len(keep)))
    if keep is not None:
        batch, scores = batch.select(keep.tolist()), scores[keep]
        env_rewards = None if env_rewards is None else env_rewards[keep]
    token_rewards = scores_to_token_rewards(scores, batch.response_mask)
    if env_rewards is not None:  # the environment's per-turn rewards join the reward stage's
        token_rewards = token_rewards + env_rewards
        scores = scores + env_rewards.sum(-1)
        if record:
            ctx.metrics["env/reward_mean"] = float(env_rewards.sum(-1).mean())
    if record:
        lengths = batch.response_attention_mask.sum(-1).float()
        ctx.metrics.update(metrics)
        ctx.metrics.update({
            "reward/mean": float(scores.mean()),
            "reward/max": float(scores.max()),
            "reward/min": float(scores.min()),
            "response_length/mean": float(lengths.mean()),
            "response_length/clip_frac": sum(r == "length" for r in batch.finish_reasons) / max(1, len(lengths)),
        })
    return batch.replace(scores=scores, token_rewards=token_rewards)


def _generate_scored(ctx: "StepContext", request: RolloutRequest) -> Batch:
    """Generate and score; with a filter, keep the first groups that survive, resampling as allowed.

    When nothing survives at all the first round is kept unfiltered, so the step still trains on
    real samples. The reward metrics describe the step's own prompts, as for every algorithm.
    """
    batch = _scored(ctx, generate(ctx, ctx.prompts, ctx.sampling))
    if request.filter is None:
        return batch
    target = len(ctx.prompts)
    first = batch
    kept: list[Batch] = []
    kept_groups: list[int] = []
    generated = 0
    for rounds in range(request.max_extra_rounds + 1):
        if rounds > 0:
            if ctx.draw_prompts is None:
                break
            sampling = ctx.sampling
            if sampling.seed is not None:
                # A fresh seed per round: the same seed on new prompts would correlate the samples.
                sampling = dataclasses.replace(sampling, seed=sampling.seed + 7919 * rounds)
            batch = generate(ctx, ctx.draw_prompts(), sampling)
            # Group ids restart at 0 in every round; shift them so groups of different rounds stay apart.
            batch = batch.replace(group_ids=batch.group_ids + rounds * target)
            batch = _scored(ctx, batch, record=False)
        generated += len(batch)
        survivors = request.filter(batch)
        if len(survivors):
            kept.append(survivors)
            kept_groups += list(dict.fromkeys(survivors.group_ids.tolist()))
        if len(kept_groups) >= target:
            break
    ctx.metrics.update({
        "dynamic_sampling/rounds": float(rounds + 1),
        "dynamic_sampling/generated_samples": float(generated),
        "dynamic_sampling/kept_groups": float(min(len(kept_groups), target)),
        "dynamic_sampling/fallback_unfiltered": float(not kept),
    })
    if not kept:
        return first
    batch = Batch.concat(kept)
    wanted = set(kept_groups[:target])
    return batch.select([i for i, g in enumerate(batch.group_ids.tolist()) if g in wanted])


def _greedy_baseline(ctx: "StepContext", batch: Batch) -> torch.Tensor:
    """The reward of the current policy's greedy answer to each sample's prompt, ``[B]``."""
    group_ids = batch.group_ids.tolist()
    first_row: dict[int, int] = {}
    for i, g in enumerate(group_ids):
        first_row.setdefault(g, i)
    media = batch.meta.get("multi_modal_data") or [None] * len(batch)
    vision = batch.multi_modal_inputs or [None] * len(batch)
    rows = [{**{key: values[i] for key, values in batch.meta.items()},
             "prompt_ids": PromptIds(batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist(),
                                     multi_modal_data=media[i], multi_modal_inputs=vision[i])}
            for i in first_row.values()]
    greedy = generate(ctx, rows, dataclasses.replace(ctx.sampling, n=1, greedy=True))
    start = time.perf_counter()
    scores, _ = ctx.reward.score(greedy)
    scores = check_scores(scores, len(greedy), source=ctx.boundary.scorer, step=ctx.step)
    finite_rows(scores, parts=[(ctx.boundary.scorer, scores)], on_invalid="stop", step=ctx.step)  # a baseline per group
    _timed_add(ctx, "timing/reward", start)
    per_group = dict(zip(first_row, scores.tolist()))
    ctx.metrics["baseline/greedy_reward_mean"] = float(scores.mean())
    return torch.tensor([per_group[g] for g in group_ids], dtype=torch.float32)
