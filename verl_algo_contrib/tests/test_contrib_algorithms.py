"""Each algorithm's advantages, loss, config and dataflow against small hand-computed cases."""

from __future__ import annotations

import decimal
import math

import pytest
import torch

from verl_algorithms.grpo import GRPO, GRPOConfig
from verl_core.batch import Batch
from verl_core.config import ConfigError, build_dataclass
from verl_core.dataflow import DataflowBuilder, StepContext
from verl_core.contracts import RolloutOutput, SamplingParams
from verl_core.kit import DataError
from verl_core.rollout_utils import build_batch
from verl_core.testing import EffectHarness
from verl_task_arithmetic.addition import build_tokenizer

from verl_algo_contrib.cispo import CISPO, CISPOConfig
from verl_algo_contrib.dapo import DAPO, DAPOConfig
from verl_algo_contrib.data import check_pairs_intact, write_addition_preferences
from verl_algo_contrib.drgrpo import DrGRPO, DrGRPOConfig
from verl_algo_contrib.gpg import GPG, GPGConfig
from verl_algo_contrib.gspo import GSPO, GSPOConfig
from verl_algo_contrib.opo import OPO, OPOConfig
from verl_algo_contrib.preference import DPO, DPOConfig, KTO, KTOConfig, ORPO, ORPOConfig
from verl_algo_contrib.reinforce_pp import (
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    ReinforcePlusPlusBaselineConfig,
    ReinforcePlusPlusConfig,
)
from verl_algo_contrib.remax import ReMax, ReMaxConfig
from verl_algo_contrib.rloo import RLOO, RLOOConfig
from verl_algo_contrib.spin import SPIN, SPINConfig


def batch_of(scores, groups, lengths, *, width=None, old=None, ref=None):
    """Right-padded responses of the given lengths (token id 5), one prompt token each."""
    width = width or max(lengths)
    B = len(scores)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    scores_t = torch.tensor(scores, dtype=torch.float32)
    from verl_algorithms.functional import scores_to_token_rewards

    return Batch(prompt_ids=torch.ones(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                 response_ids=5 * mask, response_attention_mask=mask, response_mask=mask.clone(),
                 group_ids=torch.tensor(groups), scores=scores_t,
                 token_rewards=scores_to_token_rewards(scores_t, mask), old_log_probs=old, ref_log_probs=ref)


def node_names(algorithm):
    df = DataflowBuilder()
    algorithm.build_dataflow(df)
    return [n.name for n in df.build().nodes]


# ----------------------------------------------------------------------------- GRPO family
def test_dapo_requests_dynamic_sampling_and_shapes_after_the_rollout():
    dapo = DAPO(DAPOConfig(max_extra_rounds=3))
    request = dapo.rollout_request()
    assert request.max_extra_rounds == 3 and not request.greedy_baseline
    kept = request.filter(batch_of([1, 1, 0, 1], [0, 0, 1, 1], [1, 1, 1, 1]))
    assert kept.group_ids.tolist() == [1, 1]  # the all-equal group 0 carries no gradient
    assert node_names(dapo)[:3] == ["rollout", "overlong_shaping", "old_log_probs"]
    plain = DAPO(DAPOConfig(dynamic_sampling=False, overlong_buffer_len=0))
    assert plain.rollout_request().filter is None
    assert node_names(plain)[:2] == ["rollout", "old_log_probs"]


def test_dapo_clips_higher_than_grpo():
    # One token each: ratio 1.25 with a positive advantage, ratio 1 with a negative one.
    b = batch_of([1, 0], [0, 0], [1, 1])
    a = 1 / math.sqrt(2)  # GRPO advantages of rewards (1, 0)
    old = torch.zeros(2, 1)
    lp = torch.tensor([[math.log(1.25)], [0.0]])
    losses = {}
    for alg in (DAPO(DAPOConfig()), GRPO(GRPOConfig())):
        adv, _ = alg.compute_advantages(b)
        losses[type(alg).__name__], _ = alg.policy_loss(batch=b.replace(advantages=adv, old_log_probs=old),
                                                        log_probs=lp, entropy=None)
    # DAPO's upper clip 1 + 0.28 keeps 1.25; GRPO's 1 + 0.2 clips it. Token-mean over the 2 tokens.
    assert float(losses["DAPO"]) == pytest.approx((-a * 1.25 + a * 1.0) / 2, rel=1e-5)
    assert float(losses["GRPO"]) == pytest.approx((-a * 1.2 + a * 1.0) / 2, rel=1e-5)


def test_dapo_overlong_shaping_node():
    dapo = DAPO(DAPOConfig(overlong_buffer_len=4, overlong_penalty_factor=1.0))
    b = batch_of([1, 1, 0], [0, 0, 0], [5, 8, 10], width=10)
    b.info["max_new_tokens"] = 10
    ctx = StepContext(step=1, prompts=[], algorithm=dapo, actor=None, rollout=None, reward=None,
                      sampling=SamplingParams(max_new_tokens=10), batch=b)
    out = dapo._shape_overlong(ctx)
    assert out["scores"].tolist() == pytest.approx([1.0, 0.5, -1.0])
    assert out["token_rewards"][1, 7].item() == pytest.approx(0.5)  # on the last token
    # A buffer as large as the budget turns shaping off, with a warning instead of punishing every answer.
    wide = DAPO(DAPOConfig())
    with pytest.warns(UserWarning, match="overlong_buffer_len=4096"):
        assert wide._shape_overlong(ctx) is None
    assert ctx.metrics["dapo/overlong_shaping_active"] == 0.0


def test_drgrpo_advantage_and_constant_length_normalisation():
    alg = DrGRPO(DrGRPOConfig())
    b = batch_of([1, 0, 0, 0], [0, 0, 0, 0], [2, 1, 1, 1], width=2)
    adv, _ = alg.compute_advantages(b)
    assert adv[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])  # r - mean, no std
    b = b.replace(advantages=adv, old_log_probs=torch.zeros(4, 2))
    b.info["max_new_tokens"] = 8
    loss, _ = alg.policy_loss(batch=b, log_probs=torch.zeros(4, 2), entropy=None)
    # Ratio 1: per-sequence token sums [-1.5, 0.25, 0.25, 0.25] / 8, mean over 4 sequences.
    assert float(loss) == pytest.approx((-1.5 + 0.75) / 8 / 4)


