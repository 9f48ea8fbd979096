"""Tiny models that read real text, for tests of text datasets and reward models.

The built-in addition model's tokenizer knows only ``0-9 + =``. GSM8K- or MATH-style prompts need a
tokenizer that encodes any text (so does :func:`~verl_core.testing.tiny_model_dir`, which uses it too): :func:`build_byte_tokenizer` is a byte-level BPE without merges (one
token per UTF-8 byte, like GPT-2's alphabet) plus ChatML special tokens and a ChatML chat template, the
shape of Qwen's tokenizers. The models on top are freshly initialised tiny Qwen2s, built in well under
a second with no downloads.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["build_byte_tokenizer", "tiny_text_model_dir", "tiny_reward_model_dir"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_byte_tokenizer():
    """A byte-level tokenizer (259 tokens) with ChatML special tokens and chat template.

    ``<|endoftext|>`` is the pad token and ``<|im_end|>`` the end-of-turn (eos) token, as in Qwen2.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left",
                                                     model_max_length=4096)
    tokenizer.add_special_tokens({"pad_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[2],
                                  "additional_special_tokens": list(SPECIAL_TOKENS[1:2])})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _config(tokenizer, *, hidden: int, layers: int, max_positions: int):
    import transformers

    return transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, tie_word_embeddings=True)


def tiny_text_model_dir(tmp_path: str | os.PathLike[str], *, seed: int = 0, hidden: int = 32, layers: int = 2,
                        max_positions: int = 1024) -> str:
    """A freshly initialised tiny Qwen2 causal LM with the byte-level tokenizer, written to a directory.

    Returns:
        The model directory (``<tmp_path>/tiny-text-model``), ready for ``verl run --model``.
    """
    import torch
    import transformers

    out = Path(tmp_path) / "tiny-text-model"
    tokenizer = build_byte_tokenizer()
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(_config(tokenizer, hidden=hidden, layers=layers,
                                                  max_positions=max_positions))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def tiny_reward_model_dir(tmp_path: str | os.PathLike[str], *, seed: int = 0, hidden: int = 32, layers: int = 2,
                          max_positions: int = 1024) -> str:
    """A freshly initialised tiny ``Qwen2ForSequenceClassification`` (one label) with the byte-level tokenizer.

    Returns:
        The model directory (``<tmp_path>/tiny-reward-model``), ready for ``reward.model_path``.
    """
    import torch
    import transformers

    out = Path(tmp_path) / "tiny-reward-model"
    tokenizer = build_byte_tokenizer()
    torch.manual_seed(seed)
    config = _config(tokenizer, hidden=hidden, layers=layers, max_positions=max_positions)
    config.num_labels = 1
    model = transformers.Qwen2ForSequenceClassification(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)
