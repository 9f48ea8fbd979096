"""Generic capabilities algorithm plugins build on: per-sample batch extras, the rollout stage's
dynamic sampling and greedy baselines, and batches built from data.

The rollout-stage tests use the real Hugging Face rollout on a freshly initialised tiny model and an
exact-match scorer (the core holds only the scorer contract; the reward manager is verl-rewards');
only the filters are test filters, so that which groups survive is known.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl_core.batch import Batch
from verl_core.dataflow import Dataflow, DataflowBuilder, DataflowError, Node, StepContext
from verl_core.contracts import ModelSpec, RewardScorer, RolloutRequest, SamplingParams
from verl_core.testing import make_batch, tiny_model_dir

torch.set_num_threads(1)


# --------------------------------------------------------------------------- Batch.extras
def test_extras_follow_select_split_and_concat():
    batch = make_batch(batch_size=4, group_size=2, response_length=6)
    batch = batch.replace(extras={"label": torch.tensor([1.0, 0.0, 1.0, 0.0]),
                                  "weights": torch.arange(24, dtype=torch.float32).view(4, 6)})
    picked = batch.select([2, 0])
    assert picked.extras["label"].tolist() == [1.0, 1.0]
    assert torch.equal(picked.extras["weights"], batch.extras["weights"][[2, 0]])
    parts = list(batch.split(3))
    assert [len(p.extras["label"]) for p in parts] == [3, 1]

    narrow = make_batch(batch_size=2, group_size=2, response_length=3, seed=1)
    narrow = narrow.replace(extras={"label": torch.tensor([5.0, 6.0]), "weights": torch.ones(2, 3)})
    joined = Batch.concat([batch, narrow])
    assert joined.extras["label"].tolist() == [1.0, 0.0, 1.0, 0.0, 5.0, 6.0]
    # 2-D extras are response-aligned: padded on the right with 0 up to the widest response.
    assert joined.extras["weights"].shape == (6, 6)
    assert joined.extras["weights"][4:, 3:].abs().sum() == 0 and joined.extras["weights"][4:, :3].sum() == 6


def test_concat_refuses_extras_on_only_some_batches():
    a = make_batch(batch_size=2, group_size=2).replace(extras={"label": torch.ones(2)})
    b = make_batch(batch_size=2, group_size=2, seed=1)
    with pytest.raises(ValueError, match="extras"):
        Batch.concat([a, b])
    with pytest.raises(ValueError, match="extras"):
        Batch.concat([b, a])


def test_nodes_write_single_extras_and_are_ordered_by_them():
    def produce(ctx):
        return make_batch(batch_size=2, group_size=2).replace(extras={"kept": torch.zeros(2)})

    flow = Dataflow([
        Node("gen", produce, writes=("batch",)),
        Node("use", lambda ctx: {"extras.total": ctx.batch.extras["base"] + 1}, reads=("extras.base",),
             writes=("extras.total",)),
        Node("base", lambda ctx: {"extras.base": torch.tensor([1.0, 2.0])}, writes=("extras.base",)),
    ])
    assert [[n.name for n in level] for level in flow.levels] == [["gen"], ["base"], ["use"]]
    ctx = flow.run(StepContext(step=1, prompts=[], algorithm=None, actor=None, rollout=None, reward=None,
                               sampling=None))
    assert ctx.batch.extras["total"].tolist() == [2.0, 3.0]
    assert "kept" in ctx.batch.extras  # other extras survive a node's write


def test_undeclared_extras_write_is_refused():
    flow = Dataflow([Node("gen", lambda ctx: make_batch(batch_size=2, group_size=2), writes=("batch",)),
                     Node("bad", lambda ctx: {"extras.x": torch.ones(2)}, writes=("extras.y",))])
    with pytest.raises(DataflowError, match="without declaring"):
        flow.run(StepContext(step=1, prompts=[], algorithm=None, actor=None, rollout=None, reward=None,
                             sampling=None))


def test_update_actor_reads_are_declared_by_the_algorithm():
    df = DataflowBuilder()
    df.batch_from_data(lambda ctx: make_batch())
    df.node("ref", lambda ctx: None, writes=("ref_log_probs",))
    from verl_algorithms.grpo import GRPO

    df.update_actor(GRPO(GRPO.Config()), reads=("ref_log_probs",))
    flow = df.build()
    assert [[n.name for n in level] for level in flow.levels] == [["batch_from_data"], ["ref"], ["update_actor"]]


# --------------------------------------------------------------------------- the rollout stage
class _KeepGroups:
    """A test filter that keeps the groups ``keep(round, group_ids)`` names."""

    def __init__(self, keep):
        self.keep = keep
        self.round = 0

    def __call__(self, batch):
        wanted = set(self.keep(self.round, sorted(set(batch.group_ids.tolist()))))
        self.round += 1
        return batch.select([i for i, g in enumerate(batch.group_ids.tolist()) if g in wanted])


@pytest.fixture(scope="module")
def engine_and_rows(tmp_path_factory):
    from transformers import AutoTokenizer

    from verl_data import tokenize_rows
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    tmp = tmp_path_factory.mktemp("capabilities")
    model_dir = tiny_model_dir(tmp)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=model_dir), tokenizer=tokenizer, actor=None)
    sums = [{"data_source": "sums", "prompt": [{"role": "user", "content": f"{a}+{a + 3}="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(2 * a + 3)}, "extra_info": {"index": a}}
            for a in range(10, 50)]
    rows, _ = tokenize_rows(sums, tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_length=64,
                            overlong="filter", apply_chat_template=True, source="test")
    yield engine, rows, ExactScorer(config=None, registry=None, tokenizer=tokenizer)
    engine.close()


class ExactScorer(RewardScorer):
    """1 when the decoded response is the ground truth: the rollout stage's side of a scorer."""

    def score(self, batch):
        texts = self.tokenizer.batch_decode(
            [ids[mask.bool()].tolist() for ids, mask in zip(batch.response_ids, batch.response_attention_mask)],
            skip_special_tokens=True)
        return self.score_texts(texts, batch.meta)

    def score_texts(self, responses, meta):
        truths = meta["ground_truth"]
        return torch.tensor([float(r.strip() == str(t).strip()) for r, t in zip(responses, truths)]), {}


