"""The multi-turn loop: tokens as sampled, environment tokens masked out, append-only check; the core's
rollout stage reaches it through the environment class."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from verl_core.contracts import ENV_REWARDS, Environment, EnvironmentConfig, ModelSpec, SamplingParams, StepResult
from verl_env_kit import MultiTurnEnvironment
from verl_env_kit.episodes import check_append_only, run_episodes


class Echo(MultiTurnEnvironment):
    """Answers every turn with a fixed observation, twice, then ends with reward 1 (async steps)."""

    def __init__(self, config: EnvironmentConfig | None = None) -> None:
        super().__init__(config)
        self.turns = 0

    def reset(self, *, prompt, extra_info):
        return list(prompt)

    async def step(self, response: str) -> StepResult:
        self.turns += 1
        if self.turns >= 3:
            return StepResult(None, 1.0, True)
        return StepResult([{"role": "user", "content": f"obs{self.turns}"}], 0.25, False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from verl_core.testing import tiny_model_dir
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    path = tiny_model_dir(tmp_path_factory.mktemp("agent"))
    tok = AutoTokenizer.from_pretrained(path)
    return HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=path), tokenizer=tok)


def _rows(n: int = 3) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "ground_truth": str(2 * i), "data_source": "x"}
            for i in range(n)]


def test_masks_tokens_and_rewards_on_real_trajectories(engine: Any) -> None:
    tok = engine.tokenizer
    config = EnvironmentConfig(max_turns=4, max_response_tokens=120)
    metrics: dict[str, float] = {}
    # As the rollout stage calls it: the environment class's episode runner, with the trainer's factory.
    batch = Echo.run_episodes(engine, _rows(), SamplingParams(n=2, max_new_tokens=6, seed=3),
                              functools.partial(Echo, config), config, pad_id=tok.pad_token_id, metrics=metrics)
    assert len(batch) == 6 and metrics["env/template_mismatch"] == 0
    # The trajectories' budget, not the batch's width: what Dr. GRPO's loss divides by, however a backend cuts it.
    assert batch.info["max_new_tokens"] == 120 >= batch.response_length
    for i in range(len(batch)):
        ids = batch.response_ids[i][batch.response_attention_mask[i].bool()].tolist()
        mask = batch.response_mask[i][: len(ids)].tolist()
        text = tok.decode([t for t, m in zip(ids, mask) if m == 0], skip_special_tokens=False)
        # Every environment token is an observation or chat markup, never a model token.
        assert "obs1" in text and "obs2" in text
        model_text = tok.decode([t for t, m in zip(ids, mask) if m == 1], skip_special_tokens=False)
        assert "obs1" not in model_text
        # Rewards: 0.25 after turns 1 and 2, 1.0 after turn 3, each on a model token.
        rewards = batch.extras[ENV_REWARDS][i]
        assert sorted(rewards[rewards != 0].tolist()) == [0.25, 0.25, 1.0]
        assert all(mask[j] == 1 for j in torch.nonzero(rewards[: len(ids)]).flatten().tolist())
        # The whole trajectory decodes to the chat template's full rendering of its conversation.
        full = tok.apply_chat_template(batch.meta["transcript"][i], tokenize=False)
        built = tok.decode(batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist() + ids, skip_special_tokens=False)
        assert full.startswith(built.removesuffix(tok.eos_token)) or built.startswith(full[: len(built)])


def test_model_tokens_are_kept_as_sampled(engine: Any) -> None:
    """The engine's log-probs of the model tokens equal a forward over the built sequence: the tokens
    the loop stored are the ones the engine sampled, in their context."""
    from transformers import AutoModelForCausalLM

    tok = engine.tokenizer
    batch = run_episodes(engine, _rows(2), SamplingParams(n=1, max_new_tokens=6, seed=1), Echo,
                         EnvironmentConfig(max_turns=3), pad_id=tok.pad_token_id)
    assert batch.info["max_new_tokens"] == 6 * 3  # no max_response_tokens: max_new_tokens per turn, max_turns turns
    model = AutoModelForCausalLM.from_pretrained(engine.model.path, torch_dtype=torch.float32)
    for i in range(len(batch)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        n = int(batch.response_attention_mask[i].sum())
        ids = batch.response_ids[i][:n].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        mask = batch.response_mask[i][:n].bool()
        assert float((ref[mask] - batch.rollout_log_probs[i][:n][mask]).abs().max()) < 1e-4


def test_the_chatml_template_is_append_only(engine: Any) -> None:
    conversation = [{"role": "user", "content": "3*4"}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
                    {"role": "tool", "content": "12"}, {"role": "assistant", "content": "12"}]
    assert check_append_only(engine.tokenizer, conversation) is None


def test_an_environment_of_the_core_contract_alone_is_told_to_use_the_kit() -> None:
    class Bare(Environment):
        def reset(self, *, prompt, extra_info):
            return list(prompt)

        def step(self, response: str) -> StepResult:
            return StepResult(None, 0.0, True)

    with pytest.raises(NotImplementedError, match=r"subclass verl_env_kit.MultiTurnEnvironment.*pip install verl-env-kit"):
        Bare.run_episodes(None, _rows(1), SamplingParams(), Bare, EnvironmentConfig(), pad_id=0)


def test_a_template_that_rewrites_history_is_detected_and_never_trained_on(engine: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine.model.path)
    # Like templates that drop earlier reasoning: only the last assistant message keeps its content.
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
                    {"role": "user", "content": "o"}, {"role": "assistant", "content": "a2"}]
    assert "rewrites" in check_append_only(tok, conversation)
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    other = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=engine.model.path), tokenizer=tok)
    metrics: dict[str, float] = {}
    batch = run_episodes(other, _rows(2), SamplingParams(n=1, max_new_tokens=6, seed=1), Echo,
                         EnvironmentConfig(max_turns=3), pad_id=tok.pad_token_id, metrics=metrics)
    assert metrics["env/template_mismatch"] == 2
    # The trajectories stop before any re-rendered token: only the first model turn is there.
    assert int(batch.response_mask.sum()) == int(batch.response_attention_mask.sum())
