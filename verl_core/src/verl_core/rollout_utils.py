"""Turning prompts and a rollout engine's output into a :class:`~verl_core.batch.Batch`, and keeping
the engine's weights in step with the actor's (the sync, and the check that it arrived intact)."""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Sequence

import torch

from verl_core.batch import Batch
from verl_core.contracts import PromptIds, RolloutEngine, RolloutOutput, SamplingParams, TrainingWorker

__all__ = ["DEFAULT_LOG_PROB_GAP", "generate_batch", "build_batch", "left_pad", "right_pad", "sync_rollout_weights",
           "check_weight_sync", "check_log_prob_gap", "guard_limit", "run_guard_limit", "WeightSyncError", "check_rollout_multi_modal"]

logger = logging.getLogger("verl.rollout")


#: ``rollout.max_log_prob_gap`` when unset, by compute dtype: far above the fp32 floor (3e-7), below a
#: 10% error in one tensor (2.5e-2); the 16-bit value is not measured here (no GPU).
DEFAULT_LOG_PROB_GAP = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}


def guard_limit(configured: float | None, compute_dtypes: Sequence[str]) -> float:
    """The weight-sync guard's limit: the configured one, else the default of the least precise dtype."""
    if configured is not None:
        return configured
    return max(DEFAULT_LOG_PROB_GAP.get(d, max(DEFAULT_LOG_PROB_GAP.values())) for d in compute_dtypes)


def run_guard_limit(config: Any) -> float:
    """The guard's limit in a run of ``config``: mixed precision or a 16-bit engine on float32 weights differ
    like 16-bit weights do, so every compute dtype counts."""
    dtype = config.model.dtype
    return guard_limit(config.rollout.config.max_log_prob_gap, [
        dtype, config.backend.config.compute_dtype(dtype), config.rollout.config.compute_dtype(dtype)])


class WeightSyncError(RuntimeError):
    """The rollout engine samples from other weights than the actor's: a stale or corrupt sync."""


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(ids, mask)`` tensors."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def right_pad(rows: Sequence[Sequence[float]], fill: float, dtype: torch.dtype, width: int | None = None,
              ) -> torch.Tensor:
    """Right-pad lists into a ``[len(rows), width]`` tensor."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), max(width, 1)), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(list(r), dtype=dtype)
    return out


def build_batch(prompts: Sequence[dict[str, Any]], output: RolloutOutput, *, n: int, pad_id: int) -> Batch:
    """Pair each prompt row with its ``n`` responses (prompt ``i``'s samples get group id ``i``)."""
    expected = len(prompts) * n
    if len(output.response_ids) != expected:
        raise ValueError(f"rollout engine returned {len(output.response_ids)} responses for "
                         f"{len(prompts)} prompts x n={n}; expected {expected}")
    rows = [p for p in prompts for _ in range(n)]
    prompt_ids, prompt_mask = left_pad([r["prompt_ids"] for r in rows], pad_id)
    width = max(1, max((len(r) for r in output.response_ids), default=1))
    response_ids = right_pad(output.response_ids, pad_id, torch.long, width)
    attn = right_pad([[1] * len(r) for r in output.response_ids], 0, torch.long, width)
    rollout_lp = None
    if output.log_probs is not None:
        rollout_lp = right_pad(output.log_probs, 0.0, torch.float32, width)
    meta_keys = ("ground_truth", "data_source", "extra_info", "prompt_text", "prompt_messages")
    vision = [PromptIds.inputs_of(r["prompt_ids"]) for r in rows]
    images = ({"multi_modal_data": [getattr(r["prompt_ids"], "multi_modal_data", {}) for r in rows]}
              if any(vision) else {})
    return Batch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_attention_mask=attn,
        response_mask=attn.clone(),
        group_ids=torch.arange(len(prompts)).repeat_interleave(n),
        rollout_log_probs=rollout_lp,
        finish_reasons=list(output.finish_reasons),
        meta={**{k: [r.get(k) for r in rows] for k in meta_keys},
              "weight_version": [output.weight_version] * expected, **images},
        info={"pad_token_id": pad_id},
        multi_modal_inputs=vision if any(vision) else [],
    )


def check_rollout_multi_modal(engine: Any, name: str, rows: Sequence[dict[str, Any]]) -> None:
    """Refuse prompts with images for an engine that would sample from their text alone."""
    if getattr(engine, "accepts_multi_modal", False):
        return
    with_images = sum(1 for r in rows if getattr(r.get("prompt_ids"), "multi_modal_data", None)
                      or getattr(r.get("prompt_ids"), "multi_modal_inputs", None))
    if with_images:
        from verl_core.config import ConfigError

        engine_name = name or getattr(engine, "__name__", type(engine).__name__)
        raise ConfigError("rollout.name", f"{with_images} prompts have images, and the {engine_name!r} rollout "
                                          f"engine cannot take images (it would sample from the text alone); use "
                                          f"rollout.name='hf', or an engine with accepts_multi_modal")


