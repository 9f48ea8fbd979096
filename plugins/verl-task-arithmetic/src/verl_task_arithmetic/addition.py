"""The two-digit addition task: the problem ``verl run`` trains on when given no flags.

Everything is built locally, with no downloads, so the framework can be tried end to end on a laptop CPU:

* a character-level tokenizer (:func:`build_tokenizer`) over ``0-9 + =`` with a trivial chat template, so the
  token ids are the same in SFT, in every rollout engine and in the reward;
* the data set (:func:`make_dataset`): all 8100 sums ``a+b`` with ``a, b`` in ``10..99`` in the verl row format,
  and preference pairs derived from it (:func:`preference_pairs`: chosen = the sum, rejected = a near miss);
* a ~0.5M-parameter Qwen2 (:func:`build_model`), which every backend and rollout engine understands;
* a short supervised warm start (:func:`warm_start`) that leaves the model clearly above zero but far from perfect,
  so that GRPO has a reward signal to start from and room to improve;
* the rule reward (:func:`reward`) and a greedy evaluator (:func:`evaluate_greedy`);
* :func:`ensure_builtin_model`, which builds all of it once into a Hugging Face model directory for the name
  ``builtin:tiny-qwen2-addition`` and caches it (:mod:`verl_task_arithmetic.plugins` registers it with verl).

Every prompt is exactly 7 tokens (``<bos>`` plus ``"ab+cd="``), so batches of prompts never need padding and
left-padded rollouts behave exactly like the unpadded SFT sequences.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from verl_kit.builtin import build_once, one_torch_thread

__all__ = [
    "BUILTIN_MODEL_NAME",
    "build_model",
    "build_tokenizer",
    "ensure_builtin_model",
    "evaluate_greedy",
    "make_dataset",
    "preference_pairs",
    "reward",
    "warm_start",
]

#: The name under which ``verl run`` refers to the model built by :func:`ensure_builtin_model`.
BUILTIN_MODEL_NAME = "builtin:tiny-qwen2-addition"
# Bump the suffix whenever anything that changes the built weights changes, so stale caches are not reused.
# (v1 was a development build: 400 fixed SFT steps that reached ~89% accuracy, leaving GRPO nothing to show.)
_CACHE_SUBDIR = pathlib.Path("builtin") / "tiny-qwen2-addition-v2"
_WARM_START_FILE = "warm_start.json"

DATA_SOURCE = "arithmetic"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = tuple("0123456789+=")
# Sums of two two-digit numbers have at most 3 digits; one more token for <eos>.
MAX_NEW_TOKENS = 4

# The chat template only concatenates: the prompt is the user's text after <bos>, nothing else, so the tokens a
# rollout engine sees are exactly the SFT tokens. A generation prompt adds nothing (the prompt already ends in "=").
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"

# Warm-start defaults, measured on a 2-core CPU with torch.set_num_threads(1). At lr 1e-3 accuracy rises steeply
# (a few % to ~50% within ~50 steps) and *when* it rises depends on the seed (seeds 0-3: between ~115 and ~200
# steps), so the warm start stops at a target accuracy instead of after a fixed number of steps: ~15-25 s of SFT.
# A lower SFT lr (1e-4) reaches the same accuracy with a flatter, fragile policy: one fresh-AdamW RL step at lr 1e-4
# then dropped greedy accuracy from 22% to ~1%, while the lr 1e-3 model improved under the same step.
WARM_START_MAX_STEPS = 400
WARM_START_BATCH_SIZE = 128
WARM_START_LR = 1e-3
WARM_START_TARGET_ACCURACY = 0.2
WARM_START_EVAL_EVERY = 10
SEED = 0


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Builds the character-level tokenizer of the task.

    One token per character of ``0123456789+=`` plus ``<pad>`` (id 0), ``<bos>`` (1), ``<eos>`` (2) and
    ``<unk>`` (3). The tokenizer adds no special tokens on its own (``tok("46")`` is just the two digits); the chat
    template is what puts ``<bos>`` in front of a prompt. Padding is on the left, as generation needs.

    Under transformers 5, ``tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` returns a
    ``BatchEncoding`` (``{"input_ids": [...], "attention_mask": [...]}``), not a bare list of ids; pass
    ``return_dict=False`` to get the list.

    Returns:
        A ``PreTrainedTokenizerFast`` (``TokenizersBackend`` in transformers 5) that survives ``save_pretrained`` and
        ``AutoTokenizer.from_pretrained`` with the same ids and chat template.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split into single characters; special tokens such as "<eos>" are matched before this runs, so they stay whole.
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    # Join characters back without spaces on decode.
    backend.decoder = decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=64,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_dataset(*, seed: int = SEED, n_test: int = 500) -> tuple[list[dict], list[dict]]:
    """Builds all two-digit additions, shuffled deterministically and split into train and test.

    Args:
        seed: Seed of the shuffle; the same seed always gives the same split.
        n_test: Number of rows held out for the test split.

    Returns:
        ``(train_rows, test_rows)`` in the verl row format, e.g. ``{"data_source": "arithmetic", "prompt": [{"role":
        "user", "content": "12+34="}], "ability": "math", "reward_model": {"style": "rule", "ground_truth": "46"},
        "extra_info": {"index": i}}``, where ``index`` is the row's position in the shuffled list of all 8100.

    Raises:
        ValueError: If ``n_test`` is not between 0 and 8100.
    """
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    if not 0 <= n_test <= len(pairs):
        raise ValueError(f"n_test must be between 0 and {len(pairs)}, got {n_test}")
    # A private Random keeps the split independent of the global random state.
    random.Random(seed).shuffle(pairs)
    rows = [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i},
        }
        for i, (a, b) in enumerate(pairs)
    ]
    n_train = len(rows) - n_test
    return rows[:n_train], rows[n_train:]


def preference_pairs(rows: Sequence[dict], *, seed: int = SEED) -> list[dict]:
    """The rows of :func:`make_dataset` with a preferred and a dispreferred response, for DPO, KTO and ORPO.

    ``chosen`` is the sum and ``rejected`` a near miss: off by 1 to 10, or one digit changed (never
    negative, never the sum). A row's wrong answer depends only on ``seed`` and its ``extra_info.index``,
    so a split gives the same pairs however often, and in whatever order, it is built.
    """
    out = []
    for row in rows:
        answer = int(row["reward_model"]["ground_truth"])
        rng = random.Random(seed * 1_000_003 + row["extra_info"]["index"])
        while True:
            if rng.random() < 0.5:
                wrong = answer + rng.choice([-1, 1]) * rng.randint(1, 10)
            else:
                digits = list(str(answer))
                digits[rng.randrange(len(digits))] = str(rng.randrange(10))
                wrong = int("".join(digits))
            if wrong != answer and wrong >= 0:
                break
        out.append({**row, "chosen": str(answer), "rejected": str(wrong)})
    return out


def build_model(tokenizer: transformers.PreTrainedTokenizerBase, *, seed: int = SEED) -> transformers.Qwen2ForCausalLM:
    """Builds a freshly initialised tiny Qwen2 (~0.5M parameters, fp32).

    Args:
        tokenizer: The task tokenizer; fixes the vocabulary size and the pad/bos/eos ids.
        seed: Seed of the weight initialisation. The global torch RNG is left untouched.

    Returns:
        The model in eval mode, with ``generation_config`` set for this tokenizer.
    """
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
        use_cache=True,
        # Measured on 1 thread: sdpa ~5% faster than eager per training step (batch 128), equal for generate; it is
        # also the transformers default, so the saved checkpoint loads the same way everywhere.
        attn_implementation="sdpa",
    )
    # fork_rng: seeding must not change the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.max_new_tokens = MAX_NEW_TOKENS
    model.eval()
    return model


def _prompt_ids(tokenizer: transformers.PreTrainedTokenizerBase, rows: Sequence[dict]) -> torch.Tensor:
    """Tokenizes the rows' prompts through the chat template into a ``(len(rows), prompt_len)`` tensor."""
    ids = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        for row in rows
    ]
    # Every prompt of this task has the same length, so no padding is needed.
    if len({len(x) for x in ids}) != 1:
        raise ValueError("arithmetic prompts must all have the same token length")
    return torch.tensor(ids, dtype=torch.long)


