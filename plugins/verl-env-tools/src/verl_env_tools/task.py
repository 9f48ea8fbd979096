"""The built-in tool task: two-digit multiplication, which the tiny model cannot do alone but can
with the calculator.

* ``builtin:tool-arithmetic`` (``verl.datasets``): ``"37*48"`` -> ``"1776"``, data_source
  ``tool_arithmetic``; a fixed train/test split of the 8,100 products.
* ``builtin:tiny-qwen2-tools`` (``verl.models``): a ~0.8M-parameter Qwen2 with a byte-level
  tokenizer whose ChatML template takes ``tools=`` (Qwen2.5's layout: the tools in the system turn,
  tool results as ``<tool_response>`` in a user turn), after a short supervised warm start on traces
  that call the calculator, stopped early (at ``WARM_START_TARGET`` greedy accuracy with tools) so
  that RL has room to improve.
* ``tool_arithmetic`` (``verl.rewards``): 1 when the last line of the transcript (the model's final
  answer) is the product.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import random
from typing import Any, Sequence

from verl_core.contracts import DatasetProvider, ModelProvider
from verl_kit.builtin import build_once, one_torch_thread

__all__ = ["TinyQwen2Tools", "ToolArithmetic", "ToolArithmeticReward", "build_tokenizer", "make_dataset",
           "ensure_model", "CHAT_TEMPLATE", "DATA_SOURCE"]

logger = logging.getLogger(__name__)

DATA_SOURCE = "tool_arithmetic"
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>")
# Qwen2.5's layout, compact: the tools' names and parameters in a system turn; a tool result is a
# user turn holding <tool_response>...</tool_response>. Append-only (tests/test_templates.py).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}("
    "{{ t['function']['parameters']['properties'] | list | join(',') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SEED = 0
N_TEST = 500
WARM_START_TARGET = 0.3
WARM_START_MAX_STEPS = 600
_VERSION = "v3"
# Frequent strings of the task as single tokens, as BPE merges would make them: the chat roles and
# the constant parts of a calculator call. A call is then 8 tokens with its operands right after
# the question's (a copy over ~10 positions, which the tiny model learns in a few hundred steps).
MERGED = ("assistant", "user", "system", "Tools:", " calculator(expression)",
          '{"name":"calculator","arguments":{"expression":"', '"}}')


def build_tokenizer() -> Any:
    """Byte-level (no merges), the ChatML and tool-call markers as single special tokens."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", model_max_length=128)
    tok.add_special_tokens({"pad_token": SPECIAL[0], "eos_token": SPECIAL[2],
                            "additional_special_tokens": list(SPECIAL[1:2] + SPECIAL[3:])})
    tok.add_tokens(list(MERGED))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_dataset(*, seed: int = SEED, n_test: int = N_TEST) -> tuple[list[dict], list[dict]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)

    def row(a: int, b: int) -> dict:
        return {"prompt": [{"role": "user", "content": f"{a}*{b}"}], "data_source": DATA_SOURCE,
                "reward_model": {"style": "rule", "ground_truth": str(a * b)}}

    rows = [row(a, b) for a, b in pairs]
    return rows[n_test:], rows[:n_test]


def tool_call_text(expression: str) -> str:
    args = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"<tool_call>{args}</tool_call>"


class ToolArithmetic(DatasetProvider):
    """``builtin:tool-arithmetic``."""

    splits = ("train", "test")

    def rows(self, *, split: str) -> list[dict[str, Any]]:
        train, test = make_dataset()
        if split not in self.splits:
            raise ValueError(f"builtin:tool-arithmetic has splits {list(self.splits)}, not {split!r}")
        return train if split == "train" else test


class ToolArithmeticReward:
    """1.0 when the transcript's last line is the product (the model's final answer), else 0.0."""

    data_sources = (DATA_SOURCE,)

    def __call__(self, response: str, ground_truth: Any) -> float:
        lines = [line.strip() for line in str(response).splitlines() if line.strip()]
        return 1.0 if lines and lines[-1] == str(ground_truth).strip() else 0.0


class TinyQwen2Tools(ModelProvider):
    """``builtin:tiny-qwen2-tools``: the tool task's model after its warm start."""

    preset = {
        "backend": {"lr": 1e-4},
        "rollout": {"max_new_tokens": 24, "n": 8},
        "data": {"max_prompt_length": 96, "batch_size": 32, "max_val_samples": 200},
        "run": {"max_steps": 60, "val_every": 10, "save_every": 30},
    }

    def model_dir(self) -> str:
        return str(ensure_model())


