"""The built-in code task: write the program that prints a sum, graded by ``code_tests`` in the sandbox.

* ``builtin:code-sums`` (``verl.datasets``): the prompt ``"37+48"``; the test case ``{"inputs": [""],
  "outputs": ["85\\n"]}`` (stdin/stdout: the program's output must be the sum), data_source
  ``code_sums``, which ``reward.name = "auto"`` routes to ``code_tests``; a fixed train/test split of
  the 8,100 sums of two two-digit numbers (500 test rows).
* ``builtin:tiny-qwen2-code`` (``verl.models``): a ~0.5M-parameter Qwen2 with a byte-level tokenizer
  (``print(`` one token, as a BPE merge would make it), after a short supervised warm start on
  ``print(85)`` programs, stopped at ``WARM_START_TARGET`` greedy accuracy so that RL has room.

The smallest task on which the ``code_tests`` reward can be seen to teach on a CPU: every rollout's
program runs in its own sandbox process (about 20 ms), and a program with a wrong number, a missing
parenthesis or stray text fails its test.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
from typing import Any, Sequence

from verl_core.contracts import DatasetProvider, ModelProvider
from verl_kit.builtin import build_once, byte_level_tokenizer, one_torch_thread

from verl_env_tools.task import build_model

__all__ = ["CodeSums", "TinyQwen2Code", "DATA_SOURCE", "make_dataset", "build_tokenizer", "ensure_model"]

DATA_SOURCE = "code_sums"
SEED = 0
N_TEST = 500
WARM_START_TARGET = 0.2
WARM_START_MAX_STEPS = 600
_VERSION = "v1"
# The prompt is the user's text after <bos>: every prompt is 6 tokens ("<bos>37+48"), so no padding.
CHAT_TEMPLATE = "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build_tokenizer() -> Any:
    return byte_level_tokenizer(pad="<pad>", eos="<eos>", special=["<bos>"], merged=["print("],
                                chat_template=CHAT_TEMPLATE, max_length=32)


def make_dataset(*, seed: int = SEED, n_test: int = N_TEST) -> tuple[list[dict], list[dict]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}"}], "data_source": DATA_SOURCE,
             "reward_model": {"style": "rule", "ground_truth": json.dumps({"inputs": [""], "outputs": [f"{a + b}\n"]})},
             "extra_info": {"index": i, "program": f"print({a + b})"}} for i, (a, b) in enumerate(pairs)]
    return rows[n_test:], rows[:n_test]


class CodeSums(DatasetProvider):
    """``builtin:code-sums``: ``train`` (7600 rows) and ``test`` (500)."""

    splits = ("train", "test")

    def rows(self, *, split: str) -> list[dict[str, Any]]:
        if split not in self.splits:
            raise ValueError(f"builtin:code-sums has splits {list(self.splits)}, not {split!r}")
        train, test = make_dataset()
        return train if split == "train" else test


class TinyQwen2Code(ModelProvider):
    """``builtin:tiny-qwen2-code``: the code task's model after its warm start."""

    # 16 prompts x 8 samples a step: 128 programs, each its own sandbox process.
    preset = {
        "backend": {"lr": 1e-4},
        "rollout": {"max_new_tokens": 8, "n": 8},
        "data": {"max_prompt_length": 16, "batch_size": 16, "max_val_samples": 200},
        "run": {"max_steps": 60, "val_every": 20, "save_every": 0},
    }

    def model_dir(self) -> str:
        return str(ensure_model())


def _ids(tokenizer: Any, rows: Sequence[dict]) -> Any:
    import torch

    return torch.tensor([tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                       return_dict=False) for r in rows])


def greedy_accuracy(model: Any, tokenizer: Any, rows: Sequence[dict]) -> float:
    """Greedy responses that are exactly the row's program (stricter than its test: no stray spaces)."""
    import torch

    with torch.no_grad():
        prompts = _ids(tokenizer, rows)
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             max_new_tokens=8)
    texts = tokenizer.batch_decode(out[:, prompts.shape[1]:], skip_special_tokens=True)
    return sum(t.strip() == r["extra_info"]["program"] for t, r in zip(texts, rows)) / max(1, len(rows))


def warm_start(model: Any, tokenizer: Any, rows: Sequence[dict], held_out: Sequence[dict], *,
               max_steps: int = WARM_START_MAX_STEPS, batch_size: int = 128, lr: float = 1e-3,
               target: float = WARM_START_TARGET, seed: int = SEED) -> dict[str, Any]:
    """Supervised steps on prompt + program + eos (loss on the program and eos) until the greedy
    program is right on ``target`` of ``held_out`` (checked every 10 steps)."""
    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    accuracy, step, loss = 0.0, 0, torch.tensor(0.0)
    for step in range(1, max_steps + 1):
        batch = rng.sample(list(rows), batch_size)
        prompts = _ids(tokenizer, batch)
        answers = [tokenizer(r["extra_info"]["program"], add_special_tokens=False)["input_ids"]
                   + [tokenizer.eos_token_id] for r in batch]
        width = prompts.shape[1] + max(map(len, answers))
        x = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full_like(x, -100)
        for i, answer in enumerate(answers):
            end = prompts.shape[1] + len(answer)
            x[i, :prompts.shape[1]] = prompts[i]
            x[i, prompts.shape[1]:end] = labels[i, prompts.shape[1]:end] = torch.tensor(answer)
        model.train()
        mask = ((labels != -100) | (torch.arange(width) < prompts.shape[1])).long()
        loss = model(input_ids=x, attention_mask=mask,
                     labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            model.eval()
            accuracy = greedy_accuracy(model, tokenizer, held_out)
            if accuracy >= target:
                break
    model.eval()
    return {"steps": step, "held_out_accuracy": accuracy, "target": target, "loss": float(loss.detach())}


def ensure_model(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The directory of ``builtin:tiny-qwen2-code``, built on first use (under a minute on one core)."""
    import torch

    def build(tmp: pathlib.Path) -> None:
        with one_torch_thread(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            tokenizer = build_tokenizer()
            train, test = make_dataset()
            model = build_model(tokenizer, layers=2, max_positions=32)
            stats = warm_start(model, tokenizer, train, train[:200])
            stats["greedy_test_accuracy"] = greedy_accuracy(model, tokenizer, test)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "warm_start.json").write_text(json.dumps(stats, indent=2) + "\n")

    return build_once(f"tiny-qwen2-code-{_VERSION}", build, done_file="warm_start.json", cache_dir=cache_dir)