def _context(engine, rows, reward, *, batch_prompts=4, n=2):
    pool = iter(range(batch_prompts, len(rows), batch_prompts))
    drawn = []

    def draw():
        start = next(pool)
        drawn.append(start)
        return rows[start:start + batch_prompts]

    ctx = StepContext(step=1, prompts=rows[:batch_prompts], algorithm=None, actor=None, rollout=engine,
                      reward=reward,
                      sampling=SamplingParams(n=n, max_new_tokens=4, seed=3), tokenizer=engine.tokenizer,
                      draw_prompts=draw)
    return ctx, drawn


def _run_generate_until_full(ctx, keep, max_extra_rounds):
    df = DataflowBuilder()
    df.rollout(RolloutRequest(filter=keep, max_extra_rounds=max_extra_rounds))
    return df.build().run(ctx)


def test_generate_until_full_draws_more_prompts_until_the_batch_is_full(engine_and_rows):
    engine, rows, reward = engine_and_rows
    # Round 0 keeps one group of four, every later round keeps two: full after round 2.
    algorithm = _KeepGroups(keep=lambda r, gids: gids[:1] if r == 0 else gids[:2])
    ctx, drawn = _context(engine, rows, reward)
    _run_generate_until_full(ctx, algorithm, max_extra_rounds=5)
    b = ctx.batch
    assert drawn == [4, 8]
    assert ctx.metrics["dynamic_sampling/rounds"] == 3.0
    assert ctx.metrics["dynamic_sampling/generated_samples"] == 3 * 4 * 2
    groups = list(dict.fromkeys(b.group_ids.tolist()))
    assert len(groups) == 4 and len(b) == 8  # trimmed to the step's 4 prompts x n=2
    # Groups from different rounds never share an id, and the kept prompts are the right rows.
    assert groups == [0, 4, 5, 8]
    texts = [b.meta["prompt_text"][i] for i in range(0, 8, 2)]
    assert texts == [rows[i]["prompt_text"] for i in (0, 4, 5, 8)]
    assert b.scores is not None and b.token_rewards.shape == b.response_ids.shape
    assert "reward/mean" in ctx.metrics


