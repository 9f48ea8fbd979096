"""``verl run --dry-run`` and ``verl config check``: everything a run checks before step 1, without the run.

The checks are the core's (:func:`verl_core.api.check`, which walks the start of the trainer's set-up
through its own checks, so a config it passes starts and one it refuses fails with the same message; it
never loads weights, starts an executor or an engine, or writes anything). This module adds what a user
wants to see before paying for a run: one rendered prompt and its token count, the step's dataflow, where
each role runs, and an estimate of memory per role from the parameter count in the weight files' headers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from verl_core.config import Config, PluginSection

__all__ = ["DryRunReport", "dry_run", "unset_keys", "parameter_count", "memory_estimate"]

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1,
                      "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass
class DryRunReport:
    """What :func:`dry_run` found. ``warnings`` would not stop the run; an error raises instead."""

    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, line: str = "") -> None:
        self.lines.append(line)


# ----------------------------------------------------------------------------- settings shown by `config show`
def unset_keys(cfg: Config) -> dict[str, str]:
    """``section.key`` -> what an unset (``None``) setting resolves to in this config, and why.

    ``verl config show`` writes these as comments: TOML has no null, and a key whose default depends on
    other settings (``rollout.max_log_prob_gap`` on the dtypes) must still be listed with its default.
    """
    out: dict[str, str] = {}
    for section, value in cfg.sections.items():
        obj = value.config if isinstance(value, PluginSection) else value
        if obj is None or not dataclasses.is_dataclass(obj):
            continue
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            if getattr(obj, f.name) is not None:
                continue
            key = f"{section}.{f.name}"
            doc = " ".join(docs.get(f.name, "").split())
            derived = _DERIVED.get(key)
            out[key] = (f"{derived(cfg)}  # unset: {doc}" if derived else f"(unset)  # {doc}").rstrip(" #")
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its description in the ``Attributes:`` section of ``cls``'s docstring (and its bases')."""
    docs: dict[str, str] = {}
    for klass in reversed(getattr(cls, "__mro__", (cls,))):
        current, inside = None, False
        for line in (klass.__doc__ or "").splitlines():
            stripped = line.strip()
            if stripped == "Attributes:":
                inside = True
                continue
            if not inside:
                continue
            name, sep, text = stripped.partition(":")
            if sep and name.isidentifier() and line.startswith(" " * 8) and not line.startswith(" " * 12):
                current = name
                docs[current] = text.strip()
            elif stripped and current:
                docs[current] += " " + stripped
            elif not stripped and current:
                current, inside = None, False
    return docs


def _log_prob_gap(cfg: Config) -> str:
    from verl_core.kit import run_guard_limit  # the run's rule; the key is unset here

    dtypes = [cfg.model.dtype, cfg.backend.config.compute_dtype(cfg.model.dtype),
              cfg.rollout.config.compute_dtype(cfg.model.dtype)]
    return f"{run_guard_limit(cfg):g}  # from compute dtypes model/backend/rollout = {'/'.join(dtypes)}"


#: Unset settings whose value the run derives from others, and how (as the trainer does).
_DERIVED: dict[str, Callable[[Config], str]] = {"rollout.max_log_prob_gap": _log_prob_gap}


# ----------------------------------------------------------------------------- model size and memory
def parameter_count(model_dir: str | Path) -> int | None:
    """Parameters in a model directory's ``*.safetensors`` files, from their headers (no tensor is read)."""
    total, found = 0, False
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry.get("shape", [])) if entry.get("shape") else 1
                found = True
    return total if found else None


def _estimated_parameters(mc: dict[str, Any]) -> int | None:
    """Parameters of a decoder from its ``config.json`` when there are no weight files to read."""
    text = mc.get("text_config") or mc
    try:
        h, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    inter = int(text.get("intermediate_size") or 4 * h)
    heads = int(text.get("num_attention_heads") or 1)
    kv = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or h // heads)
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    embeddings = vocab * h * (1 if text.get("tie_word_embeddings", True) else 2)
    return layers * (attn + 3 * h * inter + 2 * h) + embeddings + h