# GSPO by hand: rewards (1, 0, 0) give GRPO advantages (2, -1, -1) / sqrt(3). Each row's token
# log-ratios average to the log of its sequence ratio s = (0.5, 1.5, e^0.2); the token ratios
# themselves differ, so a token-level ratio would give another loss.
GSPO_ADV = [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]
GSPO_S = [0.5, 1.5, math.exp(0.2)]
GSPO_LOG_RATIO = torch.tensor([[math.log(0.5) - 0.3, math.log(0.5) + 0.3],
                               [math.log(1.5) - 0.1, math.log(1.5) + 0.1],
                               [0.1, 0.3]])


def gspo_case():
    b = batch_of([1, 0, 0], [0, 0, 0], [2, 2, 2])
    gspo = GSPO(GSPOConfig())
    adv, _ = gspo.compute_advantages(b)
    assert adv[:, 0].tolist() == pytest.approx(GSPO_ADV, rel=1e-5)
    old = torch.full((3, 2), -1.0)
    return gspo, b.replace(advantages=adv, old_log_probs=old), old + GSPO_LOG_RATIO


def gspo_sequence_losses():
    low, high = 1 - 3e-4, 1 + 4e-4  # the paper's clip range of the sequence ratio
    return [max(-a * s, -a * min(max(s, low), high)) for a, s in zip(GSPO_ADV, GSPO_S)]


def test_gspo_clips_one_length_normalised_ratio_per_sequence():
    gspo, b, lp = gspo_case()
    loss, metrics = gspo.policy_loss(batch=b, log_probs=lp, entropy=None)
    # All three sequence ratios are outside the tiny clip range on the side where PPO keeps the
    # unclipped term: -A s for each, averaged over sequences (seq-mean-token-mean).
    per_seq = gspo_sequence_losses()
    assert per_seq == pytest.approx([-GSPO_ADV[0] * 0.5, -GSPO_ADV[1] * 1.5, -GSPO_ADV[2] * math.exp(0.2)])
    assert float(loss) == pytest.approx(sum(per_seq) / 3, rel=1e-5)  # 0.331, not 0
    assert metrics["ppo/seq_ratio_mean"] == pytest.approx(sum(GSPO_S) / 3, rel=1e-5)


