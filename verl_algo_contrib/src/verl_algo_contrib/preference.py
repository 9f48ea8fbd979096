"""Offline preference optimisation: DPO, KTO and ORPO on the same interfaces as the RL algorithms.

These algorithms learn from responses the data provides, with no rollout and no reward function:
their dataflow builds each step's batch from the sampled prompt rows' columns
(:meth:`~verl_core.dataflow.DataflowBuilder.batch_from_data`), asks the reference role for its
log-probs where the loss needs them, and updates the actor. Validation still generates with the
rollout engine, so a run on ``data.val = "builtin:addition"`` reports real accuracy.

Batch layout: every prompt gives two-row groups (see :mod:`verl_algo_contrib.data`). For pairs
the rows are (chosen, rejected) with scores 1 and 0, so :func:`~verl_algo_contrib.functional.preference_pairs`
finds them the same way it finds ordered pairs among scored samples. For KTO each example gets
a group of (its own completion, another example's completion): the second row is only used to
estimate the KL reference point ``z``, flagged by ``extras["kl_row"]``.

Columns (configurable): ``prompt``, ``chosen``, ``rejected``; KTO also reads ``completion`` and
``label`` rows. Micro- and mini-batch sizes must be even so that groups stay whole. Their
:class:`~verl_core.contracts.Requirements` ask for ``"preference_pairs"`` data, which a ``builtin:``
dataset that offers it builds itself: ``verl run --algo dpo`` trains on pairs derived from
``builtin:addition`` (chosen = the sum, rejected = a near miss).
"""

from __future__ import annotations

import decimal
import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from verl_core.batch import Batch
from verl_core.contracts import Algorithm, AlgorithmConfig, Requirements
from verl_core.kit import DataError
from verl_algorithms.base import without_v1_keys

from verl_algo_contrib import functional as CF
from verl_algo_contrib.data import check_pairs_intact, encode_response, raw_column, two_row_groups

__all__ = ["DPO", "DPOConfig", "KTO", "KTOConfig", "ORPO", "ORPOConfig", "PreferenceConfig", "PreferenceAlgorithm"]


@dataclass
class PreferenceConfig(AlgorithmConfig):
    """Settings every offline preference algorithm shares.

    Attributes:
        beta: temperature of the implicit reward ``beta * log(pi / pi_ref)``. (The prompt column
            is ``data.prompt_key``.)
        chosen_key: column with the preferred response.
        rejected_key: column with the dispreferred response.
        max_response_length: cut responses to this many tokens (0: keep them whole).
    """

    # What acts while the batch is built from the data rows, which the conformance suite's fixed
    # batch stands in for; test_contrib_algorithms.py checks each on real rows.
    inert_fields: ClassVar[dict[str, str]] = {
        "chosen_key": "names the data column of the preferred response, read by build_batch",
        "rejected_key": "names the data column of the dispreferred response, read by build_batch",
        "max_response_length": "cuts the data's responses in build_batch",
    }

    beta: float = 0.1
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    max_response_length: int = 0

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise ValueError("beta: must be > 0")
        if self.max_response_length < 0:
            raise ValueError("max_response_length: must be >= 0 (0 keeps responses whole)")
        if self.mini_batch_size % 2:
            raise ValueError("mini_batch_size: must be even (0 = whole batch) so that preference pairs stay together")