def memory_estimate(cfg: Config, model_config: dict[str, Any], params: int, *, needs: Any,
                    world_size: int) -> list[tuple[str, dict[str, float]]]:
    """GiB per rank and role: parameters, gradients, optimizer (Adam: two float32 moments, plus a float32
    master copy for 16-bit weights), activations at ``backend.micro_batch_size`` sequences of the longest
    length, and the rollout's KV cache for a step's samples. An estimate to size a run, not a promise:
    activations follow the usual ~34 x hidden bytes per token and layer, logits count one chunk."""
    bc, rc = cfg.backend.config, cfg.rollout.config
    text = model_config.get("text_config") or model_config
    h, layers = int(text.get("hidden_size") or 0), int(text.get("num_hidden_layers") or 0)
    vocab = int(text.get("vocab_size") or 0)
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or (h // heads if heads else 0))
    dtype = getattr(bc, "param_dtype", None) or cfg.model.dtype
    pbytes = _BYTES.get(cfg.model.dtype, 4)
    seq = cfg.data.max_prompt_length + rc.max_new_tokens
    samples = cfg.data.batch_size * rc.n
    micro = min(int(getattr(bc, "micro_batch_size", 0) or samples), samples)
    trainable = params
    if getattr(bc, "lora_rank", 0):
        trainable = max(1, 2 * layers * 7 * h * bc.lora_rank)  # adapters on the 7 projections, roughly
    shard = max(1, world_size)
    gib = 2.0 ** 30
    weights = params * pbytes / shard / gib
    grads = trainable * _BYTES.get(dtype, 4) / shard / gib
    optimizer = trainable * (8 + (4 if pbytes < 4 else 0)) / shard / gib
    chunk = min(seq, int(getattr(bc, "logits_chunk_size", 0) or seq))
    act_bytes = 16 if dtype in ("bfloat16", "float16") or getattr(bc, "autocast", "off") != "off" else 32
    checkpointed = getattr(bc, "activation_checkpointing", False)
    activations = (micro * seq * h * (2 if checkpointed else act_bytes) * layers + micro * chunk * vocab * 4) / gib
    forward_micro = int(getattr(bc, "log_prob_micro_batch_size", 0) or micro)
    forward_act = min(forward_micro, samples) * chunk * vocab * 4 / gib
    kv = samples * seq * layers * 2 * kv_heads * head_dim * pbytes / gib
    roles = [("actor", {"params": weights, "grads": grads, "optimizer": optimizer, "activations": activations})]
    if needs.critic:
        roles.append(("critic", {"params": weights, "grads": grads, "optimizer": optimizer,
                                 "activations": activations}))
    if needs.reference:
        roles.append(("reference", {"params": weights, "activations": forward_act}))
    roles.append(("rollout", {"params": params * pbytes / gib, "kv_cache": kv}))
    return roles


# ----------------------------------------------------------------------------- the dry run
def dry_run(cfg: Config, registry: Any, *, rows_shown: int = 1) -> DryRunReport:
    """Check ``cfg`` as the run does before step 1 (:func:`verl_core.api.check`), and describe the run.

    Raises what the run would raise before step 1 (:class:`~verl_core.config.ConfigError`,
    :class:`~verl_core.contracts.DataError`, :class:`~verl_core.registry.PluginError`, ...), with its message.
    """
    from verl_core.api import check
    from verl_core.registry import BUILTIN_PREFIX

    started = time.perf_counter()
    report = DryRunReport()
    report.add(f"profile: {cfg.profile}")
    plan = check(cfg, registry)
    report.warnings += plan.warnings
    _describe(report, cfg, registry, model_path=plan.model_path, built=cfg.model.path.startswith(BUILTIN_PREFIX),
              model_config=plan.model_config, train_rows=plan.train_rows, val_rows=plan.val_rows,
              max_steps=plan.max_steps, needs=plan.needs, dataflow=plan.dataflow, reused=plan.reused,
              world_size=plan.world_size, rows_shown=rows_shown)
    report.seconds = time.perf_counter() - started
    return report


def _describe(report: DryRunReport, cfg: Config, registry: Any, *, model_path: str, built: bool,
              model_config: dict[str, Any], train_rows: list[dict[str, Any]], val_rows: list[dict[str, Any]],
              max_steps: int, needs: Any, dataflow: Any, reused: bool, world_size: int, rows_shown: int) -> None:
    text = model_config.get("text_config") or model_config
    params = parameter_count(model_path) or _estimated_parameters(model_config) or 0
    arch = ", ".join(f"{k} {text[v]}" for k, v in (("layers", "num_hidden_layers"), ("heads", "num_attention_heads"),
                                                   ("kv heads", "num_key_value_heads"), ("hidden", "hidden_size"),
                                                   ("positions", "max_position_embeddings")) if v in text)
    report.add(f"model: {cfg.model.path}" + (f" -> {model_path}" if built else "") +
               f" ({model_config.get('model_type', '?')}, {params / 1e6:.2f}M parameters; {arch})")
    positions = text.get("max_position_embeddings")
    longest = cfg.data.max_prompt_length + cfg.rollout.config.max_new_tokens
    if isinstance(positions, int) and longest > positions:
        report.warnings.append(f"data.max_prompt_length={cfg.data.max_prompt_length} + rollout.max_new_tokens="
                               f"{cfg.rollout.config.max_new_tokens} = {longest} tokens, more than the model's "
                               f"max_position_embeddings={positions}")
    plugins = ", ".join(f"{s} {cfg.sections[s].name}" for s in ("backend", "rollout", "algorithm", "executor",
                                                               "environment") if cfg.sections[s].name)
    report.add(f"plugins: {plugins} (imported)")
    report.add(f"data: {len(train_rows)} training prompts from {cfg.data.train}, {len(val_rows)} validation "
               f"prompts; {cfg.data.batch_size} prompts x {cfg.rollout.config.n} samples per step")
    why = (f"run.epochs={cfg.run.epochs} x {len(train_rows)} prompts // data.batch_size={cfg.data.batch_size}"
           if cfg.run.epochs else "run.max_steps")
    report.add(f"steps: {max_steps} ({why})")
    for row in train_rows[:rows_shown]:
        report.add(f"prompt 0 ({len(row['prompt_ids'])} tokens, data.max_prompt_length={cfg.data.max_prompt_length}"
                   f", {'chat template' if cfg.data.apply_chat_template else 'raw text'}):")
        report.add("  " + json.dumps(row["prompt_text"])[1:-1])
        report.add(f"  ground truth: {row['ground_truth']!r}, data_source {row['data_source']!r}")
    report.add("dataflow (stages on one line may run at once):")
    for line in dataflow.describe().splitlines():
        report.add(f"  {line}")
    if reused:
        report.add("  (old_log_probs reused from the update's own forward: one epoch, one mini-batch, no dropout)")
    report.add("placement:")
    for line in _placement(cfg, needs, world_size):
        report.add(f"  {line}")
    samples = cfg.data.batch_size * cfg.rollout.config.n
    micro = min(int(getattr(cfg.backend.config, "micro_batch_size", 0) or samples), samples)
    report.add(f"memory per rank (estimate; {cfg.model.dtype} weights, micro-batch {micro} x {longest} tokens"
               + (f", sharded over {world_size} ranks" if world_size > 1 else "") + "):")
    for role, parts in memory_estimate(cfg, model_config, params, needs=needs, world_size=world_size):
        report.add(f"  {role:<10} {_size(sum(parts.values())):>10}  ("
                   + ", ".join(f"{k} {_size(v)}" for k, v in parts.items()) + ")")


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"


def _placement(cfg: Config, needs: Any, world_size: int) -> list[str]:
    roles = ["actor"] + (["critic"] if needs.critic else []) + (["reference"] if needs.reference else []) + ["rollout"]
    ec = cfg.executor.config
    placement = dict(getattr(ec, "placement", {}) or {})
    pools = {"default": world_size, **dict(getattr(ec, "pools", {}) or {})}
    if cfg.executor.name == "local":
        return [f"executor local: every role in this process ({', '.join(roles)}); trainer.mode={cfg.trainer.name}"]
    lines = [f"executor {cfg.executor.name}: nodes {getattr(ec, 'nnodes', 1)}, trainer.mode={cfg.trainer.name}"]
    by_pool: dict[str, list[str]] = {}
    for role in roles:
        by_pool.setdefault(placement.get(role, "default"), []).append(role)
    for pool, members in by_pool.items():
        lines.append(f"pool {pool!r} ({pools.get(pool, '?')} processes): {', '.join(members)}"
                     + (" (colocated)" if len(members) > 1 else ""))
    return lines