def test_cispo_keeps_the_gradient_of_tokens_whose_weight_is_clipped():
    b = batch_of([1, 0], [0, 0], [2, 2])
    cispo = CISPO(CISPOConfig())  # weight clipped to [1 - 1.0, 1 + 4.0]
    adv, _ = cispo.compute_advantages(b)
    a = [1 / math.sqrt(2), -1 / math.sqrt(2)]
    old = torch.tensor([[-1.0, -1.0], [-1.0, -2.0]])
    lp = torch.tensor([[-0.5, -2.0], [-1.0, -0.3]], requires_grad=True)
    loss, _ = cispo.policy_loss(batch=b.replace(advantages=adv, old_log_probs=old), log_probs=lp, entropy=None)
    # Weights exp(lp - old) = e^0.5, e^-1, 1, e^1.7 -> the last clipped to 5; loss -w A lp, token-mean.
    w = [[math.exp(0.5), math.exp(-1.0)], [1.0, 5.0]]
    lps = [[-0.5, -2.0], [-1.0, -0.3]]
    expected = sum(-w[i][t] * a[i] * lps[i][t] for i in range(2) for t in range(2)) / 4
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)  # -0.166
    loss.backward()
    # d/d lp = -w A / 4 for every token, the clipped one included (PPO's clip would zero it).
    assert lp.grad.flatten().tolist() == pytest.approx([-w[i][t] * a[i] / 4 for i in range(2) for t in range(2)],
                                                       rel=1e-5)


# ----------------------------------------------------------------------------- rollout importance sampling
# Rollout log-probs below/above the trainer's by d: per-token weights min(exp(d), cap) with cap 1.5.
IS_D = torch.tensor([[0.5, 0.0], [0.0, -1.0], [0.2, 0.2]])


def is_weights(d, cap=1.5):
    return [[min(math.exp(x), cap) for x in row] for row in d.tolist()]


def test_gspo_applies_rollout_is_cap():
    _, b, lp = gspo_case()
    capped = GSPO(GSPOConfig(rollout_is_cap=1.5))
    loss, metrics = capped.policy_loss(batch=b.replace(rollout_log_probs=b.old_log_probs - IS_D), log_probs=lp,
                                       entropy=None)
    w = is_weights(IS_D)
    expected = sum(l * sum(ws) / 2 for l, ws in zip(gspo_sequence_losses(), w)) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(loss) != pytest.approx(sum(gspo_sequence_losses()) / 3, rel=1e-3)  # the uncapped loss
    assert metrics["ppo/rollout_is_weight_mean"] == pytest.approx(sum(map(sum, w)) / 6, rel=1e-5)


def test_cispo_applies_rollout_is_cap():
    b = batch_of([1, 0], [0, 0], [2, 2])
    a = [1 / math.sqrt(2), -1 / math.sqrt(2)]
    old = torch.full((2, 2), -1.0)
    lp = torch.tensor([[-0.5, -2.0], [-1.0, -1.2]])
    capped = CISPO(CISPOConfig(rollout_is_cap=1.5))
    adv, _ = capped.compute_advantages(b)
    b = b.replace(advantages=adv, old_log_probs=old, rollout_log_probs=old - IS_D[:2])
    loss, _ = capped.policy_loss(batch=b, log_probs=lp, entropy=None)
    w = is_weights(IS_D[:2])
    ratio = torch.exp(lp - old).clamp(0.0, 5.0).tolist()
    expected = sum(-w[i][t] * ratio[i][t] * a[i] * lp[i, t].item() for i in range(2) for t in range(2)) / 4
    uncapped = sum(-ratio[i][t] * a[i] * lp[i, t].item() for i in range(2) for t in range(2)) / 4
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(uncapped, rel=1e-3)


