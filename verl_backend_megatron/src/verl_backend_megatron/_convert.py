"""Hugging Face Qwen2/Llama <-> Megatron GPT: the architecture, the names and the tensor-parallel layout.

:class:`Architecture` reads what Megatron needs from a Hugging Face ``config.json`` and refuses what the
conversion does not cover. Weights move one Megatron parameter at a time: :func:`load_shard` builds
this rank's shard of a parameter from the Hugging Face tensors; :func:`to_hf` turns a gathered
(tensor-parallel unsharded) Megatron parameter back into the Hugging Face tensors it came from.

Layouts (Megatron's, for the local layer spec):

* ``linear_qkv``: per query group, that group's query heads then its key head then its value head,
  groups one after another; tensor-parallel ranks hold whole groups (a contiguous block of rows).
  Qwen2's q/k/v biases follow the same layout.
* ``linear_fc1``: gate and up projections; each tensor-parallel rank holds its slice of the gate
  rows followed by its slice of the up rows.
* column-parallel (``linear_qkv``, ``linear_fc1``, the embedding and the output layer) split rows,
  row-parallel (``linear_proj``, ``linear_fc2``) split columns; norms are replicated.
* the vocabulary is padded to a multiple of the tensor-parallel size; padded rows are zeros and
  never scored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

__all__ = ["Architecture", "SUPPORTED", "UnsupportedModelError", "HFSource", "gather_dim", "hf_param_order",
           "layer_params", "load_shard", "mapping", "to_hf"]

#: Hugging Face model types the conversion covers.
SUPPORTED = ("qwen2", "llama")


class UnsupportedModelError(ValueError):
    """The model is not one the Megatron conversion covers."""


@dataclass(frozen=True)
class Architecture:
    """What Megatron needs to know about a Qwen2/Llama model."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    tied_embeddings: bool
    qkv_bias: bool
    max_positions: int
    attention_dropout: float

    @classmethod
    def from_hf_config(cls, config: Any, *, source: str) -> "Architecture":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED:
            raise UnsupportedModelError(f"{source} is a {model_type!r} model; the megatron backend converts "
                                        f"{', '.join(SUPPORTED)} (Qwen2 and Llama families); use backend.name='fsdp' "
                                        f"for other architectures")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act={act!r}; the megatron backend supports silu "
                                        f"(SwiGLU) models")
        rope = getattr(config, "rope_parameters", None) or {}
        scaling = getattr(config, "rope_scaling", None) or {}
        kind = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if kind not in ("default", None):
            raise UnsupportedModelError(f"{source}: RoPE scaling {kind!r} is not converted; the megatron backend "
                                        f"supports plain RoPE (any rope_theta)")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModelError(f"{source}: sliding-window attention is not supported by the megatron backend")
        if model_type == "llama" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
            raise UnsupportedModelError(f"{source}: Llama with attention_bias/mlp_bias is not supported by the "
                                        f"megatron backend (only Qwen2's q/k/v biases are)")
        heads = config.num_attention_heads
        return cls(model_type=model_type, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                   num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   ffn_hidden_size=config.intermediate_size, vocab_size=config.vocab_size,
                   norm_eps=config.rms_norm_eps, rope_theta=float(theta),
                   tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   qkv_bias=model_type == "qwen2", max_positions=config.max_position_embeddings,
                   attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0))

    @classmethod
    def from_dir(cls, path: str, *, source: str) -> "Architecture":
        """Read ``config.json`` only (no weights, no model class): cheap enough to validate with."""
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(path), source=source)

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp


class HFSource:
    """Hugging Face tensors by name, read one at a time from safetensors files (or a loaded module)."""

    def __init__(self, *, path: str | None = None, module: torch.nn.Module | None = None) -> None:
        self._state = module.state_dict() if module is not None else None
        self._where: dict[str, Path] = {}
        if self._state is None:
            root = Path(path)
            index = root / "model.safetensors.index.json"
            if index.is_file():
                self._where = {k: root / v for k, v in json.loads(index.read_text())["weight_map"].items()}
            else:
                from safetensors import safe_open

                for file in sorted(root.glob("*.safetensors")):
                    with safe_open(str(file), framework="pt") as f:
                        self._where.update({k: file for k in f.keys()})
            if not self._where:
                raise FileNotFoundError(f"model.path: {path!r} has no *.safetensors weights (the megatron backend "
                                        f"reads safetensors; re-save the model with save_pretrained)")

    def __contains__(self, name: str) -> bool:
        return name in (self._state if self._state is not None else self._where)

    def get(self, name: str) -> torch.Tensor:
        if self._state is not None:
            return self._state[name].detach()
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as f:
            return f.get_tensor(name)