def test_generate_until_full_stops_at_the_cap_and_falls_back_to_unfiltered(engine_and_rows):
    engine, rows, reward = engine_and_rows
    algorithm = _KeepGroups(keep=lambda r, gids: [])
    ctx, drawn = _context(engine, rows, reward)
    _run_generate_until_full(ctx, algorithm, max_extra_rounds=2)
    assert len(drawn) == 2 and ctx.metrics["dynamic_sampling/rounds"] == 3.0
    assert ctx.metrics["dynamic_sampling/fallback_unfiltered"] == 1.0
    # The fallback is the step's own prompts, unfiltered.
    assert len(ctx.batch) == 8 and ctx.batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]

    algorithm = _KeepGroups(keep=lambda r, gids: gids[:1])
    ctx, drawn = _context(engine, rows, reward)
    _run_generate_until_full(ctx, algorithm, max_extra_rounds=1)
    assert ctx.metrics["dynamic_sampling/kept_groups"] == 2.0 and len(ctx.batch) == 4  # smaller batch at the cap


def test_greedy_baseline_scores_each_prompts_greedy_answer(engine_and_rows):
    engine, rows, reward = engine_and_rows
    ctx, _ = _context(engine, rows, reward, batch_prompts=3, n=2)
    df = DataflowBuilder()
    df.rollout(RolloutRequest(greedy_baseline=True))
    df.build().run(ctx)
    baseline = ctx.batch.extras["baseline_scores"]
    assert baseline.shape == (6,)
    # The baseline is what the reward gives the greedy answer of each sample's prompt.
    greedy = engine.generate([r["prompt_ids"] for r in rows[:3]],
                             sampling=dataclasses.replace(ctx.sampling, n=1, greedy=True))
    texts = engine.tokenizer.batch_decode(greedy.response_ids, skip_special_tokens=True)
    expected = [1.0 if t.strip() == rows[i]["ground_truth"] else 0.0 for i, t in enumerate(texts)]
    assert baseline.tolist() == [s for s in expected for _ in range(2)]
    assert ctx.metrics["baseline/greedy_reward_mean"] == pytest.approx(sum(expected) / 3)


def test_a_backend_without_a_role_the_run_needs_is_refused_before_any_model_loads():
    """Megatron builds no reward-model worker: a run with reward.reward_model on it stops at assembly, naming
    the backend, the role and what needs it; FSDP builds every role."""
    from verl_core.assembly import check_roles
    from verl_core.config import ConfigError
    from verl_core.contracts import Requirements, Role
    from verl_core.registry import PluginRegistry

    registry = PluginRegistry()
    fsdp = registry.load("backend", "fsdp")
    check_roles(fsdp, "fsdp", Requirements(critic=True, reference=True), "/models/rm")  # every role: no error
    megatron = registry.load("backend", "megatron")  # the class only: megatron-core is imported by its workers
    assert Role.REWARD_MODEL not in megatron.roles
    check_roles(megatron, "megatron", Requirements(critic=True, reference=True), None)
    with pytest.raises(ConfigError, match=r"backend 'megatron' builds no reward_model worker, which "
                                          r"reward.reward_model needs .*backend.name='fsdp'") as info:
        check_roles(megatron, "megatron", Requirements(), "/models/rm")
    assert info.value.path == "backend.name"