def test_gpg_applies_rollout_is_cap_against_the_current_policy():
    b = batch_of([1, 0, 1, 1], [0, 0, 1, 1], [2, 2, 1, 1])
    capped = GPG(GPGConfig(rollout_is_cap=1.5))
    adv, _ = capped.compute_advantages(b)  # (1, -1, 0, 0): the equal group scales the others by 4 / 2
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -1.5], [-1.0, 0.0], [-1.0, 0.0]])
    # On-policy: the weights compare the rollout's log-probs with the current (detached) ones.
    d = torch.tensor([[math.log(2.0), math.log(0.5)], [0.0, math.log(3.0)], [0.0, 0.0], [0.0, 0.0]])
    b = b.replace(advantages=adv, rollout_log_probs=lp - d)
    loss, _ = capped.policy_loss(batch=b, log_probs=lp, entropy=None)
    w = is_weights(d)  # [[1.5, 0.5], [1, 1.5], ...]
    # Token-mean of -A w lp over the 6 real tokens: (1.5 + 1.0) and (-0.5 - 2.25).
    assert float(loss) == pytest.approx((2.5 - 2.75) / 6, rel=1e-5)
    assert w[0] == pytest.approx([1.5, 0.5]) and w[1] == pytest.approx([1.0, 1.5])
    uncapped, _ = GPG(GPGConfig()).policy_loss(batch=b, log_probs=lp, entropy=None)
    assert float(uncapped) == pytest.approx((3.0 - 2.0) / 6, rel=1e-5)


@pytest.mark.parametrize("cls", [GSPO, CISPO, GPG])
def test_constant_length_normalisation_divides_by_the_response_budget(cls):
    # Dr. GRPO's aggregation: per-response token sums over a constant, the rollout's max_new_tokens,
    # not the (micro-)batch's width, which trimming changes from one micro-batch to the next.
    alg = cls(cls.Config(loss_agg_mode="seq-mean-token-sum-norm"))
    b = batch_of([1, 0, 0], [0, 0, 0], [2, 1, 2])
    adv, _ = alg.compute_advantages(b)
    old = torch.full((3, 2), -1.0)
    lp = old + torch.tensor([[0.3, -0.2], [0.5, 0.0], [-0.4, 0.1]])
    b = b.replace(advantages=adv, old_log_probs=old)
    with pytest.raises(ValueError, match="max_new_tokens"):  # the width (2) would change with each micro-batch
        alg.policy_loss(batch=b, log_probs=lp, entropy=None)
    b.info["max_new_tokens"] = 2
    by_width, _ = alg.policy_loss(batch=b, log_probs=lp, entropy=None)
    b.info["max_new_tokens"] = 8
    by_budget, _ = alg.policy_loss(batch=b, log_probs=lp, entropy=None)
    assert float(by_width) != 0 and float(by_budget) == pytest.approx(float(by_width) * 2 / 8, rel=1e-5)


# ----------------------------------------------------------------------------- REINFORCE family
def test_rloo_advantages_use_kl_shaped_rewards():
    alg = RLOO(RLOOConfig())
    b = batch_of([1, 0, 0], [0, 0, 0], [1, 1, 1])
    adv, _ = alg.compute_advantages(b)
    assert adv[:, 0].tolist() == pytest.approx([1.0, -0.5, -0.5])
    shaped = b.replace(token_rewards=b.token_rewards - torch.tensor([[0.3], [0.0], [0.0]]))
    adv, _ = alg.compute_advantages(shaped)
    assert adv[:, 0].tolist() == pytest.approx([0.7, -0.35, -0.35])


