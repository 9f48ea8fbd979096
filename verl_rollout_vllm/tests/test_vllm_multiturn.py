"""Multi-turn trajectories from the real vLLM engine: environment tokens masked, model tokens as sampled."""

from __future__ import annotations

from typing import Any

import pytest

from verl_core.contracts import EnvironmentConfig, SamplingParams, StepResult
from verl_env_kit import MultiTurnEnvironment

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class OneObservation(MultiTurnEnvironment):
    def __init__(self, config: EnvironmentConfig | None = None) -> None:
        super().__init__(config)
        self.turns = 0

    def reset(self, *, prompt, extra_info):
        return list(prompt)

    def step(self, response: str) -> StepResult:
        self.turns += 1
        if self.turns == 2:
            return StepResult(None, 1.0, True)
        return StepResult([{"role": "user", "content": f"t{self.turns}"}], 0.0, False)


def test_vllm_trajectories_mask_environment_tokens(vllm_engine: Any, model_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = vllm_engine.tokenizer
    rows = [{"prompt": [{"role": "user", "content": t}], "ground_truth": "", "data_source": "x"}
            for t in ("12+34=", "5+6=")]
    metrics: dict[str, float] = {}
    config = EnvironmentConfig(max_turns=2, max_response_tokens=36)
    batch = OneObservation.run_episodes(vllm_engine, rows, SamplingParams(n=2, max_new_tokens=6, seed=0),
                                        lambda: OneObservation(config), config, pad_id=tok.pad_token_id,
                                        metrics=metrics)
    assert metrics["env/template_mismatch"] == 0 and metrics["env/turns_mean"] == 2
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    for i in range(len(batch)):
        n = int(batch.response_attention_mask[i].sum())
        ids, mask = batch.response_ids[i][:n].tolist(), batch.response_mask[i][:n].bool()
        env_text = tok.decode([t for t, m in zip(ids, mask.tolist()) if not m], skip_special_tokens=False)
        assert "t1" in env_text and "t1" not in tok.decode([t for t, m in zip(ids, mask.tolist()) if m])
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        # vLLM's log-probs of its own tokens, in the built context, match an fp32 forward.
        assert float((ref[mask] - batch.rollout_log_probs[i][:n][mask]).abs().max()) < 1e-3
