"""Offline batches: responses taken from the data instead of generated.

The preference algorithms (DPO, KTO, ORPO) and SPIN train on responses the data set provides.
Every prompt row keeps its raw columns under ``row["raw"]`` (see :func:`verl_data.rows.render_rows`);
the functions here turn those columns into token ids and lay them out as a
:class:`~verl_core.batch.Batch` of two-row groups, so that the usual nodes (reference log-probs,
actor update) work on them unchanged.

Expected columns (names are configurable on each algorithm's config):

* pairs (DPO, ORPO, and KTO too): ``prompt``, ``chosen``, ``rejected``;
* unary feedback (KTO): ``prompt``, ``completion``, ``label`` (true = desirable).

A response column holds a string, or a chat message list whose assistant turns form the response.
Each response ends with the tokenizer's eos token, so the policy also learns to stop.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Sequence

import torch

from verl_core.batch import Batch, scores_to_token_rewards
from verl_core.kit import DataError
from verl_core.contracts import RolloutOutput
from verl_core.kit import build_batch

__all__ = [
    "response_text",
    "encode_response",
    "raw_column",
    "two_row_groups",
    "check_pairs_intact",
    "write_addition_preferences",
]

#: ``Batch.info`` flag of batches whose groups are (first, second) row pairs that a loss compares.
PAIRED = "paired_groups"


def response_text(value: Any) -> str:
    """The text of a response column: a string, a message dict, or a chat message list."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "content" in value:
        return str(value["content"])
    if isinstance(value, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in value):
        assistant = [m["content"] for m in value if m.get("role") == "assistant"]
        return "".join(assistant if assistant else [m["content"] for m in value])
    raise DataError(f"a response must be a string or a list of chat messages, got {type(value).__name__}: "
                    f"{str(value)[:80]!r}")


def encode_response(tokenizer: Any, value: Any, *, max_length: int = 0) -> list[int]:
    """Token ids of a response followed by eos; cut to ``max_length`` tokens when that is > 0."""
    ids = list(tokenizer(response_text(value), add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if max_length > 0:
        ids = ids[:max_length]
    if not ids:
        raise DataError(f"response {value!r} encodes to no tokens")
    return ids


def raw_column(row: dict[str, Any], column: str, *, config_key: str) -> Any:
    """``row["raw"][column]``, or a :class:`DataError` naming the columns present and the setting."""
    raw = row.get("raw") or {}
    if column not in raw:
        raise DataError(f"the training data has no {column!r} column (columns: {sorted(raw)}); point "
                        f"data.train at data with it, or set algorithm.{config_key} to the column to use")
    return raw[column]


def two_row_groups(prompts: Sequence[dict[str, Any]], responses: Sequence[tuple[list[int], list[int]]], *,
                   scores: Sequence[tuple[float, float]], pad_id: int, eos_id: int | None,
                   extras: dict[str, Sequence[tuple[float, float]]] | None = None) -> Batch:
    """A batch where prompt ``i`` gets the two responses ``responses[i]`` as group ``i``.

    Args:
        prompts: prompt rows (``prompt_ids`` and the metadata keys of a tokenized row).
        responses: per prompt, the (first, second) response's token ids.
        scores: per prompt, the two responses' scores (1/0 marks chosen/rejected).
        pad_id: padding token id.
        eos_id: responses ending with it finish with ``"stop"``, others with ``"length"``.
        extras: per-sample values to store in ``Batch.extras`` (two per prompt).

    Returns:
        The batch, with ``info["paired_groups"]`` set so losses can check pairs stay together.
    """
    flat = [ids for pair in responses for ids in pair]
    output = RolloutOutput(response_ids=flat, log_probs=None,
                           finish_reasons=["stop" if ids and ids[-1] == eos_id else "length" for ids in flat])
    batch = build_batch(prompts, output, n=2, pad_id=pad_id)
    score_t = torch.tensor([s for pair in scores for s in pair], dtype=torch.float32)
    batch = batch.replace(scores=score_t, token_rewards=scores_to_token_rewards(score_t, batch.response_mask),
                          extras={k: torch.tensor([x for pair in v for x in pair], dtype=torch.float32)
                                  for k, v in (extras or {}).items()})
    batch.info[PAIRED] = True
    return batch


def check_pairs_intact(batch: Batch) -> None:
    """Raise when a micro-batch cut through a two-row group of a paired batch."""
    if not batch.info.get(PAIRED) or len(batch) == 0:
        return
    _, counts = torch.unique(batch.group_ids, return_counts=True)
    if (counts != 2).any():
        raise ValueError("a preference pair was split between micro-batches; set backend.micro_batch_size and "
                         "algorithm.mini_batch_size to even numbers and leave backend.micro_batch_max_tokens at 0, "
                         "so that pairs stay together")


def write_addition_preferences(path: str | Path, *, rows: int = 2000, seed: int = 0, unary: bool = False) -> Path:
    """Write a preference data set derived from the built-in addition task as JSON lines.

    Pairs: ``{"prompt": "12+34=", "chosen": "46", "rejected": "47", "data_source": "arithmetic"}``,
    the rejected answer a near miss (off by 1-10, or a digit changed). With ``unary=True`` each
    pair becomes two KTO rows ``{"prompt", "completion", "label"}``. Prompts come from the task's
    training split, so validating on ``builtin:addition``'s test split stays held out.

    Args:
        path: the ``.jsonl`` file to write.
        rows: number of prompts.
        seed: seed of the prompt choice and the wrong answers.
        unary: write KTO's unary format instead of pairs.

    Returns:
        The path written.
    """
    from verl_data import load_rows

    rng = random.Random(seed)
    train = load_rows("builtin:addition", split="train")
    picked = rng.sample(train, min(rows, len(train)))
    lines = []
    for row in picked:
        prompt = row["prompt"][0]["content"] if isinstance(row["prompt"], list) else row["prompt"]
        answer = str(row["reward_model"]["ground_truth"])
        wrong = _near_miss(int(answer), rng)
        if unary:
            lines.append({"prompt": prompt, "completion": answer, "label": True, "data_source": "arithmetic"})
            lines.append({"prompt": prompt, "completion": str(wrong), "label": False, "data_source": "arithmetic"})
        else:
            lines.append({"prompt": prompt, "chosen": answer, "rejected": str(wrong), "data_source": "arithmetic"})
    path = Path(path)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _near_miss(answer: int, rng: random.Random) -> int:
    """A plausible wrong answer: off by a little, or one digit changed."""
    while True:
        if rng.random() < 0.5:
            wrong = answer + rng.choice([-1, 1]) * rng.randint(1, 10)
        else:
            digits = list(str(answer))
            i = rng.randrange(len(digits))
            digits[i] = str(rng.randrange(10))
            wrong = int("".join(digits))
        if wrong != answer and wrong >= 0:
            return wrong