def test_reinforce_pp_returns_whitened_over_the_batch():
    alg = ReinforcePlusPlus(ReinforcePlusPlusConfig())
    # The KL is folded into the token rewards (a reference and a kl_reward node) before the returns.
    assert alg.requirements().reference and "kl_reward" in node_names(alg)
    b = batch_of([1, 0], [0, 1], [2, 2])
    b = b.replace(token_rewards=torch.tensor([[-0.5, 1.0], [0.0, 0.0]]))
    adv, returns = alg.compute_advantages(b)
    assert returns.tolist() == [[0.5, 1.0], [0.0, 0.0]]
    values = torch.tensor([0.5, 1.0, 0.0, 0.0])
    expected = (values - values.mean()) / values.var(unbiased=False).sqrt()
    assert adv.flatten().tolist() == pytest.approx(expected.tolist(), abs=1e-4)

    base = ReinforcePlusPlusBaseline(ReinforcePlusPlusBaselineConfig())
    b = batch_of([1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1])
    adv, _ = base.compute_advantages(b)
    assert adv[:, 0].tolist() == pytest.approx([math.sqrt(2), -math.sqrt(2), 0, 0], abs=1e-4)
    # The baseline variant's KL is a loss term with the k2 estimator: 0.001 * mean(0.5 (lp - ref)^2).
    assert "kl_reward" not in node_names(base)
    lp = torch.full((4, 1), -1.0)
    ref = torch.tensor([[-1.0], [-2.0], [-1.5], [-3.0]])
    _, metrics = base.policy_loss(batch=b.replace(advantages=adv, old_log_probs=lp, ref_log_probs=ref), log_probs=lp,
                                  entropy=None)
    assert metrics["ppo/kl_loss"] == pytest.approx((0 + 0.5 + 0.125 + 2.0) / 4)


def test_remax_uses_the_greedy_baseline():
    alg = ReMax(ReMaxConfig())
    assert alg.rollout_request().greedy_baseline and node_names(alg)[0] == "rollout"
    b = batch_of([1, 0, 1], [0, 0, 1], [2, 1, 1])
    with pytest.raises(ValueError, match="greedy_baseline"):
        alg.compute_advantages(b)
    adv, returns = alg.compute_advantages(b.replace(extras={"baseline_scores": torch.tensor([1.0, 1.0, 0.0])}))
    assert adv.tolist() == [[0.0, 0.0], [-1.0, 0.0], [1.0, 0.0]]
    assert returns.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]


def test_gpg_is_on_policy_without_old_log_probs():
    alg = GPG(GPGConfig())
    assert "old_log_probs" not in node_names(alg)
    with pytest.raises(ConfigError, match="algorithm.epochs"):
        build_dataclass(GPGConfig, {"epochs": 2}, "algorithm")
    with pytest.raises(ConfigError, match="algorithm.clip_ratio_high: GPG's loss has no importance ratio"):
        build_dataclass(GPGConfig, {"clip_ratio_high": 0.28}, "algorithm")
    b = batch_of([1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1])
    adv, _ = alg.compute_advantages(b)
    assert adv[:, 0].tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])
    lp = torch.full((4, 1), -2.0, requires_grad=True)
    loss, _ = alg.policy_loss(batch=b.replace(advantages=adv), log_probs=lp, entropy=None)
    assert float(loss.detach()) == pytest.approx(0.0)
    loss.backward()
    assert lp.grad[:, 0].tolist() == pytest.approx([-0.25, 0.25, 0.0, 0.0])


def test_opo_length_weighted_baseline():
    alg = OPO(OPOConfig())
    # Strictly on-policy: the backend is asked for one pass over the whole batch.
    assert EffectHarness().measure(alg).updates == [("actor", 0, 1)]
    adv, _ = alg.compute_advantages(batch_of([1, 0], [0, 0], [2, 4]))
    assert adv[0, 0].item() == pytest.approx(2 / 3) and adv[1, 0].item() == pytest.approx(-1 / 3)


# ----------------------------------------------------------------------------- offline: batches from data
@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def prompt_rows(tokenizer, raws):
    from verl_data import tokenize_rows

    rows, _ = tokenize_rows(raws, tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_length=16,
                            overlong="filter", apply_chat_template=True, source="test")
    return rows


def ctx_for(rows, tokenizer, algorithm, batch=None):
    return StepContext(step=1, prompts=rows, algorithm=algorithm, actor=None, rollout=None, reward=None,
                       sampling=SamplingParams(), tokenizer=tokenizer, batch=batch)


