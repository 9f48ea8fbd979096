"""The HF rollout's own behaviour: each prompt prefilled once for its ``n`` samples (the same samples, fewer
tokens), and ``rollout.autocast``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from verl_core.contracts import ModelSpec, SamplingParams
from verl_core.testing import chat_prompt_ids, tiny_model_dir
from verl_rollout_hf import HFRollout, HFRolloutConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("m"))


def _engine(model_dir: str, shared: bool) -> tuple[HFRollout, list[int]]:
    engine = HFRollout(config=HFRolloutConfig(shared_prefill=shared), model=ModelSpec(path=model_dir),
                       tokenizer=AutoTokenizer.from_pretrained(model_dir))
    fed: list[int] = []
    engine._own.get_input_embeddings().register_forward_hook(lambda mod, args, out: fed.append(args[0].numel()))
    return engine, fed


def test_shared_prefill_draws_the_same_samples_from_fewer_tokens(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompt_ids(tok)  # of different lengths: left padding
    sampling = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, seed=7, logprobs=True)
    runs = {}
    for shared in (False, True):
        engine, fed = _engine(model_dir, shared)
        runs[shared] = engine.generate(prompts, sampling=sampling), sum(fed)
    (plain, plain_fed), (shared, shared_fed) = runs[False], runs[True]
    assert shared.response_ids == plain.response_ids and shared.finish_reasons == plain.finish_reasons
    assert len(shared.response_ids) == 16 and len({tuple(r) for r in shared.response_ids}) > 4  # sampled, not copied
    for a, b in zip(plain.log_probs, shared.log_probs):
        assert a == pytest.approx(b, abs=1e-5)
    width = max(map(len, prompts))
    # The prompts went in once (less their last token, which each sample feeds), not 4 times.
    assert plain_fed - shared_fed == 3 * 4 * (width - 1)


def test_greedy_and_single_samples_generate_as_before(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompt_ids(tok)
    for sampling in (SamplingParams(n=3, max_new_tokens=5, greedy=True), SamplingParams(n=1, max_new_tokens=5,
                                                                                          seed=1)):
        (a, _), (b, _) = (_engine(model_dir, s) for s in (False, True))
        assert a.generate(prompts, sampling=sampling).response_ids == b.generate(prompts, sampling=sampling).response_ids


def test_autocast_generates_in_bf16_and_says_so(model_dir):
    """rollout.autocast='bfloat16': the projections run in bf16 (prefill and decode), the weights stay fp32, the
    log-probs are close to fp32's, and the engine reports bf16 so the weight-sync guard takes the 16-bit limit."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompt_ids(tok)
    greedy = SamplingParams(n=2, max_new_tokens=5, greedy=True, logprobs=True)
    fp32 = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=model_dir), tokenizer=tok)
    bf16 = HFRollout(config=HFRolloutConfig(autocast="bfloat16"), model=ModelSpec(path=model_dir), tokenizer=tok)
    seen = []
    for name, mod in bf16._own.named_modules():
        if name.endswith("q_proj"):
            mod.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    a, b = fp32.generate(prompts, sampling=greedy), bf16.generate(prompts, sampling=greedy)
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in bf16._own.parameters())
    gaps = []
    for ra, rb, la, lb in zip(a.response_ids, b.response_ids, a.log_probs, b.log_probs):
        for ta, tb, x, y in zip(ra, rb, la, lb):  # up to where bf16 rounding picks another greedy token
            if ta != tb:
                break
            gaps.append(abs(x - y))
    assert gaps and max(gaps) < 0.1
    assert HFRolloutConfig(autocast="bfloat16").compute_dtype("float32") == "bfloat16"
    assert HFRolloutConfig().compute_dtype("float32") == "float32"
    with pytest.raises(ValueError, match="autocast: must be 'off', 'bfloat16' or 'float16'"):
        HFRolloutConfig(autocast="bf16").validate()
