"""The reward_model role: a sequence-classification model scored on the FSDP backend, batched, on CPU."""

import pytest
import torch

from verl_core.batch import Batch
from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.rollout_utils import left_pad, right_pad
from verl_core.testing import build_byte_tokenizer, tiny_reward_model_dir, tiny_text_model_dir
from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_reward_model_dir(tmp_path_factory.mktemp("rm"), seed=3)


def _batch(pairs, tokenizer):
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in pairs]
    answers = [tokenizer(a, add_special_tokens=False)["input_ids"] for _, a in pairs]
    prompt_ids, prompt_mask = left_pad(prompts, tokenizer.pad_token_id)
    width = max(len(a) for a in answers)
    attn = right_pad([[1] * len(a) for a in answers], 0, torch.long, width)
    return Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                 response_ids=right_pad(answers, tokenizer.pad_token_id, torch.long, width),
                 response_attention_mask=attn, response_mask=attn.clone(), group_ids=torch.arange(len(pairs)))


def test_scores_match_the_unpadded_hf_model_row_by_row(reward_model_dir):
    from transformers import AutoModelForSequenceClassification

    tokenizer = build_byte_tokenizer()
    # Uneven lengths on both sides, and a response that ends in the pad token id (pad == eos is common):
    # HF's own pooling would read the wrong position there.
    pad = tokenizer.pad_token
    pairs = [("What is 2+2?", "4"), ("Say something longer, please.", "Here is a much longer answer."),
             ("Hi", f"ends with pad{pad}")]
    worker = FSDPBackend(FSDPConfig(log_prob_micro_batch_size=2)).create_worker(
        role=Role.REWARD_MODEL, model=ModelSpec(path=reward_model_dir), world=WorldInfo(), seed=0)
    scores = worker.compute_scores(_batch(pairs, tokenizer))
    assert scores.shape == (3,) and scores.dtype == torch.float32

    reference = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    reference.config.pad_token_id = None  # one unpadded row at a time: the last token is the score
    expected = []
    for prompt, answer in pairs:
        ids = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            expected.append(float(reference(input_ids=torch.tensor([ids])).logits[0, 0]))
    torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-5, rtol=1e-4)
    assert len(set(round(float(s), 6) for s in scores)) == 3  # a real model: different inputs, different scores


def test_other_roles_have_no_scores_and_causal_lms_are_refused_as_reward_models(reward_model_dir, tmp_path):
    backend = FSDPBackend(FSDPConfig())
    with pytest.raises(ValueError, match="reward.model_path: .* is not a sequence-classification model"):
        backend.create_worker(role=Role.REWARD_MODEL, model=ModelSpec(path=tiny_text_model_dir(tmp_path)),
                              world=WorldInfo(), seed=0)
    reference = backend.create_worker(role=Role.REFERENCE, model=ModelSpec(path=tiny_text_model_dir(tmp_path)),
                                      world=WorldInfo(), seed=0)
    with pytest.raises(NotImplementedError, match="no reward head"):
        reference.compute_scores(_batch([("a", "b")], build_byte_tokenizer()))