def test_dpo_builds_pairs_and_matches_the_hand_loss(tokenizer):
    dpo = DPO(DPOConfig(beta=0.5))
    assert node_names(dpo) == ["preference_data", "ref_log_probs", "update_actor"]
    rows = prompt_rows(tokenizer, [{"prompt": "12+34=", "chosen": "46", "rejected": "47"},
                                   {"prompt": "50+50=", "chosen": "100", "rejected": "10"}])
    b = dpo.build_batch(ctx_for(rows, tokenizer, dpo))
    assert b.group_ids.tolist() == [0, 0, 1, 1] and b.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    decoded = tokenizer.batch_decode([ids[m.bool()].tolist() for ids, m in zip(b.response_ids, b.response_mask)])
    assert decoded == ["46<eos>", "47<eos>", "100<eos>", "10<eos>"]
    assert b.finish_reasons == ["stop"] * 4 and b.info["paired_groups"]
    assert tokenizer.decode(b.prompt_ids[2][b.prompt_mask[2].bool()]) == "<bos>50+50="

    # Log-ratios (policy - reference, summed per response) 1, -1 for pair 0 and 0, 0 for pair 1.
    lp = torch.zeros(b.response_ids.shape)
    ref = torch.zeros_like(lp)
    lp[0, 0], lp[1, 0] = 1.0, -1.0
    b = b.replace(ref_log_probs=ref)
    loss, metrics = dpo.policy_loss(batch=b, log_probs=lp, entropy=None)
    expected = (math.log(1 + math.exp(-1.0)) + math.log(2.0)) / 2
    assert float(loss) == pytest.approx(expected)
    assert metrics["preference/accuracy"] == 0.5 and metrics["preference/margin"] == pytest.approx(0.5)
    # Micro-batches must not cut a pair in two.
    with pytest.raises(ValueError, match="micro_batch_size"):
        check_pairs_intact(b.select([0, 1, 2]))


def test_preference_data_errors_name_the_column_and_setting(tokenizer):
    from verl_data import DataError

    dpo = DPO(DPOConfig())
    rows = prompt_rows(tokenizer, [{"prompt": "12+34=", "good": "46", "rejected": "47"}])
    with pytest.raises(DataError, match=r"no 'chosen' column.*algorithm\.chosen_key"):
        dpo.build_batch(ctx_for(rows, tokenizer, dpo))
    with pytest.raises(ConfigError, match="algorithm.mini_batch_size"):
        build_dataclass(DPOConfig, {"mini_batch_size": 3}, "algorithm")


def decoded_responses(tokenizer, b):
    return tokenizer.batch_decode([ids[m.bool()].tolist() for ids, m in zip(b.response_ids, b.response_mask)])


# The data-column settings act only while the batch is built from data rows, which the
# conformance suite's config check stands in for (they are declared in inert_fields): checked here.
def test_preference_columns_and_response_cut_are_read_from_the_data(tokenizer):
    dpo = DPO(DPOConfig(chosen_key="good", rejected_key="bad", max_response_length=2))
    rows = prompt_rows(tokenizer, [{"prompt": "50+50=", "good": "100", "bad": "10", "chosen": "1", "rejected": "2"}])
    assert decoded_responses(tokenizer, dpo.build_batch(ctx_for(rows, tokenizer, dpo))) == ["10", "10"]

    kto = KTO(KTOConfig(completion_key="text", label_key="ok"))
    rows = prompt_rows(tokenizer, [{"prompt": "12+34=", "text": "46", "ok": True},
                                   {"prompt": "50+50=", "text": "10", "ok": False}])
    b = kto.build_batch(ctx_for(rows, tokenizer, kto))
    assert decoded_responses(tokenizer, b)[::2] == ["46<eos>", "10<eos>"] and b.scores.tolist()[::2] == [1.0, 0.0]


