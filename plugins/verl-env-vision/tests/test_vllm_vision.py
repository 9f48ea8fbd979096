"""The vllm rollout and images: prompts go to vLLM with their multi_modal_data, and a VLM the installed
vLLM cannot run is a start-up error, never a text-only rollout."""

import types

import pytest

from verl_core.contracts import ModelSpec, PromptIds, SamplingParams

vllm = pytest.importorskip("vllm")


def test_image_prompts_reach_vllm_with_their_multi_modal_data():
    from verl_rollout_vllm.engine import VLLMRollout

    image = object()
    prompts = [PromptIds([5, 6, 7], multi_modal_data={"image": [image]}), [8, 9]]
    requests, _, _ = VLLMRollout.vllm_requests(types.SimpleNamespace(_stop_ids={2}), prompts,
                                                SamplingParams(n=2, max_new_tokens=3))
    assert requests[0]["prompt_token_ids"] == [5, 6, 7] and requests[0]["multi_modal_data"]["image"] == [image]
    assert "multi_modal_data" not in requests[1]
    assert VLLMRollout.accepts_multi_modal


def test_a_vlm_this_vllm_cannot_run_fails_at_start_up_naming_the_cause(vlm_dir, processor):
    from verl_rollout_vllm.engine import VLLMRollout, VLLMRolloutConfig, VLLMStartError

    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torchvision is installed: vLLM's Qwen2-VL may start here")
    with pytest.raises(VLLMStartError, match="cannot run Qwen2VLForConditionalGeneration on this machine.*"
                                             "torchvision.*rollout.name='hf'"):
        VLLMRollout(config=VLLMRolloutConfig(kv_cache_gb=1), model=ModelSpec(path=vlm_dir),
                    tokenizer=processor.tokenizer)