def _sft_batch(
    tokenizer: transformers.PreTrainedTokenizerBase, rows: Sequence[dict]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Builds ``input_ids``, ``attention_mask`` and ``labels`` for prompt + answer + eos, right-padded.

    Labels are -100 on the prompt and the padding so the loss covers only the answer and ``<eos>``.
    """
    prompts = _prompt_ids(tokenizer, rows)
    answers = [tokenizer(row["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"] for row in rows]
    answers = [a + [tokenizer.eos_token_id] for a in answers]
    width = prompts.shape[1] + max(len(a) for a in answers)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    prompt_len = prompts.shape[1]
    for i, answer in enumerate(answers):
        end = prompt_len + len(answer)
        input_ids[i, :prompt_len] = prompts[i]
        input_ids[i, prompt_len:end] = torch.tensor(answer)
        attention_mask[i, :end] = 1
        labels[i, prompt_len:end] = torch.tensor(answer)
    return input_ids, attention_mask, labels


def warm_start(
    model: transformers.PreTrainedModel,
    tokenizer: transformers.PreTrainedTokenizerBase,
    train_rows: Sequence[dict],
    *,
    steps: int = WARM_START_MAX_STEPS,
    batch_size: int = WARM_START_BATCH_SIZE,
    lr: float = WARM_START_LR,
    seed: int = SEED,
    target_accuracy: float | None = None,
    eval_rows: Sequence[dict] | None = None,
    eval_every: int = WARM_START_EVAL_EVERY,
) -> dict[str, Any]:
    """Supervised fine-tuning on prompt + answer + ``<eos>``, with the loss on the answer and ``<eos>`` only.

    Plain PyTorch and AdamW at a constant learning rate, batches drawn epoch by epoch from a seeded permutation.
    Kept deliberately short: the point is a model that is sometimes right, so GRPO has something to reinforce.

    Args:
        model: The model to train in place; left in eval mode.
        tokenizer: The task tokenizer.
        train_rows: Rows from :func:`make_dataset`.
        steps: Number of optimizer steps; the maximum when ``target_accuracy`` is set.
        batch_size: Rows per step.
        lr: AdamW learning rate.
        seed: Seed of the batch order.
        target_accuracy: If set, stop as soon as greedy accuracy on ``eval_rows`` reaches it (checked every
            ``eval_every`` steps). Used because the step at which accuracy takes off varies with the seed.
        eval_rows: Rows for the stopping check; defaults to the first 500 of ``train_rows``.
        eval_every: Steps between stopping checks.

    Returns:
        Statistics: ``steps`` (run), ``max_steps``, ``batch_size``, ``lr``, ``seed``, ``target_accuracy``,
        ``eval_accuracy`` (last stopping check, or None), ``first_loss``, ``final_loss`` (mean over the last 20
        steps), ``seconds`` and ``torch_threads`` (results differ between thread counts).

    Raises:
        ValueError: If ``steps``, ``batch_size`` or ``eval_every`` is below 1, or ``train_rows`` has fewer than
            ``batch_size`` rows.
    """
    if steps < 1 or batch_size < 1 or eval_every < 1:
        raise ValueError(f"steps, batch_size and eval_every must be >= 1, got {steps}, {batch_size}, {eval_every}")
    if len(train_rows) < batch_size:
        raise ValueError(f"train_rows has {len(train_rows)} rows, fewer than batch_size={batch_size}")
    if eval_rows is None:
        eval_rows = train_rows[:500]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def batches() -> Iterator[list[dict]]:
        while True:
            order = torch.randperm(len(train_rows), generator=generator).tolist()
            for start in range(0, len(order) - batch_size + 1, batch_size):
                yield [train_rows[j] for j in order[start : start + batch_size]]

    model.train()
    losses: list[float] = []
    eval_accuracy: float | None = None
    started = time.perf_counter()
    batch_iter = batches()
    from verl_kit.progress import Progress

    with Progress("warm start of the built-in model", total=steps, unit="steps") as bar:
        for step in range(1, steps + 1):
            input_ids, attention_mask, labels = _sft_batch(tokenizer, next(batch_iter))
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if target_accuracy is not None and step % eval_every == 0:
                eval_accuracy = evaluate_greedy(model, tokenizer, eval_rows)
            bar.update(step, loss=losses[-1], accuracy=eval_accuracy)
            if eval_accuracy is not None and target_accuracy is not None and eval_accuracy >= target_accuracy:
                break
    seconds = time.perf_counter() - started
    model.eval()
    tail = losses[-20:]
    return {
        "steps": len(losses),
        "max_steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "target_accuracy": target_accuracy,
        "eval_accuracy": eval_accuracy,
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "seconds": round(seconds, 2),
        "torch_threads": torch.get_num_threads(),
    }


@torch.no_grad()
def evaluate_greedy(
    model: transformers.PreTrainedModel,
    tokenizer: transformers.PreTrainedTokenizerBase,
    rows: Sequence[dict],
    *,
    batch_size: int = 500,
) -> float:
    """Greedy-decodes up to 4 new tokens per prompt and scores the answers with :func:`reward`.

    Args:
        model: The policy.
        tokenizer: The task tokenizer.
        rows: Rows from :func:`make_dataset`.
        batch_size: Prompts per ``generate`` call.

    Returns:
        The fraction of rows answered exactly right (0.0 for no rows).
    """
    if not rows:
        return 0.0
    was_training = model.training
    model.eval()
    correct = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = _prompt_ids(tokenizer, chunk)
        output = model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        responses = tokenizer.batch_decode(output[:, prompts.shape[1] :], skip_special_tokens=False)
        correct += sum(reward(r, row["reward_model"]["ground_truth"]) for r, row in zip(responses, chunk))
    model.train(was_training)
    return correct / len(rows)


def reward(response: str, ground_truth: str) -> float:
    """Rule reward: 1.0 if the response is exactly the ground truth, else 0.0.

    Anything after the first ``<eos>`` is ignored (generation stops there; batched decoding pads after it), other
    special tokens and surrounding whitespace are stripped.

    Args:
        response: The decoded response, with or without special tokens.
        ground_truth: The expected answer, e.g. ``"46"``.

    Returns:
        1.0 or 0.0.
    """
    response = response.split("<eos>", 1)[0]
    for token in SPECIAL_TOKENS:
        response = response.replace(token, "")
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


def _build_into(directory: pathlib.Path) -> None:
    """Builds tokenizer, model and warm start, and saves them as a Hugging Face model directory."""
    tokenizer = build_tokenizer()
    train_rows, test_rows = make_dataset(seed=SEED)
    model = build_model(tokenizer, seed=SEED)
    stats = warm_start(
        model,
        tokenizer,
        train_rows,
        steps=WARM_START_MAX_STEPS,
        batch_size=WARM_START_BATCH_SIZE,
        lr=WARM_START_LR,
        seed=SEED,
        target_accuracy=WARM_START_TARGET_ACCURACY,
    )
    stats["greedy_test_accuracy"] = evaluate_greedy(model, tokenizer, test_rows)
    stats["n_test"] = len(test_rows)
    stats["name"] = BUILTIN_MODEL_NAME
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    # Written last: its presence marks a complete build.
    (directory / _WARM_START_FILE).write_text(json.dumps(stats, indent=2) + "\n")


def ensure_builtin_model(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Returns the directory of ``builtin:tiny-qwen2-addition``, building it on first use (~30 s on one core).

    The model is built with fixed seeds and one torch thread, into a temporary sibling directory that is moved into
    place with ``os.replace`` only when complete, so a crash never leaves a half-written model behind. A file lock
    makes concurrent callers wait for one build instead of racing.

    Args:
        cache_dir: Root of the verl cache; defaults to ``$VERL_CACHE_DIR`` or ``~/.cache/verl``. The model lives in
            ``<cache_dir>/builtin/tiny-qwen2-addition-v2``.

    Returns:
        The model directory: safetensors weights, config, tokenizer files and ``warm_start.json`` (SFT statistics
        and greedy test accuracy).
    """
    def build(staging: pathlib.Path) -> None:
        with one_torch_thread():
            _build_into(staging)

    return build_once(_CACHE_SUBDIR.name, build, done_file=_WARM_START_FILE, cache_dir=cache_dir)
