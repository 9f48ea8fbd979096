"""DAPO: decoupled clip and dynamic sampling policy optimisation.

Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476.
Four changes to GRPO:

* **Clip-higher**: asymmetric clip range (``1 - 0.2 <= ratio <= 1 + 0.28``), so unlikely tokens
  can gain probability and entropy does not collapse.
* **Token-level loss**: the loss is averaged over all tokens of the batch (``token-mean``), not
  per response, so long responses weigh in proportion to their length.
* **Dynamic sampling**: groups whose rewards are all equal carry no gradient; they are dropped and
  more prompts are sampled until the batch is full again (capped at ``max_extra_rounds``). The
  core's rollout stage does the sampling; DAPO requests it with its filter (``rollout_request``).
* **Overlong reward shaping**: a soft penalty in the last ``overlong_buffer_len`` tokens before
  the response budget, falling linearly to ``-overlong_penalty_factor`` at the budget.

No KL term (the paper removes it for long reasoning).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from verl_algorithms.base import LossAggMode
from verl_algorithms.functional import scores_to_token_rewards
from verl_algorithms.grpo import GRPO, GRPOConfig
from verl_core.contracts import RolloutRequest

from verl_algo_contrib import functional as CF

__all__ = ["DAPO", "DAPOConfig"]


@dataclass
class DAPOConfig(GRPOConfig):
    """DAPO settings (defaults from the paper and verl's DAPO recipe).

    Attributes:
        clip_ratio_low: 0.2 (paper).
        clip_ratio_high: 0.28 (paper, "clip-higher").
        loss_agg_mode: ``"token-mean"`` (paper).
        dynamic_sampling: drop equal-reward groups and resample to fill the batch.
        max_extra_rounds: extra generation rounds per step at most (verl's recipe caps a step at
            10 generation batches). When the cap is hit the step trains on what survived.
        overlong_buffer_len: tokens before the budget where the soft penalty applies (4096 of a
            20480-token budget in the paper). Shaping is skipped, with a warning, when it is not
            smaller than ``rollout.max_new_tokens``; 0 turns it off.
        overlong_penalty_factor: the penalty at the budget (1.0 in the paper).
    """

    inert_when: ClassVar[dict[tuple[str, str], str]] = {
        ("max_extra_rounds", "dynamic_sampling"): "extra rounds replace groups the dynamic-sampling filter dropped; "
                                                  "with dynamic_sampling = false nothing is filtered",
    }

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    loss_agg_mode: LossAggMode = "token-mean"
    kl_coef: float = 0.0
    dynamic_sampling: bool = True
    max_extra_rounds: int = 9
    overlong_buffer_len: int = 4096
    overlong_penalty_factor: float = 1.0

    def validate(self) -> None:
        super().validate()
        if self.max_extra_rounds < 0:
            raise ValueError("max_extra_rounds: must be >= 0 (0 filters without resampling)")
        if self.overlong_buffer_len < 0:
            raise ValueError("overlong_buffer_len: must be >= 0 tokens (0 turns overlong shaping off)")
        if self.overlong_penalty_factor < 0:
            raise ValueError("overlong_penalty_factor: must be >= 0")


class DAPO(GRPO):
    """GRPO with clip-higher, token-mean loss, dynamic sampling and overlong shaping."""

    Config = DAPOConfig

    def __init__(self, config: DAPOConfig) -> None:
        super().__init__(config)
        self._warned_overlong = False

    def rollout_request(self) -> RolloutRequest:
        if not self.config.dynamic_sampling:
            return RolloutRequest()
        return RolloutRequest(filter=CF.drop_equal_reward_groups, max_extra_rounds=self.config.max_extra_rounds)

    def shape_rewards(self, df: Any) -> None:
        cfg = self.config
        if cfg.overlong_buffer_len > 0 and cfg.overlong_penalty_factor > 0:
            # After filtering: groups are kept on accuracy, as in the paper, not on shaped rewards.
            df.node("overlong_shaping", self._shape_overlong, reads=("scores",), writes=("scores", "token_rewards"))

    def _shape_overlong(self, ctx: Any) -> dict[str, torch.Tensor] | None:
        cfg = self.config
        b = ctx.batch
        budget = int(b.info.get("max_new_tokens") or ctx.sampling.max_new_tokens)
        if cfg.overlong_buffer_len >= budget:
            if not self._warned_overlong:
                warnings.warn(f"DAPO overlong shaping is off: algorithm.overlong_buffer_len={cfg.overlong_buffer_len} "
                              f"is not smaller than rollout.max_new_tokens={budget}; set it below the budget to "
                              f"use it", stacklevel=2)
                self._warned_overlong = True
            ctx.metrics["dapo/overlong_shaping_active"] = 0.0
            return None
        lengths = b.response_attention_mask.sum(-1)
        penalty = CF.overlong_penalty(lengths, max_length=budget, buffer=cfg.overlong_buffer_len,
                                      factor=cfg.overlong_penalty_factor)
        ctx.metrics["dapo/overlong_shaping_active"] = 1.0
        ctx.metrics["dapo/overlong_penalty_mean"] = float(penalty.mean()) if len(penalty) else 0.0
        scores = b.scores + penalty
        return {"scores": scores, "token_rewards": scores_to_token_rewards(scores, b.response_mask)}
