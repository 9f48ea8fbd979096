"""Per-sample vision inputs stay with their samples through every batch transform, shard and pickle."""

import pickle

import pytest
import torch

from verl_core.batch import Batch
from verl_core.contracts import PromptIds, RolloutEngine, RolloutOutput
from verl_core.rollout_utils import build_batch, check_rollout_multi_modal
from verl_core.testing import make_batch
from verl_kit.sharding import balance_batch, gather_split  # the executors' sharding (verl-kit)
from verl_kit.training import trim_padding  # the backends' (verl-kit)


def _vision(tag: int, patches: int) -> dict[str, torch.Tensor]:
    """Image tensors whose every value is ``tag``: which sample they belong to can be read back."""
    return {"pixel_values": torch.full((patches, 6), float(tag)),
            "image_grid_thw": torch.tensor([[1, 2, patches // 2]])}


def _tagged(n: int, *, seed: int = 0) -> Batch:
    """``n`` samples, sample ``i`` with group id ``i`` and images tagged ``i`` (varying patch counts)."""
    b = make_batch(batch_size=n, prompt_length=5, response_length=4, vocab_size=16, group_size=1, seed=seed)
    return b.replace(group_ids=torch.arange(n), multi_modal_inputs=[_vision(i, 2 * (1 + i % 3)) for i in range(n)])


def _aligned(batch: Batch) -> bool:
    return all(m and int(m["pixel_values"][0, 0]) == int(g) for m, g in zip(batch.multi_modal_inputs, batch.group_ids))


def test_select_split_chunk_and_concat_keep_images_with_their_samples():
    b = _tagged(10)
    assert _aligned(b.select([7, 2, 2, 9]))
    assert all(_aligned(part) for part in b.split(3)) and all(_aligned(part) for part in b.chunk(4))
    joined = Batch.concat([b.select([4, 1]), b.select([0, 8, 3])])
    assert _aligned(joined) and joined.group_ids.tolist() == [4, 1, 0, 8, 3]
    assert _aligned(trim_padding(b))


def test_concat_with_a_text_only_batch_fills_empty_inputs_and_selecting_them_back_works():
    images = _tagged(3)
    text = make_batch(batch_size=2, prompt_length=5, response_length=4, vocab_size=16, group_size=1, seed=3)
    joined = Batch.concat([text, images])
    assert joined.multi_modal_inputs[:2] == [{}, {}] and len(joined.multi_modal_inputs) == 5
    assert _aligned(joined.select([2, 3, 4]).replace(group_ids=torch.arange(3)))
    assert Batch.concat([text, text]).multi_modal_inputs == []


def test_a_batch_refuses_vision_inputs_that_do_not_match_its_samples():
    with pytest.raises(ValueError, match="one per sample"):
        make_batch(batch_size=4, seed=0).replace(multi_modal_inputs=[{}, {}])


def test_pickle_and_device_moves_carry_the_images():
    b = _tagged(6)
    back = pickle.loads(pickle.dumps(b))
    assert _aligned(back)
    assert torch.equal(back.multi_modal_inputs[5]["pixel_values"], b.multi_modal_inputs[5]["pixel_values"])
    moved = b.to("meta")
    assert all(t.device.type == "meta" for m in moved.multi_modal_inputs for t in m.values())


def test_balanced_shards_over_two_ranks_carry_their_samples_images_and_gather_back_in_order():
    b = _tagged(7)  # odd: one shard gets a padding sample
    shards, real, padded, order = balance_batch(b, 2)
    assert all(_aligned(s) for s in shards)
    gathered = gather_split([s.group_ids for s in shards], real=real, padded=padded, order=order)
    assert gathered.tolist() == list(range(7))


def test_build_batch_repeats_each_prompts_images_for_its_n_samples():
    prompts = [{"prompt_ids": PromptIds([1, 2, 3], multi_modal_data={"image": ["img0"]},
                                        multi_modal_inputs=_vision(0, 2))},
               {"prompt_ids": [4, 5]},  # text-only, in the same batch
               {"prompt_ids": PromptIds([6, 7], multi_modal_data={"image": ["img2"]},
                                        multi_modal_inputs=_vision(2, 4))}]
    out = RolloutOutput(response_ids=[[9]] * 6, log_probs=None, finish_reasons=["stop"] * 6)
    batch = build_batch(prompts, out, n=2, pad_id=0)
    tags = [int(m["pixel_values"][0, 0]) if m else None for m in batch.multi_modal_inputs]
    assert tags == [0, 0, None, None, 2, 2]
    assert batch.multi_modal_inputs[0] is batch.multi_modal_inputs[1]  # shared, not copied per sample


def test_prompt_ids_keep_their_images_when_extended_and_pickled():
    p = PromptIds([1, 2], multi_modal_data={"image": ["x"]}, multi_modal_inputs=_vision(3, 2))
    longer = p + [5, 6]
    assert list(longer) == [1, 2, 5, 6] and longer.multi_modal_data == {"image": ["x"]}
    back = pickle.loads(pickle.dumps(longer))
    assert list(back) == [1, 2, 5, 6] and int(back.multi_modal_inputs["pixel_values"][0, 0]) == 3
    assert PromptIds.inputs_of([1, 2]) == {}


class _TextOnlyEngine(RolloutEngine):
    def generate(self, prompt_ids, *, sampling):
        raise AssertionError("never reached")


def test_an_engine_that_cannot_take_images_is_refused_before_it_samples_text_alone():
    rows = [{"prompt_ids": PromptIds([1], multi_modal_data={"image": ["x"]})}, {"prompt_ids": [2]}]
    with pytest.raises(ValueError, match="1 prompts have images.*cannot take images"):
        check_rollout_multi_modal(_TextOnlyEngine, "text-engine", rows)
    check_rollout_multi_modal(_TextOnlyEngine, "text-engine", rows[1:])  # text-only rows pass


def test_balancing_weighs_the_vision_towers_patches_too():
    # Equal text lengths, so by tokens alone samples 0 and 2 would share a rank; they carry 40 image patches
    # each (the others 2), so they go to different ranks.
    b = _tagged(4).replace(multi_modal_inputs=[_vision(0, 40), _vision(1, 2), _vision(2, 40), _vision(3, 2)])
    b = b.replace(prompt_mask=torch.ones_like(b.prompt_mask), response_attention_mask=torch.ones_like(b.response_mask))
    shards, *_ = balance_batch(b, 2)
    assert all(_aligned(s) for s in shards)
    assert not any({0, 2} <= set(s.group_ids.tolist()) for s in shards)
    text_only, *_ = balance_batch(b.replace(multi_modal_inputs=[]), 2)
    assert any({0, 2} <= set(s.group_ids.tolist()) for s in text_only)