# ----------------------------------------------------------------------------- names
# Megatron parameter suffix inside a decoder layer -> (kind, Hugging Face names under model.layers.{i}.).
_LAYER = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                  "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                "self_attn.v_proj.bias")),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gated", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}


def layer_params(arch: Architecture) -> list[str]:
    return [k for k in _LAYER if arch.qkv_bias or not k.endswith("linear_qkv.bias")]


def mapping(name: str, *, arch: Architecture, layer_offset: int, critic: bool) -> tuple[str, tuple[str, ...]]:
    """``(kind, Hugging Face names)`` of the local Megatron parameter ``name``."""
    if name.startswith("decoder.layers."):
        local, suffix = name[len("decoder.layers."):].split(".", 1)
        kind, hf = _LAYER[suffix]
        prefix = f"model.layers.{int(local) + layer_offset}."
        return kind, tuple(prefix + n for n in hf)
    if name == "embedding.word_embeddings.weight":
        return "vocab", ("model.embed_tokens.weight",)
    if name == "decoder.final_layernorm.weight":
        return "replicated", ("model.norm.weight",)
    if name == "output_layer.weight":
        return "vocab", ("model.embed_tokens.weight" if arch.tied_embeddings else "lm_head.weight",)
    if critic and name in ("value_head.weight", "value_head.bias"):
        return "replicated", ("score." + name.split(".", 1)[1],)
    raise KeyError(f"no Hugging Face counterpart known for Megatron parameter {name!r}")


# ----------------------------------------------------------------------------- layouts
def _qkv_full(arch: Architecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    q = q.reshape(g, (arch.num_heads // g) * d, *tail)
    return torch.cat([q, k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1).reshape(-1, *tail)


def _qkv_split(arch: Architecture, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // g
    tail = full.shape[1:]
    grouped = full.reshape(g, (per + 2) * d, *tail)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def load_shard(kind: str, hf: list[torch.Tensor], *, arch: Architecture, tp: int, tp_rank: int) -> torch.Tensor:
    """This tensor-parallel rank's shard of one Megatron parameter, from its Hugging Face tensors."""
    if kind == "replicated":
        return hf[0]
    if kind == "qkv":  # whole query groups per rank: a contiguous block of the grouped rows
        return _qkv_full(arch, *hf).chunk(tp, dim=0)[tp_rank]
    if kind == "gated":
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    if kind == "row":
        return hf[0].chunk(tp, dim=1)[tp_rank]
    if kind == "vocab":
        weight = hf[0]
        pad = arch.padded_vocab(tp) - weight.shape[0]
        if pad:
            weight = torch.cat([weight, weight.new_zeros(pad, *weight.shape[1:])])
        return weight.chunk(tp, dim=0)[tp_rank]
    raise ValueError(f"unknown layout {kind!r}")


def gather_dim(kind: str) -> int | None:
    """The dimension tensor-parallel shards of a ``kind`` parameter are concatenated along (None: replicated)."""
    return {"replicated": None, "row": 1}.get(kind, 0)


def to_hf(kind: str, shards: list[torch.Tensor], *, arch: Architecture) -> list[torch.Tensor]:
    """The Hugging Face tensors of one Megatron parameter, from its tensor-parallel shards in rank order."""
    if kind == "replicated":
        return [shards[0]]
    if kind == "row":
        return [torch.cat(shards, dim=1)]
    if kind == "qkv":
        return list(_qkv_split(arch, torch.cat(shards, dim=0)))
    if kind == "gated":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if kind == "vocab":
        return [torch.cat(shards, dim=0)[: arch.vocab_size]]
    raise ValueError(f"unknown layout {kind!r}")


def hf_param_order(arch: Architecture, *, critic: bool) -> Iterator[tuple[str, int | None, str]]:
    """``(megatron name with global layer index, global layer or None, where)`` in Hugging Face order.

    ``where`` is ``"first"`` (embedding, pipeline stage 0), ``"last"`` (final norm, heads) or
    ``"layer"``; a name's layer part is ``decoder.layers.<global>.``, re-indexed per stage by the caller.
    """
    yield "embedding.word_embeddings.weight", None, "first"
    for layer in range(arch.num_layers):
        for suffix in layer_params(arch):
            yield f"decoder.layers.{layer}.{suffix}", layer, "layer"
    yield "decoder.final_layernorm.weight", None, "last"
    if critic:
        yield "value_head.weight", None, "last"
        yield "value_head.bias", None, "last"
    elif not arch.tied_embeddings:
        yield "output_layer.weight", None, "last"