def generate_batch(engine: RolloutEngine, prompts: Sequence[dict[str, Any]], sampling: SamplingParams, *,
                   boundary: Any = None, step: int = 0) -> Batch:
    """Generate ``sampling.n`` responses per prompt row and build the batch; the engine's output is
    checked first (``boundary``: a :class:`~verl_core.boundary.Boundary`, a default one if None)."""
    from verl_core.boundary import Boundary

    check_rollout_multi_modal(engine, "", prompts)
    output = engine.generate([p["prompt_ids"] for p in prompts], sampling=sampling)
    output = (boundary or Boundary()).engine_output(output, expected=len(prompts) * sampling.n, step=step)
    pad_id = engine.tokenizer.pad_token_id
    batch = build_batch(prompts, output, n=sampling.n, pad_id=pad_id if pad_id is not None else 0)
    # The response budget, for losses normalised by a constant length (Dr. GRPO) and length shaping.
    batch.info["max_new_tokens"] = sampling.max_new_tokens
    return batch


def sync_rollout_weights(rollout: RolloutEngine, actor: TrainingWorker) -> None:
    """Bring ``rollout`` to the actor's current policy: nothing, a LoRA adapter, or full weights.

    An actor that trains LoRA adapters and offers them (:meth:`TrainingWorker.lora_adapter`)
    sends only the adapter to an engine that accepts one; otherwise the full weights stream.
    """
    if rollout.shares_actor_weights:
        return
    adapter = check_weight_sync(rollout, actor)
    if adapter is not None:
        rollout.load_lora_adapter(adapter)
    else:
        rollout.load_weights(actor.iter_weights())


# Whether an actor syncs LoRA adapters is fixed by its configuration: once an actor has answered
# "no", later syncs skip the question (on Ray it is a round trip to every rank).
_SYNCS_ADAPTERS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def check_weight_sync(rollout: RolloutEngine, actor: TrainingWorker) -> Any:
    """The actor's adapter if it syncs one (``None`` otherwise); an error if ``rollout`` cannot load it."""
    if rollout.shares_actor_weights or _SYNCS_ADAPTERS.get(actor) is False:
        return None
    adapter = actor.lora_adapter()
    _SYNCS_ADAPTERS[actor] = adapter is not None
    if adapter is not None and not rollout.accepts_lora_adapters:
        from verl_core.config import ConfigError

        raise ConfigError("backend.lora_sync", f"the actor syncs LoRA adapters but this {type(rollout).__name__} "
                                               f"cannot load them: set backend.lora_sync='merged', or make the engine "
                                               f"serve adapters (vllm: rollout.max_lora_rank >= backend.lora_rank)")
    return adapter


def check_log_prob_gap(ctx: Any, trainer_log_probs: torch.Tensor, batch: Batch) -> None:
    """Record how far the engine's log-probs are from the trainer's, and stop on a broken sync.

    The same weights give the same probabilities up to kernel rounding (fp32 vLLM vs HF: about
    1e-6 per token); a tensor that did not arrive, or arrived corrupt, moves them by orders of
    magnitude more. Over ``ctx.max_log_prob_gap`` (mean absolute difference per response token) the
    step raises :class:`WeightSyncError` before anything trains on it, or warns
    (``ctx.log_prob_gap_action = "warn"``).
    """
    from verl_core.batch import masked_mean

    mask = batch.response_mask
    gap = (trainer_log_probs - batch.rollout_log_probs).abs() * mask
    mean, worst = float(masked_mean(gap, mask)), float(gap.max()) if gap.numel() else 0.0
    ctx.metrics["rollout/log_prob_diff_mean"] = mean
    ctx.metrics["rollout/log_prob_diff_max"] = worst
    if not math.isfinite(mean):
        raise FloatingPointError("the trainer's log-probs of the sampled tokens are NaN/inf, so the policy's "
                                 "weights have diverged (lower backend.lr, or check the rewards for NaN)")
    limit = ctx.max_log_prob_gap
    # An engine on the actor's own module cannot be out of sync, and one serving fixed weights on
    # purpose (an OpenAI server with weight_sync="ignore") is expected to drift: record, never stop.
    if not limit or mean <= limit or ctx.rollout.shares_actor_weights or not ctx.rollout.follows_actor_weights:
        return
    engine = ctx.rollout_name or type(ctx.rollout).__name__
    since = "its start" if ctx.step <= 1 else f"the weight sync after step {ctx.step - 1}"
    message = (f"at RL step {ctx.step}: the {engine!r} rollout engine's log-probs differ from the trainer's by "
               f"{mean:.3g} per token on average (max {worst:.3g}), over rollout.max_log_prob_gap={limit:g}: "
               f"the engine is not sampling from the actor's weights since {since} (a stale or corrupt weight "
               f"sync). Nothing was trained on this step. Set rollout.log_prob_gap_action='warn' to go on anyway, "
               f"or raise rollout.max_log_prob_gap if this engine is known to differ this much (bf16 kernels).")
    if ctx.log_prob_gap_action == "warn":
        logger.warning(message)
        return
    raise WeightSyncError(message)
