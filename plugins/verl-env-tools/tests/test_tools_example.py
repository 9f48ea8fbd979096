"""examples/gsm8k_qwen_tools.toml, run for real on a tiny model with a Qwen2.5-style tool template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_env_kit.episodes import check_append_only
from verl_env_tools.templates import QWEN25_STYLE_TEMPLATE

EXAMPLE = Path(__file__).parents[3] / "examples" / "gsm8k_qwen_tools.toml"
TOOLS = [{"type": "function", "function": {"name": "python", "description": "run code",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]


def _tiny_qwen_style_model(tmp: Path) -> str:
    from transformers import AutoTokenizer

    from verl_core.testing import tiny_text_model_dir

    path = tiny_text_model_dir(tmp, max_positions=2048)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = QWEN25_STYLE_TEMPLATE
    tok.save_pretrained(path)
    return path


def test_the_qwen_style_template_is_append_only(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tiny_qwen_style_model(tmp_path))
    conversation = [{"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": '<tool_call>\n{"name": "python", "arguments": {}}\n</tool_call>'},
                    {"role": "tool", "content": "4"}, {"role": "assistant", "content": "#### 4"}]
    assert check_append_only(tok, conversation, TOOLS) is None
    assert "<tools>" in tok.apply_chat_template(conversation[:1], tools=TOOLS, tokenize=False)


def test_the_builtin_tool_models_template_is_append_only() -> None:
    from verl_env_tools.task import build_tokenizer

    conversation = [{"role": "user", "content": "3*4"}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
                    {"role": "tool", "content": "12"}, {"role": "assistant", "content": "12"}]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"properties": {"e": {}}}}}]
    assert check_append_only(build_tokenizer(), conversation, tools) is None


@pytest.mark.slow
def test_example_config_runs_on_a_tiny_model(tmp_path: Path) -> None:
    from verl_core.trainer import Trainer

    model = _tiny_qwen_style_model(tmp_path / "model")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({
        "prompt": [{"role": "user", "content": f"What is {i} + {i}? Use python."}], "data_source": "openai/gsm8k",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)}}) + "\n" for i in range(4)))
    trainer = Trainer.from_config(EXAMPLE, overrides=[
        f"model.path={json.dumps(model)}", 'model.dtype="float32"', 'backend.param_dtype="float32"',
        f"data.train={json.dumps(str(data))}", f"data.val={json.dumps(str(data))}", "data.batch_size=2",
        "rollout.n=2", "rollout.max_new_tokens=24", "environment.max_response_tokens=96", "run.max_steps=1",
        f"run.output_dir={json.dumps(str(tmp_path / 'run'))}", 'run.loggers=["jsonl"]', "run.save_every=0",
        "run.val_every=0", "run.val_before_train=false"])
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1 and "env/turns_mean" in r)
    assert step["env/template_mismatch"] == 0 and step["env/turns_mean"] >= 1
