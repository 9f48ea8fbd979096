"""Prompt data: loading rows, rendering prompts to token ids, and a resumable sampling order.

Rows come in the verl format (``data_source``, ``prompt`` as a chat message list,
``reward_model.ground_truth``, ``extra_info``) or as plain prompt/answer columns. Each loaded row
becomes a dict with ``prompt_ids``, ``prompt_text``, ``ground_truth``, ``data_source`` and
``extra_info``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = ["load_rows", "tokenize_rows", "PromptSampler", "DataError"]


class DataError(ValueError):
    """Data that cannot be used, with the file and the fix."""


def load_rows(spec: str, *, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    """Raw rows from ``builtin:addition`` or a parquet / jsonl / json file or dataset directory."""
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name != "addition":
            raise DataError(f"unknown built-in dataset {spec!r}; available: builtin:addition")
        from verl_core.tasks.arithmetic import make_dataset

        train, test = make_dataset(seed=0)
        return train if split == "train" else test
    path = Path(spec)
    if not path.exists():
        raise DataError(f"data file {spec!r} does not exist (use a parquet/jsonl/json file, a dataset "
                        f"directory, or builtin:addition)")
    import datasets

    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{spec}: no {split!r} split; splits are {list(ds)}")
            ds = ds[split]
    else:
        suffix = path.suffix.lower()
        fmt = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}.get(suffix)
        if fmt is None:
            raise DataError(f"{spec}: unsupported file type {suffix!r}; use .parquet, .jsonl or .json")
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    return [dict(r) for r in ds]


def _ground_truth(row: dict[str, Any], answer_key: str) -> Any:
    rm = row.get("reward_model")
    if isinstance(rm, dict) and "ground_truth" in rm:
        return rm["ground_truth"]
    return row.get(answer_key)


def tokenize_rows(rows: Sequence[dict[str, Any]], tokenizer: Any, *, prompt_key: str, answer_key: str,
                  max_prompt_length: int, overlong: str, apply_chat_template: bool, source: str,
                  ) -> tuple[list[dict[str, Any]], int]:
    """Render and tokenize prompts. Returns ``(rows, dropped)`` where ``dropped`` were too long."""
    out: list[dict[str, Any]] = []
    dropped = 0
    for i, row in enumerate(rows):
        if prompt_key not in row:
            raise DataError(f"{source}: row {i} has no {prompt_key!r} column; columns are {sorted(row)} "
                            f"(set data.prompt_key)")
        prompt = row[prompt_key]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)
        if apply_chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in messages)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            if overlong == "error":
                raise DataError(f"{source}: row {i} has a {len(ids)}-token prompt, longer than "
                                f"data.max_prompt_length={max_prompt_length} (raise it or set data.overlong='filter')")
            dropped += 1
            continue
        out.append({
            "prompt_ids": ids,
            "prompt_text": text,
            "ground_truth": _ground_truth(row, answer_key),
            "data_source": row.get("data_source") or "default",
            "extra_info": row.get("extra_info") or {},
            "raw": row,  # everything else the row carries (preference pairs, images, tools, ...)
        })
    if not out:
        raise DataError(f"{source}: no usable prompts ({dropped} longer than data.max_prompt_length)")
    return out, dropped


class PromptSampler:
    """Seeded, epoch-wise shuffled batches of prompt indices whose position can be saved.

    The order of epoch ``e`` depends only on ``(seed, e)``, so a resumed run draws exactly the
    prompts the uninterrupted run would have. A short last batch is dropped.
    """

    def __init__(self, size: int, batch_size: int, *, seed: int, shuffle: bool = True) -> None:
        if batch_size > size:
            raise DataError(f"data.batch_size={batch_size} is larger than the {size} training prompts")
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def next_batch(self) -> list[int]:
        if self.position + self.batch_size > self.size:
            self.epoch += 1
            self.position = 0
            self._order = self._make_order()
        idx = self._order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return idx

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("size") != self.size:
            raise DataError(f"checkpoint was taken with {state.get('size')} training prompts; the data now has "
                            f"{self.size}; resume with the same data")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._make_order()
