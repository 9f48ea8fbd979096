"""SPIN: self-play fine-tuning against the SFT data.

Chen et al., "Self-Play Fine-Tuning Converts Weak Language Models to Strong Language Models",
arXiv:2401.01335. The policy plays against its own previous iterate: the opponent generates
responses to the SFT prompts, and the policy is trained with a DPO-style logistic loss to prefer
the human (SFT) response over the opponent's, with the opponent also serving as the reference:
``-log sigmoid(beta * ([log pi(y) - log pi_opp(y)] - [log pi(y') - log pi_opp(y')]))`` for the
SFT response ``y`` and the generated ``y'``. No reward model; the fixed point is the data
distribution.

Here every step is one self-play iteration: the opponent is the policy at the start of the step
(its samples and its log-probs, the usual old log-probs), so no reference model is needed. Each
generated sample is paired with its prompt's target; a sample identical to the target gives no
gradient. The target is the row's ground truth by default (the built-in task's answer), or any
raw column (``target_key``). A reward function still scores the samples, for the metrics only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from verl_core.batch import Batch
from verl_core.contracts import Algorithm, AlgorithmConfig, Requirements
from verl_algorithms.base import without_v1_keys

from verl_algo_contrib import functional as CF
from verl_algo_contrib.data import check_pairs_intact, encode_response, raw_column, two_row_groups

__all__ = ["SPIN", "SPINConfig"]


@dataclass
class SPINConfig(AlgorithmConfig):
    """SPIN settings.

    Attributes:
        beta: the logistic loss' temperature (``lambda`` in the paper; 0.1 as in its runs).
        target_key: raw column holding the SFT response; empty uses each row's ground truth.
        max_response_length: cut targets to this many tokens (0: keep them whole).
    """

    inert_fields: ClassVar[dict[str, str]] = {
        "target_key": "names the data column of the SFT target, which the conformance suite's rows lack (they give "
                      "the ground truth, the default); test_contrib_algorithms.py checks it on real rows",
    }

    beta: float = 0.1
    target_key: str = ""
    max_response_length: int = 0

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise ValueError("beta: must be > 0")
        if self.mini_batch_size % 2:
            raise ValueError("mini_batch_size: must be even (0 = whole batch) so that pairs stay together")


class SPIN(Algorithm):
    """Self-play: SFT target vs. the policy's own sample, opponent = policy at the step start."""

    Config = SPINConfig

    @classmethod
    def saved_settings(cls, section: dict[str, Any]) -> dict[str, Any]:
        return without_v1_keys(cls.Config, section)  # runs saved before Core v2 wrote every PPO knob

    def requirements(self) -> Requirements:
        return Requirements(critic=False, reference=False)

    def build_dataflow(self, df: Any) -> None:
        df.rollout()
        df.node("pair_with_targets", self.pair_with_targets, reads=("scores",), writes=("batch",))
        df.actor_log_probs()
        df.update_actor(self, reads=("old_log_probs",))

    def pair_with_targets(self, ctx: Any) -> Batch:
        """One (target, generated) group per generated sample; the generated batch's group ids
        index the step's prompt rows."""
        cfg = self.config
        b = ctx.batch
        tok = ctx.tokenizer
        targets: dict[int, list[int]] = {}
        rows, pairs = [], []
        for i, group in enumerate(b.group_ids.tolist()):
            row = ctx.prompts[group]
            if group not in targets:
                targets[group] = encode_response(tok, self._target(row), max_length=cfg.max_response_length)
            generated = b.response_ids[i][b.response_attention_mask[i].bool()].tolist()
            rows.append(row)
            pairs.append((targets[group], generated or [tok.eos_token_id]))
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        return two_row_groups(rows, pairs, scores=[(1.0, 0.0)] * len(pairs), pad_id=pad, eos_id=tok.eos_token_id)

    def _target(self, row: dict[str, Any]) -> Any:
        if self.config.target_key:
            return raw_column(row, self.config.target_key, config_key="target_key")
        if row.get("ground_truth") is None:
            raise ValueError("SPIN needs a target response but the rows have no ground truth; set "
                             "algorithm.target_key to the column holding the SFT response")
        truth = row["ground_truth"]
        return truth if isinstance(truth, (str, list, dict)) else str(truth)

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        return zeros, zeros

    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_pairs_intact(batch)
        chosen, rejected = CF.preference_pairs(batch.scores, batch.group_ids, batch.response_mask)
        ratio = (CF.sequence_log_probs(log_probs, batch.response_mask)
                 - CF.sequence_log_probs(batch.old_log_probs, batch.response_mask))
        losses, margins = CF.dpo_loss(ratio[chosen], ratio[rejected], beta=self.config.beta)
        loss = losses.mean() if losses.numel() else (log_probs * 0).sum()
        m = margins.detach()
        return loss, {
            "ppo/actor_loss": float(loss.detach()),
            "spin/pairs": float(m.numel()),
            "spin/margin": float(m.mean()) if m.numel() else 0.0,
            "spin/accuracy": float((m > 0).float().mean()) if m.numel() else 0.0,
        }
