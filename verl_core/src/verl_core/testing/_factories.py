"""Small synthetic inputs for the conformance suites.

:func:`make_batch` builds a :class:`~verl_core.batch.Batch` with the awkward parts real batches have
(left-padded prompts, right-padded responses, tool tokens inside a response, empty responses) so
that an implementation is tested on them rather than on a tidy rectangle. :func:`tiny_model_dir`
writes a tiny Qwen2 to disk for backends and engines that load from a path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from verl_core.batch import Batch

__all__ = ["make_batch", "tiny_model_dir"]


def make_batch(
    *,
    batch_size: int = 8,
    prompt_length: int = 6,
    response_length: int = 8,
    vocab_size: int = 16,
    group_size: int = 4,
    pad_id: int = 0,
    tool_tokens: bool = True,
    empty_rows: Sequence[int] = (),
    scores: torch.Tensor | Sequence[float] | None = None,
    old_log_probs: bool = True,
    ref_log_probs: bool = False,
    values: bool = False,
    advantages: bool = False,
    seed: int = 0,
) -> Batch:
    """Builds a small random batch laid out like one from a rollout.

    Row 0 always has a full-length prompt and a full-length response and row 1 (when there is one)
    is padded on both sides, so every batch exercises padding without collapsing the widths. Tool
    tokens, when asked for, are a span in the middle of each response long enough to hold one:
    real tokens (``response_attention_mask`` 1) that the policy did not produce
    (``response_mask`` 0).

    Args:
        batch_size: number of samples ``B``.
        prompt_length: prompt width ``P``; prompts are left-padded to it.
        response_length: response width ``R``; responses are right-padded to it.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        group_size: consecutive samples sharing a group id (1 gives a group per sample).
        pad_id: id written at padded positions.
        tool_tokens: mark a span inside longer responses as tool output.
        empty_rows: rows whose response is empty (both response masks all 0).
        scores: sequence scores ``[B]``; random in ``[0, 1)`` when not given.
        old_log_probs: set ``old_log_probs`` and ``rollout_log_probs`` (negative, random).
        ref_log_probs: set ``ref_log_probs`` (``old_log_probs`` plus a little noise).
        values: set ``values`` (random critic values).
        advantages: set ``advantages`` and ``returns`` (random, zero where ``response_mask`` is 0).
        seed: seed of a private generator; the global torch RNG is left alone.

    Returns:
        The batch, with ``token_rewards`` derived from the scores, ``info["pad_token_id"]`` set and
        ``info["max_new_tokens"]`` = ``response_length`` (the budget, which the longest response fills).

    Raises:
        ValueError: if a size is not positive or ``batch_size`` is not a multiple of ``group_size``.
    """
    if min(batch_size, prompt_length, response_length, vocab_size, group_size) < 1:
        raise ValueError("batch_size, prompt_length, response_length, vocab_size and group_size must be >= 1")
    if batch_size % group_size:
        raise ValueError(f"batch_size={batch_size} must be a multiple of group_size={group_size}")
    from verl_core.batch import scores_to_token_rewards

    g = torch.Generator().manual_seed(seed)
    B, P, R = batch_size, prompt_length, response_length

    prompt_lengths = torch.randint(1, P + 1, (B,), generator=g)
    response_lengths = torch.randint(1, R + 1, (B,), generator=g)
    # Pin the shape-defining rows so the widths are real and padding is always present.
    prompt_lengths[0], response_lengths[0] = P, R
    if B > 1:
        prompt_lengths[1], response_lengths[1] = max(1, P // 2), max(1, R // 2)
    for row in empty_rows:
        response_lengths[row] = 0

    cols_p = torch.arange(P).expand(B, P)
    prompt_mask = (cols_p >= (P - prompt_lengths).unsqueeze(1)).long()
    prompt_ids = torch.where(prompt_mask.bool(), torch.randint(0, vocab_size, (B, P), generator=g),
                             torch.full((B, P), pad_id))

    cols_r = torch.arange(R).expand(B, R)
    attention = (cols_r < response_lengths.unsqueeze(1)).long()
    response_ids = torch.where(attention.bool(), torch.randint(0, vocab_size, (B, R), generator=g),
                               torch.full((B, R), pad_id))
    response_mask = attention.clone()
    if tool_tokens:
        for row in range(B):
            length = int(response_lengths[row])
            if length >= 4:
                # Policy tokens on both sides of the span, as in a tool call followed by an answer.
                start = length // 3
                response_mask[row, start:start + max(1, length // 3)] = 0

    if scores is None:
        score_t = torch.rand(B, generator=g)
    else:
        score_t = torch.as_tensor(scores, dtype=torch.float32)
        if score_t.shape != (B,):
            raise ValueError(f"scores must have shape [{B}], got {tuple(score_t.shape)}")

    batch = Batch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_attention_mask=attention,
        response_mask=response_mask,
        group_ids=torch.arange(B // group_size).repeat_interleave(group_size),
        scores=score_t,
        token_rewards=scores_to_token_rewards(score_t, response_mask),
        finish_reasons=["stop" if int(n) < R else "length" for n in response_lengths],
        info={"pad_token_id": pad_id, "max_new_tokens": R},  # the response budget, as a rollout records it
    )
    changes: dict[str, torch.Tensor] = {}
    if old_log_probs:
        old = -torch.rand(B, R, generator=g) * 3.0 - 0.05
        changes["old_log_probs"] = old
        changes["rollout_log_probs"] = old + 0.01 * torch.randn(B, R, generator=g)
        if ref_log_probs:
            changes["ref_log_probs"] = old + 0.1 * torch.randn(B, R, generator=g)
    elif ref_log_probs:
        changes["ref_log_probs"] = -torch.rand(B, R, generator=g) * 3.0 - 0.05
    if values:
        changes["values"] = torch.randn(B, R, generator=g)
    if advantages:
        adv = torch.randn(B, R, generator=g) * response_mask
        changes["advantages"] = adv
        changes["returns"] = adv.clone()
    return batch.replace(**changes)


def tiny_model_dir(tmp_path: str | os.PathLike[str], *, seed: int = 0) -> str:
    """Writes a tiny Qwen2 (~0.6M parameters, fp32) and a byte-level tokenizer as a Hugging Face model directory.

    The model is freshly initialised, which is all a contract test needs and takes well under a
    second. It is shaped like the built-in addition model (2 layers, hidden size 128, 64
    positions, untied embeddings), with the ChatML byte tokenizer of
    :func:`~verl_core.testing.build_byte_tokenizer`, so any text can be a prompt.

    Args:
        tmp_path: directory to write into (a ``tiny-model`` subdirectory is created).
        seed: seed of the weight initialisation; the global torch RNG is left untouched.

    Returns:
        The model directory as a string, ready for ``from_pretrained`` or ``ModelSpec(path=...)``.
    """
    import transformers

    from verl_core.testing._text_models import build_byte_tokenizer

    out = Path(tmp_path) / "tiny-model"
    tokenizer = build_byte_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        tie_word_embeddings=False, dtype="float32", attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def chat_prompt_ids(tokenizer: Any, texts: Sequence[str] = ("12+34=", "5+6=", "123+4=", "99+1=")) -> list[list[int]]:
    """Each text as one user turn through the tokenizer's chat template, as token ids ready for a
    rollout engine (default: addition prompts of different lengths, so padding is exercised)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]