def test_kto_labels_keep_their_value_for_the_threshold_and_a_text_label_is_refused(tokenizer):
    # Labels were turned into bool before the threshold saw them: any threshold gave the same run, and "false" was True.
    rows = prompt_rows(tokenizer, [{"prompt": "12+34=", "completion": "46", "label": decimal.Decimal("0.9")},
                                   {"prompt": "50+50=", "completion": "10", "label": 0.3}])
    for threshold, desirable in ((0.5, [True, False]), (0.2, [True, True]), (0.95, [False, False])):
        kto = KTO(KTOConfig(desirable_threshold=threshold))
        b = kto.build_batch(ctx_for(rows, tokenizer, kto))
        assert b.scores.tolist()[::2] == pytest.approx([0.9, 0.3])
        lp = torch.zeros(b.response_ids.shape)
        _, metrics = kto.policy_loss(batch=b.replace(ref_log_probs=lp), log_probs=lp + 0.1, entropy=None)
        # The rewards are beta * 0.1 per token; a class with no example reports 0.
        assert (metrics["kto/desirable_reward"] != 0, metrics["kto/undesirable_reward"] != 0) == (
            any(desirable), not all(desirable))
    kto = KTO(KTOConfig())
    for bad in ("false", None, float("nan")):
        text = prompt_rows(tokenizer, [{"prompt": "12+34=", "completion": "46", "label": bad}])
        with pytest.raises(DataError, match="'label' column holds"):
            kto.build_batch(ctx_for(text, tokenizer, kto))


