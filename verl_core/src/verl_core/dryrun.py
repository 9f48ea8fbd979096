"""``verl run --dry-run`` and ``verl config check``: everything a run checks before step 1, without the run.

:func:`dry_run` walks the start of :meth:`Trainer.setup <verl_core.trainer.Trainer.setup>` in its order and
through the trainer's own checks (model and data paths, the tokenizer, the run directory, the algorithm's
needs, the data through the chat template, the reward, the trainer mode, the backend's layout against the
model's ``config.json``), so a config it passes starts and one it refuses fails with the same message. It
never loads weights, starts an executor or an engine, and writes nothing. It adds what a user wants to see
before paying for a run: one rendered prompt and its token count, the step's dataflow, where each role runs,
and an estimate of memory per role from the parameter count in the weight files' headers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from verl_core.config import Config, PluginSection, field_docs

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


def _log_prob_gap(cfg: Config) -> str:
    from verl_core.rollout_utils import guard_limit

    dtypes = [cfg.model.dtype, cfg.backend.config.compute_dtype(cfg.model.dtype),
              cfg.rollout.config.compute_dtype(cfg.model.dtype)]
    return f"{guard_limit(None, dtypes):g}  # from compute dtypes model/backend/rollout = {'/'.join(dtypes)}"


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
    """Check ``cfg`` as :meth:`Trainer.setup` does up to the first worker, and describe the run.

    Raises what the run would raise before step 1 (:class:`~verl_core.config.ConfigError`,
    :class:`~verl_core.contracts.DataError`, :class:`~verl_core.registry.PluginError`, ...), with its message.
    A ``builtin:`` model is built on first use, as the run builds it (later runs find it cached).
    """
    from verl_core.checkpoint import CheckpointManager
    from verl_core.sampler import PromptSampler
    from verl_core.dataflow import DataflowBuilder
    from verl_core.hooks import build_plugin_manager
    from verl_core.contracts import ModelSpec
    from verl_core.registry import BUILTIN_PREFIX
    from verl_core.rundir import check_output_dir
    from verl_core.assembly import (check_roles, check_sources, check_step_source, critic_spec, load_data,
                                    load_tokenizer, make_boundary, resolve_model_path, reusable_old_log_probs)
    from verl_core.assembly import model_config as read_model_config
    from verl_core.trainer import Trainer

    started = time.perf_counter()
    report = DryRunReport()
    report.add(f"profile: {cfg.profile}")
    trainer = Trainer(cfg, registry=registry)
    built = cfg.model.path.startswith(BUILTIN_PREFIX)
    model_path = resolve_model_path(cfg.model.path, registry)
    tok_path = cfg.model.tokenizer or model_path
    check_sources(trainer, model_path, tok_path)
    tokenizer, padded = load_tokenizer(cfg, tok_path)
    _check_run_dir(cfg, registry, check_output_dir)
    if padded:
        report.warnings.append(padded)
    trainer.tokenizer = tokenizer
    trainer.model_spec = ModelSpec(path=model_path, tokenizer_path=tok_path, dtype=cfg.model.dtype,
                                   trust_remote_code=cfg.model.trust_remote_code)
    algorithm = registry.load("algorithm", cfg.algorithm.name)(cfg.algorithm.config)
    trainer.algorithm = algorithm
    needs = algorithm.requirements()
    if cfg.environment.name:
        registry.load("environment", cfg.environment.name)
    trainer.critic_spec = critic_spec(trainer, needs.critic)
    data_logger = logging.getLogger("verl.data")  # its warnings go to the report, not between its lines
    captured = _Capture()
    data_logger.addHandler(captured)
    try:
        train_rows, val_rows = load_data(trainer, needs.data)
    finally:
        data_logger.removeHandler(captured)
    report.warnings += captured.messages
    PromptSampler(len(train_rows), cfg.data.batch_size, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    max_steps = (cfg.run.epochs * (len(train_rows) // cfg.data.batch_size) if cfg.run.epochs else cfg.run.max_steps)
    reward = registry.load("scorer", cfg.reward.name)(
        config=cfg.reward.config, registry=registry, tokenizer=tokenizer,
        data_sources={r["data_source"] for r in (*train_rows, *val_rows)})
    reward_model = reward.reward_model_path()
    reward.close()
    backend_config = cfg.backend.config
    if not backend_config.total_training_steps:
        backend_config = dataclasses.replace(backend_config, total_training_steps=max_steps)
    check_roles(registry.load("backend", cfg.backend.name), cfg.backend.name, needs, reward_model)
    backend = registry.load("backend", cfg.backend.name)(backend_config)
    builder = DataflowBuilder()
    algorithm.build_dataflow(builder)
    trainer.dataflow = builder.build()
    check_step_source(trainer, needs)
    reused = reusable_old_log_probs(trainer)
    make_boundary(trainer)
    build_plugin_manager(registry, loggers=cfg.run.loggers, disable_hooks=cfg.run.disable_hooks)
    world_size = int(getattr(cfg.executor.config, "world_size", 1) or 1)
    backend.check(model=trainer.model_spec, world_size=world_size)
    registry.load("executor", cfg.executor.name)
    registry.load("rollout", cfg.rollout.name)
    if cfg.run.resume not in ("auto", "never", "force"):
        CheckpointManager.verify(CheckpointManager.resolve(cfg.run.resume))

    model_config = read_model_config(trainer) or {}
    _describe(report, cfg, registry, model_path=model_path, built=built, model_config=model_config,
              train_rows=train_rows, val_rows=val_rows, max_steps=max_steps, needs=needs,
              dataflow=trainer.dataflow, reused=reused, world_size=world_size, rows_shown=rows_shown)
    report.seconds = time.perf_counter() - started
    return report


class _Capture(logging.Handler):
    """Keeps the messages of a logger's warnings (the data loader's), for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _check_run_dir(cfg: Config, registry: Any, check_output_dir: Callable[[Path], None]) -> None:
    """The run directory's checks of :func:`verl_core.rundir.open_run_dir`, writing nothing."""
    from verl_core.rundir import refused_resume

    run_dir = Path(cfg.run.output_dir)
    check_output_dir(run_dir)
    problem = refused_resume(run_dir, cfg, registry)
    if problem is not None:
        raise problem


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
