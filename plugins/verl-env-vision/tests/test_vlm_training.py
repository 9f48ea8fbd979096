"""The FSDP backend and the HF rollout on a real Qwen2-VL: log-probs through the whole VLM (and its
mRoPE), parity with generation, updates with and without the vision tower, and the HF export."""

import pytest
import torch

from verl_data import render_rows
from verl_core.contracts import ModelSpec, Role, SamplingParams, WorldInfo
from verl_core.rollout_utils import generate_batch
from verl_env_vision.task import make_dataset
from verl_rollout_hf import HFRollout, HFRolloutConfig


@pytest.fixture(scope="module")
def rows(processor):
    train, _ = make_dataset(n_train=12, n_test=2)
    # Image prompts and one text-only prompt in the same batch.
    out, _ = render_rows(train[:5] + [{"prompt": "a text-only prompt", "answer": "red"}], processor.tokenizer,
                         processor=processor)
    return out


def _worker(vlm_dir, **settings):
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    backend = FSDPBackend(FSDPConfig(lr=1e-2, **settings))
    return backend.create_worker(role=Role.ACTOR, model=ModelSpec(path=vlm_dir), world=WorldInfo(), seed=0)


@pytest.fixture(scope="module")
def actor(vlm_dir):
    worker = _worker(vlm_dir)
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def sampled(actor, processor, vlm_dir, rows):
    engine = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=vlm_dir), tokenizer=processor.tokenizer,
                       actor=actor)
    return generate_batch(engine, rows, SamplingParams(n=3, max_new_tokens=6, seed=1))


def test_hf_rollout_log_probs_match_the_trainers_through_the_vision_tower(actor, sampled):
    assert type(actor.module).__name__ == "Qwen2VLForConditionalGeneration"
    assert len(sampled.multi_modal_inputs) == len(sampled) == 18 and sampled.multi_modal_inputs[-1] == {}
    trainer = actor.compute_log_probs(sampled).log_probs
    gap = ((trainer - sampled.rollout_log_probs).abs() * sampled.response_mask).max()
    assert float(gap) <= 1e-4, float(gap)


def test_the_trainers_log_probs_depend_on_each_samples_own_image(actor, sampled):
    base = actor.compute_log_probs(sampled).log_probs
    # Sample 0's image swapped for another prompt's: only sample 0's log-probs move.
    swapped = list(sampled.multi_modal_inputs)
    swapped[0] = sampled.multi_modal_inputs[3]
    moved = actor.compute_log_probs(sampled.replace(multi_modal_inputs=swapped)).log_probs
    diff = ((moved - base).abs() * sampled.response_mask).amax(-1)
    assert float(diff[0]) > 1e-3 and float(diff[1:].max()) < 1e-5
    # Without any image tensors the VLM's forward cannot run on image prompts: no silent text-only pass.
    with pytest.raises(ValueError, match="row 0 of the batch holds 16 image tokens, and its images .* give 0"):
        actor.compute_log_probs(sampled.replace(multi_modal_inputs=[]))
    misaligned = [{}] + list(sampled.multi_modal_inputs[:-1])  # shifted by one sample
    with pytest.raises(ValueError, match="lost or misaligned"):
        actor.compute_log_probs(sampled.replace(multi_modal_inputs=misaligned))


def _advantaged(batch, log_probs):
    adv = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(0)).expand_as(log_probs).clone()
    return batch.replace(advantages=adv, old_log_probs=log_probs)


def _loss(*, batch, log_probs, entropy=None, values=None):
    loss = -(log_probs * batch.advantages * batch.response_mask).sum() / batch.response_mask.sum()
    return loss, {"loss": float(loss.detach())}


@pytest.mark.parametrize("freeze", [False, True])
def test_an_update_trains_the_vision_tower_unless_it_is_frozen(vlm_dir, sampled, freeze):
    worker = _worker(vlm_dir, freeze_vision_tower=freeze)
    try:
        before = {n: p.detach().clone() for n, p in worker.module.named_parameters()}
        lp = worker.compute_log_probs(sampled).log_probs
        worker.update_policy(_advantaged(sampled, lp), loss_fn=_loss, mini_batch_size=0, epochs=1)
        changed = {n for n, p in worker.module.named_parameters() if not torch.equal(p, before[n])}
        vision = {n for n in changed if ".visual." in f".{n}"}
        assert any("language_model" in n for n in changed)
        assert (not vision) if freeze else vision
        assert float(((worker.compute_log_probs(sampled).log_probs - lp).abs() * sampled.response_mask).max()) > 1e-3
    finally:
        worker.close()


def test_freezing_the_vision_tower_of_a_text_model_is_refused():
    from verl_backend_fsdp.backend import _vision_tower

    with pytest.raises(ValueError, match="freeze_vision_tower: .* has no vision tower"):
        _vision_tower(torch.nn.Linear(2, 2))


def test_the_hf_export_keeps_the_image_processor_and_loads_as_the_same_vlm(actor, sampled, tmp_path, processor):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from verl_data import load_processor

    actor.export_hf(str(tmp_path / "export"))
    exported = load_processor(str(tmp_path / "export"), AutoTokenizer.from_pretrained(tmp_path / "export"))
    assert exported is not None and exported.image_token_id == processor.image_token_id
    assert exported.image_processor.to_dict() == processor.image_processor.to_dict()
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "export", dtype=torch.float32)
    engine = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path="", module=model), tokenizer=exported.tokenizer)
    prompts = [sampled.prompt_ids[0][sampled.prompt_mask[0].bool()].tolist()]
    from verl_core.contracts import PromptIds

    prompt = PromptIds(prompts[0], multi_modal_inputs=sampled.multi_modal_inputs[0], multi_modal_data={"image": [0]})
    ours = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path="", module=actor.module),
                     tokenizer=exported.tokenizer)
    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=5)
    exported_ids = engine.generate([prompt], sampling=greedy).response_ids
    assert exported_ids == ours.generate([prompt], sampling=greedy).response_ids