class PreferenceAlgorithm(Algorithm):
    """Common dataflow of the offline algorithms: batch from data, reference log-probs, update.

    Advantages are not used; :meth:`compute_advantages` returns zeros so the algorithm still
    satisfies the interface (and the conformance suite) without pretending to estimate any.
    """

    Config = PreferenceConfig
    uses_reference = True

    @classmethod
    def saved_settings(cls, section: dict[str, Any]) -> dict[str, Any]:
        return without_v1_keys(cls.Config, section)  # runs saved before Core v2 wrote every PPO knob

    def requirements(self) -> Requirements:
        # "preference_pairs": a builtin: dataset (builtin:addition) derives chosen/rejected columns itself.
        return Requirements(critic=False, reference=self.uses_reference, data="preference_pairs")

    def build_dataflow(self, df: Any) -> None:
        df.batch_from_data(self.build_batch, name="preference_data")
        if self.uses_reference:
            df.reference_log_probs()
        df.update_actor(self, reads=("ref_log_probs",) if self.uses_reference else ())

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        return zeros, zeros

    def build_batch(self, ctx: Any) -> Batch:
        """(chosen, rejected) groups for the step's prompt rows."""
        cfg = self.config
        tok = ctx.tokenizer
        pairs = []
        for row in ctx.prompts:
            chosen = encode_response(tok, raw_column(row, cfg.chosen_key, config_key="chosen_key"),
                                     max_length=cfg.max_response_length)
            rejected = encode_response(tok, raw_column(row, cfg.rejected_key, config_key="rejected_key"),
                                       max_length=cfg.max_response_length)
            pairs.append((chosen, rejected))
        return two_row_groups(ctx.prompts, pairs, scores=[(1.0, 0.0)] * len(pairs), pad_id=_pad_id(tok),
                              eos_id=tok.eos_token_id)

    def _pair_log_probs(self, batch: Batch, log_probs: torch.Tensor, *, average: bool = False,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_pairs_intact(batch)
        chosen, rejected = CF.preference_pairs(batch.scores, batch.group_ids, batch.response_mask)
        seq = CF.sequence_log_probs(log_probs, batch.response_mask, average=average)
        return seq, chosen, rejected


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return pad if pad is not None else 0


def _mean_or_zero(values: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """Mean of ``values``; with none, a zero that still depends on ``anchor`` (so backward works)."""
    return values.mean() if values.numel() else (anchor * 0).sum()


# ----------------------------------------------------------------------------- DPO
@dataclass
class DPOConfig(PreferenceConfig):
    """DPO settings.

    Attributes:
        beta: 0.1, the value most of the paper's experiments use.
        label_smoothing: assumed fraction of flipped labels (conservative DPO); 0 is plain DPO.
    """

    label_smoothing: float = 0.0

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError("label_smoothing: must be in [0, 0.5)")


class DPO(PreferenceAlgorithm):
    """Direct preference optimisation.

    Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a Reward
    Model", arXiv:2305.18290. Instead of fitting a reward model and running PPO against it, DPO
    uses the closed-form optimum of the KL-regularised RL objective: the policy's log-ratio to
    the reference is an implicit reward, and a logistic loss on the chosen-minus-rejected reward
    margin of each preference pair trains it. Offline: no generation, no reward function, no
    critic; the reference model replaces PPO's KL penalty.
    """

    Config = DPOConfig

    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        seq, chosen, rejected = self._pair_log_probs(batch, log_probs)
        ref = CF.sequence_log_probs(batch.ref_log_probs, batch.response_mask)
        ratio = seq - ref
        losses, margins = CF.dpo_loss(ratio[chosen], ratio[rejected], beta=cfg.beta,
                                      label_smoothing=cfg.label_smoothing)
        loss = _mean_or_zero(losses, log_probs)
        return loss, _pair_metrics(loss, margins, cfg.beta * ratio[chosen], cfg.beta * ratio[rejected])


def _pair_metrics(loss: torch.Tensor, margins: torch.Tensor, chosen_rewards: torch.Tensor,
                  rejected_rewards: torch.Tensor) -> dict[str, float]:
    m = margins.detach()
    return {
        "ppo/actor_loss": float(loss.detach()),
        "preference/pairs": float(m.numel()),
        "preference/accuracy": float((m > 0).float().mean()) if m.numel() else 0.0,
        "preference/margin": float(m.mean()) if m.numel() else 0.0,
        "preference/chosen_reward": float(chosen_rewards.detach().mean()) if m.numel() else 0.0,
        "preference/rejected_reward": float(rejected_rewards.detach().mean()) if m.numel() else 0.0,
    }


# ----------------------------------------------------------------------------- KTO
@dataclass
class KTOConfig(PreferenceConfig):
    """KTO settings (the paper's defaults).

    Attributes:
        beta: 0.1.
        desirable_weight: ``lambda_D``, 1.0.
        undesirable_weight: ``lambda_U``, 1.0; the paper suggests keeping
            ``lambda_D n_D / (lambda_U n_U)`` within [1, 4/3] when the classes are imbalanced.
        completion_key: column with the completion of unary rows.
        label_key: column with the unary label: true/false, or a number (a graded label, compared with
            ``desirable_threshold``); anything else (a string such as ``"false"``) stops the run.
        desirable_threshold: labels (true = 1, false = 0) at or above it are desirable.
    """

    inert_fields: ClassVar[dict[str, str]] = {
        "completion_key": "names the data column of a unary row's completion, read by build_batch",
        "label_key": "names the data column of a unary row's label, read by build_batch",
    }

    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    completion_key: str = "completion"
    label_key: str = "label"
    desirable_threshold: float = 0.5

    def validate(self) -> None:
        super().validate()
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ValueError("desirable_weight/undesirable_weight: must be > 0")


class KTO(PreferenceAlgorithm):
    """Kahneman-Tversky optimisation.

    Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization",
    arXiv:2402.01306. Needs only a desirable/undesirable label per completion, not pairs: the
    loss is a prospect-theory value function of the implicit reward ``r = log(pi / pi_ref)``
    relative to a reference point ``z``, the policy's KL to the reference, estimated from
    mismatched (prompt, other completion) pairs and not differentiated through. Rows with
    ``completion``/``label`` are used as they are; rows with ``chosen``/``rejected`` give one
    desirable and one undesirable example each.
    """

    Config = KTOConfig

    def build_batch(self, ctx: Any) -> Batch:
        cfg = self.config
        tok = ctx.tokenizer
        examples: list[tuple[dict[str, Any], list[int], float]] = []
        for row in ctx.prompts:
            raw = row.get("raw") or {}
            if cfg.completion_key in raw:
                label = _label_score(raw_column(row, cfg.label_key, config_key="label_key"), cfg.label_key)
                examples.append((row, encode_response(tok, raw[cfg.completion_key],
                                                      max_length=cfg.max_response_length), label))
            else:
                for key, config_key, label in ((cfg.chosen_key, "chosen_key", 1.0),
                                               (cfg.rejected_key, "rejected_key", 0.0)):
                    value = raw_column(row, key, config_key=config_key)
                    examples.append((row, encode_response(tok, value, max_length=cfg.max_response_length), label))
        n = len(examples)
        # Each example's partner row pairs its prompt with the next example's completion: a
        # mismatched pair whose log-ratio estimates KL(pi || pi_ref) without the label's signal.
        responses = [(ids, examples[(i + 1) % n][1]) for i, (_, ids, _) in enumerate(examples)]
        scores = [(label, 0.0) for _, _, label in examples]  # desirable_threshold decides in the loss
        kl_rows = [(0.0, 1.0 if n > 1 else 0.0) for _ in examples]
        return two_row_groups([row for row, _, _ in examples], responses, scores=scores, pad_id=_pad_id(tok),
                              eos_id=tok.eos_token_id, extras={"kl_row": kl_rows})

    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        check_pairs_intact(batch)
        ratio = CF.sequence_log_probs(log_probs, batch.response_mask) - CF.sequence_log_probs(
            batch.ref_log_probs, batch.response_mask)
        valid = batch.response_mask.sum(-1) > 0
        kl_row = batch.extras.get("kl_row", torch.zeros(len(batch))) > 0
        examples = valid & ~kl_row
        estimate = ratio[valid & kl_row]
        # Batches without mismatched rows (a single example) use z = 0, as TRL does without a KL batch.
        z = estimate.detach().mean().clamp(min=0.0) if estimate.numel() else ratio.new_zeros(())
        desirable = batch.scores >= cfg.desirable_threshold
        losses = CF.kto_loss(ratio[examples], desirable[examples], z, beta=cfg.beta,
                             desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
        loss = _mean_or_zero(losses, log_probs)
        rewards = (cfg.beta * ratio[examples]).detach()
        good = desirable[examples]
        return loss, {
            "ppo/actor_loss": float(loss.detach()),
            "kto/kl_reference": float(z),
            "kto/desirable_reward": float(rewards[good].mean()) if good.any() else 0.0,
            "kto/undesirable_reward": float(rewards[~good].mean()) if (~good).any() else 0.0,
        }


def _label_score(label: Any, column: str) -> float:
    """A unary row's label as its score: true/false as 1/0, a number as it is; never a guess from a string."""
    if hasattr(label, "item") and not isinstance(label, (str, bytes)):  # a numpy or torch scalar
        label = label.item()
    if isinstance(label, (numbers.Real, decimal.Decimal)) and math.isfinite(float(label)):
        return float(label)  # bool is a Real: True -> 1.0; pyarrow reads decimal columns as Decimal
    raise DataError(f"the training data's {column!r} column holds {type(label).__name__} {label!r}; a KTO label is "
                    f"true/false or a finite number (at or above algorithm.desirable_threshold: desirable)")


# ----------------------------------------------------------------------------- ORPO
@dataclass
class ORPOConfig(PreferenceConfig):
    """ORPO settings.

    Attributes:
        beta: ``lambda``, the weight of the odds-ratio term next to the SFT loss (0.1 in the
            paper's main runs).
    """


class ORPO(PreferenceAlgorithm):
    """Odds-ratio preference optimisation.

    Hong et al., "ORPO: Monolithic Preference Optimization without Reference Model",
    arXiv:2403.07691. Folds preference alignment into supervised fine-tuning: the loss is the
    chosen response's negative log-likelihood (per token) plus ``lambda`` times a logistic loss on
    the log odds ratio between chosen and rejected, where the odds use the length-normalised
    likelihood. No reference model, so no second model in memory and no reference forward.
    """

    Config = ORPOConfig
    uses_reference = False

    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        mean_lp, chosen, rejected = self._pair_log_probs(batch, log_probs, average=True)
        or_losses, log_odds = CF.odds_ratio_loss(mean_lp[chosen], mean_lp[rejected])
        nll = -mean_lp[chosen]
        loss = _mean_or_zero(nll + cfg.beta * or_losses, log_probs)
        metrics = _pair_metrics(loss, log_odds, cfg.beta * mean_lp[chosen], cfg.beta * mean_lp[rejected])
        metrics["orpo/nll"] = float(nll.detach().mean()) if nll.numel() else 0.0
        metrics["orpo/log_odds_ratio"] = float(log_odds.detach().mean()) if log_odds.numel() else 0.0
        return loss, metrics