# ---------------------------------------------------------------------- the model and its warm start
def build_model(tokenizer: Any, *, seed: int = SEED, layers: int = 3, max_positions: int = 128) -> Any:
    """A fresh tiny Qwen2 (hidden size 128) for ``tokenizer``; the code task's model is one too (code_task.py)."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        tie_word_embeddings=False, dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def trace_pieces(tokenizer: Any, row: dict) -> list[tuple[list[int], int]]:
    """A calculator trace as (token ids, trained?) pieces, built the way the agent loop builds them."""
    from verl_env_kit.episodes import render_tokens

    a, b = row["prompt"][0]["content"].split("*")
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]
    messages = list(row["prompt"])
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = render_tokens(tokenizer, messages, tools, generation_prompt=True)
    call = tool_call_text(f"{a}*{b}")
    messages.append({"role": "assistant", "content": call})
    before = render_tokens(tokenizer, messages, tools, generation_prompt=False)
    answer = row["reward_model"]["ground_truth"]
    messages.append({"role": "tool", "content": answer})
    after = render_tokens(tokenizer, messages, tools, generation_prompt=True)
    eos = tokenizer.eos_token
    return [(enc(prompt), 0), (enc(call + eos), 1), (enc("\n" + after[len(before):]), 0),
            (enc(answer + eos), 1)]


def _greedy_accuracy(model: Any, tokenizer: Any, rows: Sequence[dict]) -> float:
    from verl_core.contracts import ModelSpec, SamplingParams
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    from verl_env_tools.env import ToolsConfig, ToolsEnvironment

    engine = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path="", module=model), tokenizer=tokenizer)
    config = ToolsConfig()
    batch = ToolsEnvironment.run_episodes(engine, [_row_with_ids(tokenizer, r) for r in rows],
                                          SamplingParams(n=1, greedy=True, max_new_tokens=64),
                                          lambda: ToolsEnvironment(config), config, pad_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode([ids[m.bool()].tolist() for ids, m in
                                    zip(batch.response_ids, batch.response_attention_mask)], skip_special_tokens=True)
    reward = ToolArithmeticReward()
    return sum(reward(t, r["reward_model"]["ground_truth"]) for t, r in zip(texts, rows)) / max(1, len(rows))


def _row_with_ids(tokenizer: Any, row: dict) -> dict:
    return {**row, "prompt_messages": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"]}


def warm_start(model: Any, tokenizer: Any, rows: Sequence[dict], held_out: Sequence[dict], *,
               max_steps: int = WARM_START_MAX_STEPS, batch_size: int = 32, lr: float = 1e-3,
               target: float = WARM_START_TARGET, seed: int = SEED) -> dict[str, Any]:
    """Supervised steps on calculator traces (loss on the model's tokens only) until greedy
    accuracy with tools on ``held_out`` reaches ``target`` (checked every 5 steps)."""
    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    accuracy, step = 0.0, 0
    for step in range(1, max_steps + 1):
        model.train()
        seqs, masks = [], []
        for row in rng.sample(list(rows), batch_size):
            ids, mask = [], []
            for piece, trained in trace_pieces(tokenizer, row):
                ids += piece
                mask += [trained] * len(piece)
            seqs.append(ids)
            masks.append(mask)
        width = max(map(len, seqs))
        x = torch.full((len(seqs), width), tokenizer.pad_token_id)
        m = torch.zeros((len(seqs), width))
        for i, (ids, mask) in enumerate(zip(seqs, masks)):
            x[i, :len(ids)] = torch.tensor(ids)
            m[i, :len(mask)] = torch.tensor(mask, dtype=torch.float32)
        logits = model(input_ids=x, attention_mask=(m >= 0).long()).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                reduction="none").view(len(seqs), -1)
        loss = (nll * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0:
            model.eval()
            with torch.no_grad():
                accuracy = _greedy_accuracy(model, tokenizer, held_out)
            logger.info("tool-task warm start: step %d, loss %.3f, greedy accuracy with tools %.3f",
                        step, float(loss), accuracy)
            if accuracy >= target:
                break
    model.eval()
    return {"steps": step, "held_out_accuracy": accuracy, "target": target, "loss": float(loss.detach())}


def ensure_model(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The directory of ``builtin:tiny-qwen2-tools``, built on first use (a minute or two on one core);
    written to a temporary sibling and moved into place when complete, under a file lock."""
    import torch

    def build(tmp: pathlib.Path) -> None:
        with one_torch_thread(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            tokenizer = build_tokenizer()
            train, test = make_dataset()
            model = build_model(tokenizer)
            stats = warm_start(model, tokenizer, train, test[:64])
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "warm_start.json").write_text(json.dumps(stats, indent=2) + "\n")

    return build_once(f"tiny-qwen2-tools-{_VERSION}", build, done_file="warm_start.json", cache_dir=cache_dir)
