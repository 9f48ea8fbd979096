"""Each sample keeps its own prompt's images through shuffled draws, dynamic sampling (filtered groups
from several rounds joined), the greedy baseline, and the trainer's forward."""

from __future__ import annotations

import pytest
import torch

from verl_core import rollout_stage
from verl_core.dataflow import StepContext
from verl_core.contracts import ModelSpec, RolloutRequest, Role, SamplingParams, WorldInfo
from verl_core.sampler import PromptSampler
from verl_data import render_rows
from verl_env_vision.task import make_dataset
from verl_rollout_hf import HFRollout, HFRolloutConfig


@pytest.fixture(scope="module")
def rows(processor):
    train, _ = make_dataset(n_train=24, n_test=2)
    out, _ = render_rows(train, processor.tokenizer, processor=processor)
    return out


@pytest.fixture(scope="module")
def actor(vlm_dir):
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    worker = FSDPBackend(FSDPConfig()).create_worker(role=Role.ACTOR, model=ModelSpec(path=vlm_dir),
                                                     world=WorldInfo(), seed=0)
    yield worker
    worker.close()


class _OddIndexScorer:
    """Reward 1 for rows with an odd ``extra_info.index``: what the samples are scored on is their row."""

    def score(self, batch):
        scores = torch.tensor([float(e["index"] % 2) for e in batch.meta["extra_info"]])
        return scores, {}


def _check_aligned(batch, rows):
    """Every sample's image tensors are exactly its own row's (rows found by extra_info.index)."""
    by_index = {r["extra_info"]["index"]: r for r in rows}
    for i, (extra, vision) in enumerate(zip(batch.meta["extra_info"], batch.multi_modal_inputs)):
        own = by_index[extra["index"]]["prompt_ids"].multi_modal_inputs
        assert torch.equal(vision["pixel_values"], own["pixel_values"]), f"sample {i} carries another row's image"
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        assert prompt == list(by_index[extra["index"]]["prompt_ids"])


def test_images_follow_their_prompts_through_shuffled_draws_and_dynamic_sampling(rows, actor, processor, vlm_dir):
    sampler = PromptSampler(len(rows), 4, seed=3, shuffle=True)

    def draw():
        return [rows[i] for i in sampler.next_batch()]

    engine = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=vlm_dir), tokenizer=processor.tokenizer,
                       actor=actor)
    ctx = StepContext(step=1, prompts=draw(), algorithm=None, actor=actor, rollout=engine, reward=_OddIndexScorer(),
                      sampling=SamplingParams(n=2, max_new_tokens=3, seed=0), draw_prompts=draw)
    # Keep only the odd rows' groups: the 4 groups the step needs come from several rounds of draws.
    request = RolloutRequest(filter=lambda b: b.select([i for i, s in enumerate(b.scores.tolist()) if s == 1.0]),
                             max_extra_rounds=5, greedy_baseline=True)
    batch = rollout_stage.run(ctx, request)
    assert ctx.metrics["dynamic_sampling/rounds"] > 1 and len(batch) == 8
    assert all(e["index"] % 2 == 1 for e in batch.meta["extra_info"])
    _check_aligned(batch, rows)
    # The trainer's forward accepts the batch (its per-row image-token check) and the greedy
    # baseline, which regenerates from the batch's own prompts, found the images too.
    assert actor.compute_log_probs(batch).log_probs.shape == batch.response_ids.shape
    assert rollout_stage.BASELINE in batch.extras


def test_a_sample_whose_images_were_swapped_is_caught_by_the_alignment_check(rows):
    from verl_core.rollout_utils import build_batch
    from verl_core.contracts import RolloutOutput

    out = RolloutOutput(response_ids=[[1]] * 4, log_probs=None, finish_reasons=["stop"] * 4)
    batch = build_batch(rows[:2], out, n=2, pad_id=0)
    _check_aligned(batch, rows)
    swapped = batch.replace(multi_modal_inputs=batch.multi_modal_inputs[::-1])
    with pytest.raises(AssertionError, match="another row's image"):
        _check_aligned(swapped, rows)
