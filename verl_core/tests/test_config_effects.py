"""The conformance suite's config check (verl_core.testing._config_effects) catches the silent no-ops it exists for.

Each broken algorithm here is a real bug shape: a KL penalty folded into rewards that the
advantages never read (GRPO before issue 14), an importance-sampling cap that the loss never
applies (GSPO, CISPO and GPG before issue 14), a knob that only reaches a metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from verl_algorithms import functional as F
from verl_algorithms.base import PPOFamilyConfig
from verl_algorithms.grpo import GRPO, GRPOConfig
from verl_core.testing import EffectHarness, config_effect_batch, config_field_problems

torch.set_num_threads(1)


def problems_of(algorithm) -> str:
    return "\n".join(config_field_problems(algorithm))


def test_the_fixed_batch_makes_every_knob_observable():
    h = EffectHarness()
    b = h.batch
    scores = [b.scores[b.group_ids == g] for g in b.group_ids.unique()]
    assert any((s == s[0]).all() for s in scores) and any((s != s[0]).any() for s in scores)
    lengths = b.response_attention_mask.sum(-1)
    assert lengths.max() == b.info["max_new_tokens"] and len(set(lengths.tolist())) > 4
    assert ((b.response_mask == 0) & (b.response_attention_mask == 1)).any(), "tool tokens inside responses"
    mask = b.response_mask.bool()
    old, cur, ref = h.old_log_probs(b), h.current_log_probs(b), h.reference_log_probs(b)
    assert (b.rollout_log_probs[mask] != old[mask]).all()
    assert (old <= 0).all() and (cur <= 0).all() and (ref <= 0).all(), "log-probs of a real policy"
    log_ratio = (cur - old)[mask]
    assert log_ratio.min() < -0.5 and log_ratio.max() > 0.5, "ratios on both sides of any clip range"
    # exp(x) - x - 1 passes 10 (low_var_kl's clamp) only for x > 2.6: k3 and low_var_kl must differ.
    assert ((ref - old)[mask] > 2.6).any() and ((ref - cur)[mask] > 2.6).any()
    # Sequence-level ratios (GSPO) on both sides of 1 for positive and negative advantages.
    adv, _ = GRPO(GRPOConfig()).compute_advantages(b)
    seq = ((cur - old) * b.response_mask).sum(-1) / b.response_mask.sum(-1)
    combos = {(bool(a > 0), bool(s > 0)) for a, s in zip(adv[:, 0], seq) if a != 0}
    assert combos == {(True, True), (True, False), (False, True), (False, False)}
    assert config_effect_batch(max_new_tokens=4100).info["max_new_tokens"] == 4100


def test_the_built_in_grpo_passes():
    assert problems_of(GRPO(GRPOConfig())) == ""
    assert problems_of(GRPO(GRPOConfig(kl_coef=0.01))) == ""


class ScoresOnlyGRPO(GRPO):
    """GRPO before issue 14: advantages from the scores, so a KL folded into the token rewards is lost."""

    def compute_advantages(self, batch):
        adv = F.group_normalized_advantages(batch.scores, batch.group_ids, batch.response_mask,
                                            norm_by_std=self.config.norm_adv_by_std, eps=self.config.eps)
        return adv, adv


def test_catches_a_kl_in_reward_the_advantages_never_read():
    found = problems_of(ScoresOnlyGRPO(GRPOConfig()))
    assert "algorithm.kl_coef stops changing anything" in found and "algorithm.kl_in_reward = True" in found


class UncappedGRPO(GRPO):
    """A loss that accepts rollout_is_cap and never applies it (GSPO, CISPO, GPG before issue 14)."""

    def policy_loss(self, *, batch, log_probs=None, entropy=None, values=None):
        cfg = self.config
        loss, _ = F.ppo_clip_loss(log_probs, batch.old_log_probs, batch.advantages, batch.response_mask,
                                  clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high, clip_c=cfg.clip_ratio_c,
                                  agg_mode=cfg.loss_agg_mode, norm_length=batch.info.get("max_new_tokens"))
        extra, metrics = F.policy_regularizers(cfg, batch=batch, log_probs=log_probs, entropy=entropy)
        return loss + extra, metrics


def test_catches_a_rollout_is_cap_the_loss_never_applies():
    found = problems_of(UncappedGRPO(GRPOConfig()))
    assert "algorithm.rollout_is_cap changes nothing" in found
    assert "GRPOConfig.inert_fields" in found, "the message says what to do"


@dataclass
class LoggedConfig(GRPOConfig):
    log_scale: float = 1.0


class LoggedOnly(GRPO):
    """A knob that reaches only a metric is still a no-op: metrics are not compared."""

    Config = LoggedConfig

    def policy_loss(self, **kwargs):
        loss, metrics = super().policy_loss(**kwargs)
        return loss, {**metrics, "my/scaled_loss": self.config.log_scale * float(loss.detach())}


def test_a_field_that_only_reaches_a_metric_is_reported():
    assert "algorithm.log_scale changes nothing" in problems_of(LoggedOnly(LoggedConfig()))


@dataclass
class DeclaredConfig(GRPOConfig):
    inert_fields: ClassVar[dict[str, str]] = {"data_column": "names a data column; tested elsewhere",
                                              "log_scale": "only logged"}
    data_column: str = "answer"
    log_scale: float = 1.0


class Declared(LoggedOnly):
    Config = DeclaredConfig


def test_declared_fields_pass_and_stale_or_unknown_declarations_fail():
    assert problems_of(Declared(DeclaredConfig())) == ""

    @dataclass
    class Undeclared(GRPOConfig):
        data_column: str = "answer"

    assert "algorithm.data_column is a str" in problems_of(GRPO(Undeclared()))

    @dataclass
    class Stale(GRPOConfig):
        inert_fields: ClassVar[dict[str, str]] = {"entropy_coef": "wrongly claimed", "no_such_field": "typo"}
        inert_when: ClassVar[dict[tuple[str, str], str]] = {("eps", "nope"): "typo"}

    found = problems_of(GRPO(Stale()))
    assert "algorithm.entropy_coef is declared in inert_fields" in found and "remove the declaration" in found
    assert "'no_such_field', which is not a field" in found and "['nope']" in found


def test_inert_when_excuses_a_field_another_one_switches_off():
    # GRPOConfig's fields without its declaration ("eps", "norm_adv_by_std"): the pair is reported.
    @dataclass
    class NoPairs(PPOFamilyConfig):
        norm_adv_by_std: bool = True
        eps: float = 1e-6
        group_std: str = "bessel"

    found = problems_of(GRPO(NoPairs()))
    assert "algorithm.eps stops changing anything" in found and "algorithm.norm_adv_by_std = False" in found