def test_spin_target_key_picks_the_target_column(tokenizer):
    spin = SPIN(SPINConfig(target_key="sft", max_response_length=1))
    rows = prompt_rows(tokenizer, [{"prompt": "12+34=", "answer": "46", "sft": "45"}])
    gen = tokenizer("47", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    generated = build_batch(rows, RolloutOutput([gen], None, ["stop"]), n=1, pad_id=0)
    out = spin.pair_with_targets(ctx_for(rows, tokenizer, spin, batch=generated))
    assert decoded_responses(tokenizer, out) == ["4", "47<eos>"]  # the "sft" column, cut to 1 token


def test_kto_unary_rows_and_mismatched_kl_rows(tokenizer):
    kto = KTO(KTOConfig(beta=1.0))
    rows = prompt_rows(tokenizer, [{"prompt": "12+34=", "completion": "46", "label": True},
                                   {"prompt": "50+50=", "completion": "10", "label": False}])
    b = kto.build_batch(ctx_for(rows, tokenizer, kto))
    decoded = tokenizer.batch_decode([ids[m.bool()].tolist() for ids, m in zip(b.response_ids, b.response_mask)])
    # Each example, then its prompt with the next example's completion (the KL estimate's row).
    assert decoded == ["46<eos>", "10<eos>", "10<eos>", "46<eos>"]
    assert b.extras["kl_row"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert b.scores.tolist() == [1.0, 0.0, 0.0, 0.0]

    # Log-ratios: examples 2 and -1; KL rows 0.5 and 1.5, so z = 1.
    lp = torch.zeros(b.response_ids.shape)
    lp[:, 0] = torch.tensor([2.0, 0.5, -1.0, 1.5])
    loss, metrics = kto.policy_loss(batch=b.replace(ref_log_probs=torch.zeros_like(lp)), log_probs=lp, entropy=None)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert metrics["kto/kl_reference"] == pytest.approx(1.0)
    assert float(loss) == pytest.approx(((1 - sig(2 - 1)) + (1 - sig(1 - (-1)))) / 2)

    # Pair rows give one desirable and one undesirable example each.
    pairs = prompt_rows(tokenizer, [{"prompt": "12+34=", "chosen": "46", "rejected": "47"}])
    b = kto.build_batch(ctx_for(pairs, tokenizer, kto))
    assert len(b) == 4 and b.scores.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_orpo_needs_no_reference_and_matches_the_hand_loss(tokenizer):
    orpo = ORPO(ORPOConfig(beta=0.1))
    assert not orpo.requirements().reference
    assert node_names(orpo) == ["preference_data", "update_actor"]
    rows = prompt_rows(tokenizer, [{"prompt": "12+34=", "chosen": "46", "rejected": "47"}])
    b = orpo.build_batch(ctx_for(rows, tokenizer, orpo))
    # Every token of the chosen response at log 0.5, of the rejected at log 0.2.
    lp = torch.stack([torch.full((b.response_length,), math.log(0.5)), torch.full((b.response_length,), math.log(0.2))])
    loss, metrics = orpo.policy_loss(batch=b, log_probs=lp, entropy=None)
    assert float(loss) == pytest.approx(-math.log(0.5) + 0.1 * math.log(1.25))
    assert metrics["orpo/log_odds_ratio"] == pytest.approx(math.log(4.0))


def test_spin_pairs_each_sample_with_its_target(tokenizer):
    spin = SPIN(SPINConfig(beta=1.0))
    assert node_names(spin) == ["rollout", "pair_with_targets", "old_log_probs", "update_actor"]
    rows = prompt_rows(tokenizer, [{"prompt": "12+34=", "answer": "46"}, {"prompt": "50+50=", "answer": "100"}])
    gen = [tokenizer("47", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
           tokenizer("46", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
           tokenizer("9", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    generated = build_batch(rows, RolloutOutput([gen[0], gen[1], gen[2], gen[2]], None, ["stop"] * 4), n=2, pad_id=0)
    out = spin.pair_with_targets(ctx_for(rows, tokenizer, spin, batch=generated))
    decoded = tokenizer.batch_decode([ids[m.bool()].tolist() for ids, m in zip(out.response_ids, out.response_mask)])
    assert decoded == ["46<eos>", "47<eos>", "46<eos>", "46<eos>", "100<eos>", "9<eos>", "100<eos>", "9<eos>"]
    assert out.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]

    # Opponent = old log-probs. Pair 0: target +1 vs sample -1 (relative to the opponent); the
    # sample identical to its target (pair 1) has equal log-ratios.
    old = torch.zeros(out.response_ids.shape)
    lp = old.clone()
    lp[0, 0], lp[1, 0] = 1.0, -1.0
    loss, metrics = spin.policy_loss(batch=out.replace(old_log_probs=old), log_probs=lp, entropy=None)
    assert float(loss) == pytest.approx((math.log(1 + math.exp(-2.0)) + 3 * math.log(2.0)) / 4)
    assert metrics["spin/pairs"] == 4


def test_write_addition_preferences(tmp_path):
    import json

    path = write_addition_preferences(tmp_path / "pairs.jsonl", rows=50, seed=1)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 50
    for line in lines:
        a, b = line["prompt"].rstrip("=").split("+")
        assert line["chosen"] == str(int(a) + int(b)) and line["rejected"] != line["chosen"]
    unary = [json.loads(x) for x in write_addition_preferences(tmp_path / "u.jsonl", rows=5, unary=True)
             .read_text().splitlines()]
    assert [u["label"] for u in unary] == [True, False] * 5


def test_a_dpo_run_saved_before_core_v2_still_resolves_for_resume(tmp_path):
    """Old runs wrote every PPO knob into config.toml, whatever the algorithm; DPO takes none now."""
    from verl_core.config import ConfigError, resolve_config
    from verl_core.registry import PluginRegistry
    from verl_core.run_state import saved_config

    registry = PluginRegistry()
    section = {"name": "dpo", "beta": 0.2, "clip_ratio_low": 0.2, "kl_coef": 0.0, "loss_agg_mode": "token-mean",
               "use_rollout_log_probs": False}
    cfg = resolve_config({"algorithm": registry.load("algorithm", "dpo").saved_settings(section)}, registry)
    assert cfg.algorithm.config.beta == 0.2
    # Through a resume: the core hands the saved section to the algorithm before the config check.
    from verl_run_store import LocalRunStore

    (tmp_path / "config.toml").write_text('[algorithm]\nname = "dpo"\nbeta = 0.2\nkl_coef = 0.0\n'
                                          'clip_ratio_low = 0.2\n')
    LocalRunStore(tmp_path).save(1, lambda d: (d / "state.txt").write_text("1"), info={})
    assert saved_config(tmp_path, [], registry, given=set()).algorithm.config.beta == 0.2
    # A knob that was set to something else meant something to the user: refused by name.
    with pytest.raises(ConfigError, match="algorithm.kl_coef: unknown key"):
        resolve_config({"algorithm": registry.load("algorithm", "dpo").saved_settings({**section, "kl_coef": 0.1})},
                       registry)
