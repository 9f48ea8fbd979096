"""FSDP2 workers: actor, critic and reference roles over a Hugging Face model.

Each decoder layer and the root module are wrapped with ``fully_shard`` on a 1-D device mesh of
the worker group's ranks (gloo on CPU, NCCL on GPU). The controller's executor starts the
processes and sets up ``torch.distributed``; this module never launches anything itself. A
single-process run gets a one-rank process group (checkpoints go through the same
``torch.distributed.checkpoint`` code at every world size); at one rank in the model's own dtype
the module trains unwrapped unless ``shard_single_rank`` is set, because a one-rank FSDP shard is
the whole model and gathering it only adds copies (see :class:`FSDPConfig`).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import random
import resource
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from verl_core.batch import Batch
from verl_core.contracts import (
    BackendConfig,
    LogProbs,
    LoRAAdapter,
    LossFn,
    ModelSpec,
    Role,
    TrainingBackend,
    TrainingWorker,
    WorldInfo,
)
from verl_kit.multimodal import auto_model_class, is_vision_model, vision_forward_inputs, vision_token_ids
from verl_kit.training import (check_sequence_length, micro_batch_weights, rank_mini_batch,
                               token_groups, trim_padding)
from verl_kit.sharding import autocast, check_autocast, ensure_process_group

__all__ = ["FSDPBackend", "FSDPConfig", "FSDPWorker", "TrainingDivergedError"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

logger = logging.getLogger(__name__)


class TrainingDivergedError(FloatingPointError):
    """The loss or gradient norm became NaN/inf; the update was not applied."""


@dataclass
class FSDPConfig(BackendConfig):
    """FSDP2 settings on top of the common backend settings.

    Attributes:
        param_dtype: dtype of parameters during forward/backward (mixed precision); master
            weights and optimizer state stay in the model's dtype. FSDP casts each layer's
            parameters at every gather (forward and again in backward).
        autocast: ``"bfloat16"`` runs the forwards under ``torch.autocast``
            (matmuls and attention in that dtype, softmax, norms and the loss in float32, each weight
            cast once per forward); parameters, gradients and optimizer state stay in the model's
            dtype. ``"off"`` (the default) runs in the compute dtype. On a CPU with bf16 matmuls
            (``lscpu``: avx512_bf16 or amx_bf16) this is the faster of the two lower-precision paths
            (``bench/fsdp_step.py``); set ``param_dtype`` or ``autocast``, not both.
        reduce_dtype: dtype of gradient reduction across ranks.
        activation_checkpointing: recompute layer activations in backward to save memory.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU (GPU runs).
        reference_cpu_offload: the same for the reference model only (it has no gradients or
            optimizer state, and is used once per step): the cheap way to keep a frozen copy of
            the initial policy when GPU memory is tight. GPU runs; ignored on CPU.
        reshard_after_forward: free gathered parameters after each layer's forward.
        micro_batch_max_tokens: dynamic batching: pack consecutive samples into micro-batches of
            at most this many real tokens instead of a fixed ``micro_batch_size`` (0 disables).
        lora_rank: train LoRA adapters of this rank on the actor instead of all weights (0 disables;
            needs ``peft``). Rollout engines receive merged weights; the reference policy is the
            actor with its adapters switched off, so no second copy of the model is loaded.
        lora_alpha: LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_rank``).
        lora_dropout: dropout on the LoRA path.
        lora_target_modules: module names that get adapters.
        lora_sync: how a rollout engine with its own copy of the weights receives a LoRA actor's
            policy: ``"merged"`` (full weights with the adapters folded in; any engine) or
            ``"adapters"`` (only the adapter tensors, a few MB instead of the model; the engine
            must serve adapters, e.g. the vllm rollout with ``rollout.max_lora_rank``).
        shard_single_rank: wrap the model with FSDP at world size 1 too. Off (the default), a
            one-rank worker whose compute dtype is the model's dtype and that offloads nothing
            trains the plain module: FSDP's single shard is then the whole model, and its gathered
            parameters and unsharded gradients are extra whole-model copies (bench/README.md has
            the measured memory and time: ``python bench/probes.py memory-trace``, ``accumulation``).
            Checkpoints are the same DCP format either way and load at any world size. Mixed
            precision and CPU offload always use FSDP.
        release_host_memory: on CPU, hand the update's freed memory back to the OS after every
            update (``malloc_trim``; glibc otherwise keeps it for reuse). Off by default: the next
            update touches that memory again (``bench/fsdp_step.py``, 32M model: 97k minor page
            faults per update against 25k), which cost +11% of the update's CPU time at one rank
            and +6.5% at two, while the peak of a process that also runs a vLLM engine fell by only
            0.01 GiB (``python bench/probes.py memory-trace [--trim]``: the engine reuses the kept
            memory). Turn it on when another process on the host needs that memory between
            updates: the resident memory after an update falls (2.63 -> 2.17 GiB there).
        remove_padding: run actor and reference forwards on packed sequences (one row of only real
            tokens, position ids restarting per sequence) instead of a padded ``[batch, length]``
            block. ``"auto"`` packs when the model uses a variable-length attention kernel
            (``flash_attention_*``), where packing removes all padding compute; with SDPA/eager
            attention (CPU) a packed row attends through a block-diagonal mask whose cost grows
            with the square of the packed length, so ``"auto"`` keeps padded rows (with the padding
            columns trimmed) there. ``"true"``/``"false"`` force either. Batches with images always run
            padded (their mRoPE position ids are computed per row).
        freeze_vision_tower: on a vision-language model, train only the language model (and the
            projector that feeds it): the vision tower's parameters get no gradients and no optimizer state.
        shared_prompt: run the prompt once for all the samples drawn from it (GRPO's group, PPO's
            ``rollout.n``) in actor and reference forwards: one row holds the prompt's tokens and then
            several responses, each attending to the prompt and to itself only (a block mask), with
            the position ids each would have alone, so the log-probs are those of separate rows (to
            float rounding) at the cost of ``prompt + n x response`` tokens instead of
            ``n x (prompt + response)``. How many responses share a row is chosen per prompt group
            from the group's lengths and the model's width (the mask makes attention cost grow with
            the square of the row), so a group is laid out alike in any batch and on any rank.
            ``"auto"`` (the default) shares where the model is a text decoder on padded rows (not
            ``remove_padding``, not vision); ``"true"`` fails on a model it cannot serve; ``"false"``
            never shares.

    ``weight_decay`` decays every parameter, biases and norm weights included (torch's AdamW over one
    group); the Megatron backend leaves those two out, as Megatron does.
    """

    param_dtype: str = "float32"
    autocast: str = "off"
    reduce_dtype: str = "float32"
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    reference_cpu_offload: bool = False
    reshard_after_forward: bool = True
    micro_batch_max_tokens: int = 0
    lora_rank: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    lora_sync: str = "merged"
    shard_single_rank: bool = False
    release_host_memory: bool = False
    remove_padding: str = "auto"
    freeze_vision_tower: bool = False
    shared_prompt: str = "auto"

    def compute_dtype(self, model_dtype: str) -> str:
        """Forward passes run in ``param_dtype`` when mixed precision casts to it, in ``autocast``'s dtype
        under autocast."""
        if self.autocast != "off":
            return self.autocast
        return self.param_dtype if self.param_dtype != "float32" else model_dtype

    def validate(self) -> None:
        super().validate()
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(self, key) not in _DTYPES:
                raise ValueError(f"{key}: must be one of {sorted(_DTYPES)}")
        check_autocast(self.autocast)
        for key in ("param_dtype", "autocast"):  # a GradScaler's job, which this backend does not do
            if getattr(self, key) == "float16":
                raise ValueError(f"{key}: float16 training needs loss scaling, which this backend does not do "
                                 f"(small gradients would underflow to 0 unseen); use 'bfloat16'")
        if self.autocast != "off" and self.param_dtype != "float32":
            raise ValueError(f"autocast={self.autocast!r} with param_dtype={self.param_dtype!r}: two ways to "
                             f"compute in lower precision; set param_dtype='float32' or autocast='off'")
        if self.lora_rank < 0:
            raise ValueError("lora_rank: must be >= 0 (0 trains all weights)")
        if self.lora_rank and self.lora_alpha <= 0:  # the update is scaled by lora_alpha / lora_rank
            raise ValueError("lora_alpha: must be > 0")
        if self.lora_rank and not 0 <= self.lora_dropout < 1:  # 1 drops the whole LoRA path: nothing trains
            raise ValueError("lora_dropout: must be in [0, 1)")
        if self.micro_batch_max_tokens < 0:
            raise ValueError("micro_batch_max_tokens: must be >= 0 (0 uses micro_batch_size)")
        if self.lora_sync not in ("merged", "adapters"):
            raise ValueError(f"lora_sync: must be 'merged' or 'adapters', not {self.lora_sync!r}")
        if str(self.remove_padding).lower() not in ("auto", "true", "false"):
            raise ValueError(f"remove_padding: must be 'auto', 'true' or 'false', not {self.remove_padding!r}")
        if str(self.shared_prompt).lower() not in ("auto", "true", "false"):
            raise ValueError(f"shared_prompt: must be 'auto', 'true' or 'false', not {self.shared_prompt!r}")


class FSDPBackend(TrainingBackend):
    """Builds :class:`FSDPWorker` instances."""

    Config = FSDPConfig

    def __init__(self, config: FSDPConfig) -> None:
        super().__init__(config)
        self._actors: dict[int, FSDPWorker] = {}

    def create_worker(self, *, role: Role, model: ModelSpec, world: WorldInfo, seed: int) -> TrainingWorker:
        role = Role(role)
        actor = self._actors.get(world.rank)
        if role is Role.REFERENCE and actor is not None and actor.lora:
            # With LoRA the frozen base model *is* the reference policy: reuse it, no second copy.
            return AdapterOffReference(actor)
        worker = FSDPWorker(config=self.config, role=role, model=model, world=world, seed=seed)
        if role is Role.ACTOR:
            self._actors[world.rank] = worker
        return worker


def _load_module(spec: ModelSpec, role: Role) -> torch.nn.Module:
    dtype = _DTYPES[spec.dtype]
    from transformers import AutoConfig, AutoModelForTokenClassification

    if spec.module is not None:
        # An already loaded model is copied for every role: sharding rewrites a module in place,
        # and the reference (or the critic's backbone) must not move when the actor trains. The
        # trained weights are read from the actor worker (iter_weights / export_hf).
        if role is Role.CRITIC:
            config = copy.deepcopy(spec.module.config)
            keep_head = _has_value_head(spec.module)
            config.num_labels = 1
            critic = AutoModelForTokenClassification.from_config(config).to(spec.module.dtype)
            missing = critic.load_state_dict(spec.module.state_dict(), strict=False).missing_keys
            _start_value_head(critic, missing, keep=keep_head)  # backbone (and score) names match
            return critic
        return copy.deepcopy(spec.module)

    path = Path(spec.path)
    if not path.exists():
        raise FileNotFoundError(f"model.path: {spec.path!r} does not exist (give a local Hugging Face model "
                                f"directory)")
    hf_config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    if role is Role.CRITIC:
        # The value head sits on the same architecture: token classification with one label. A
        # checkpoint with a one-label score head (a trained critic, a reward model) keeps it.
        hf_config.num_labels = 1
        with _held_load_report() as held:
            module, loading = AutoModelForTokenClassification.from_pretrained(
                spec.path, config=hf_config, dtype=dtype, trust_remote_code=spec.trust_remote_code,
                output_loading_info=True)
            missing, unexpected = set(loading["missing_keys"]), set(loading["unexpected_keys"])
            if held and missing <= _VALUE_HEAD_KEYS and unexpected <= _LM_HEAD_KEYS and not loading["mismatched_keys"]:
                # What a critic built on a causal LM always shows: not a problem, so not transformers' report.
                # One line at warning level, the only level a run's console shows (bare, as the report was).
                held.clear()
                if missing:
                    logger.warning("critic: a new value head (%s) initialised; the rest loaded from %s",
                                   ", ".join(sorted(missing)), spec.path)
                else:
                    logger.warning("critic: loaded from %s (its lm_head is not used)", spec.path)
        _start_value_head(module, loading["missing_keys"], keep="score.weight" not in loading["missing_keys"])
        return module
    if role is Role.REWARD_MODEL:
        return _load_reward_model(spec, dtype, hf_config)
    try:
        return auto_model_class(hf_config).from_pretrained(spec.path, dtype=dtype,
                                                           trust_remote_code=spec.trust_remote_code)
    except ValueError as exc:
        raise ValueError(f"model.path: {spec.path!r} is not a causal language model "
                         f"({hf_config.model_type}): {exc}") from exc


_VALUE_HEAD_KEYS = {"score.weight", "score.bias"}  # a critic's head, new when it starts from a causal LM
_LM_HEAD_KEYS = {"lm_head.weight", "lm_head.bias"}  # a causal LM's head, which a critic does not use


@contextlib.contextmanager
def _held_load_report() -> Iterator[list[logging.LogRecord]]:
    """Holds back transformers' LOAD REPORT of the loads inside; what is left in the list is logged on exit.

    The caller clears the list when the report only says what is expected (a critic's new value head)."""
    hf_logger = logging.getLogger("transformers.modeling_utils")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            held.append(record)
            return False
        return True

    hf_logger.addFilter(hold)
    try:
        yield held
    finally:
        hf_logger.removeFilter(hold)
        for record in held:  # unexpected keys, mismatches, a failed load: shown as transformers wrote them
            hf_logger.handle(record)


def _has_value_head(module: torch.nn.Module) -> bool:
    """Whether a loaded model already has a one-label ``score`` head (a critic or a reward model) to keep."""
    head = getattr(module, "score", None)
    if head is None:
        return False
    if getattr(head, "out_features", None) != 1:
        raise ValueError(f"critic_model: the {type(module).__name__} given has a score head of "
                         f"{getattr(head, 'out_features', '?')} outputs; a critic starts from a causal LM (a new value "
                         f"head) or from a model whose score head has one output")
    return True


def _start_value_head(critic: torch.nn.Module, missing: Any, *, keep: bool) -> None:
    """A new value head starts at 0 everywhere, not noise; a kept one gets a zero bias if it had none."""
    head = getattr(critic, "score", None)
    if head is None:
        return
    if not keep:
        torch.nn.init.zeros_(head.weight)
    elif getattr(head, "bias", None) is not None and "score.bias" in missing:
        torch.nn.init.zeros_(head.bias)


def _load_reward_model(spec: ModelSpec, dtype: torch.dtype, hf_config: Any) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    architectures = getattr(hf_config, "architectures", None) or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        # Loading would succeed with a freshly initialised (random) score head: refuse instead.
        raise ValueError(f"reward.model_path: {spec.path!r} is not a sequence-classification model "
                         f"(architectures {architectures}); a reward model has a trained score head")
    try:
        module = AutoModelForSequenceClassification.from_pretrained(spec.path, dtype=dtype,
                                                                    trust_remote_code=spec.trust_remote_code)
    except ValueError as exc:
        raise ValueError(f"reward.model_path: {spec.path!r} is not a sequence-classification model "
                         f"({hf_config.model_type}): {exc}") from exc
    if module.config.num_labels != 1:
        raise ValueError(f"reward.model_path: {spec.path!r} has num_labels={module.config.num_labels}; a reward "
                         f"model gives one score per sequence (num_labels=1)")
    return module


class FSDPWorker(TrainingWorker):
    """One role on one rank, with its FSDP2-sharded module and (for trained roles) optimizer."""

    def __init__(self, *, config: FSDPConfig, role: Role, model: ModelSpec, world: WorldInfo, seed: int) -> None:
        self.config, self.role, self.world, self.spec = config, role, world, model
        torch.set_num_threads(max(1, world.threads))
        ensure_process_group(world)
        torch.manual_seed(seed)
        self.device = torch.device(world.device)
        module = _load_module(model, role)
        self.max_positions = getattr(module.config, "max_position_embeddings", None)
        self.lora = config.lora_rank > 0 and role is Role.ACTOR
        if self.lora:
            module = _add_lora(module, config)
        if config.freeze_vision_tower and role is Role.ACTOR:
            for p in _vision_tower(module).parameters():
                p.requires_grad_(False)
        if config.activation_checkpointing and role is not Role.REFERENCE:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (world.world_size,))
        offload = (config.cpu_offload or (config.reference_cpu_offload and role is Role.REFERENCE)
                   ) and self.device.type == "cuda"
        model_dtype = next(module.parameters()).dtype
        self.sharded = (world.world_size > 1 or config.shard_single_rank or offload
                        or _DTYPES[config.param_dtype] != model_dtype)
        if self.sharded:
            mp = MixedPrecisionPolicy(param_dtype=_DTYPES[config.param_dtype],
                                      reduce_dtype=_DTYPES[config.reduce_dtype])
            kwargs: dict[str, Any] = dict(mesh=self.mesh, mp_policy=mp,
                                          reshard_after_forward=config.reshard_after_forward)
            if offload:
                kwargs["offload_policy"] = CPUOffloadPolicy()
            for layer in _decoder_layers(module):
                fully_shard(layer, **kwargs)
            fully_shard(module, **kwargs)
            if hasattr(module, "generate"):  # value heads and reward models have no generate()
                # generate() must enter through the root like forward() does (lazy init, root params).
                register_fsdp_forward_method(module, "generate")
        else:
            module.to(self.device)
        self.scores_tokens = role in (Role.ACTOR, Role.REFERENCE) and hasattr(module, "get_output_embeddings")
        if self.scores_tokens:
            # Log-probs are computed inside a forward method of the root so that the LM head's
            # (root-owned) weight is gathered while the chunks below use it, in backward too.
            module.verl_token_log_probs = types.MethodType(_token_log_probs, module)
            if self.sharded:
                register_fsdp_forward_method(module, "verl_token_log_probs")
        self.packed = _wants_packing(config.remove_padding, module)
        self.shared_prompt = self.scores_tokens and _wants_shared_prompt(config.shared_prompt, module, self.packed)
        self.compute_dtype = _DTYPES[config.compute_dtype(str(model_dtype).removeprefix("torch."))]
        self.module = module
        self.trainable = role in (Role.ACTOR, Role.CRITIC)
        self.module.train(False)
        self.optimizer = None
        self.scheduler = None
        self.optimizer_steps = 0
        if self.trainable:
            lr = config.lr if role is Role.ACTOR else config.critic_lr
            trainable = [p for p in module.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(trainable, lr=lr, betas=tuple(config.betas), eps=config.eps,
                                               weight_decay=config.weight_decay)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.config.lr_factor)
        else:
            for p in module.parameters():
                p.requires_grad_(False)

    # ------------------------------------------------------------------ helpers
    def _micro_batches(self, batch: Batch, size: int) -> list[Batch]:
        """Micro-batches of ``size`` samples, or packed up to the token budget when one is set."""
        budget = self.config.micro_batch_max_tokens
        if not budget:
            return list(batch.split(size))
        groups = token_groups(batch, budget)
        lengths = (batch.prompt_mask.sum(-1) + batch.response_attention_mask.sum(-1)).tolist()
        if self.world.world_size > 1:
            # Every micro-batch is a round of FSDP collectives: ranks whose samples pack into fewer
            # micro-batches split theirs further, or their peers would wait forever.
            target, fewest = self._max_over_ranks(len(groups), -len(lengths))
            if -fewest < target:  # every rank raises, none is left waiting in a collective
                raise RuntimeError(f"a rank holds {-fewest} samples but another packs into {target} micro-batches: "
                                   f"the data-parallel ranks were given shards of different sizes")
            groups = _split_to(groups, lengths, target)
        return [batch.select(g) for g in groups]

    def _sum_over_ranks(self, value: float) -> float:
        if self.world.world_size > 1:
            t = torch.tensor([value], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            value = float(t.item())
        return value

    def _max_over_ranks(self, *values: int) -> Any:
        """The largest of each value over all ranks (one all-reduce); one value in, one out."""
        if self.world.world_size > 1:
            t = torch.tensor(values, dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            values = tuple(int(v) for v in t.tolist())
        return values[0] if len(values) == 1 else values

    def _forward(self, batch: Batch, *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of the response tokens, ``[B, R']`` for the padding-trimmed
        batch (callers pass a batch already trimmed with :func:`~verl_kit.training.trim_padding`); zero where
        ``response_attention_mask`` is zero."""
        attn = batch.attention_mask
        R = batch.response_length
        B, T = attn.shape
        P = T - R
        scored = batch.response_attention_mask.bool()
        vision: dict[str, torch.Tensor] = {}
        if any(batch.multi_modal_inputs) and not is_vision_model(self.module.config):
            raise ValueError(f"the batch has images, and the {self.role.value} model ({type(self.module).__name__}) "
                             f"has no vision tower; use a vision-language model for image prompts")
        if is_vision_model(self.module.config):
            # The model's own position ids (Qwen2-VL's mRoPE: 3-D for image tokens), from padded rows.
            input_ids = _text_responses(batch.input_ids, P, self.module.config, batch.info.get("pad_token_id", 0))
            vision = vision_forward_inputs(batch.multi_modal_inputs, input_ids, self.module.config, self.device,
                                           prompt_length=P)
            position_ids = _model_position_ids(self.module, input_ids, attn, vision)
            attention_mask = attn.to(self.device)
            rows, cols = scored.nonzero(as_tuple=True)
            cols = cols + P - 1
        elif self.shared_prompt and (layout := _shared_prompt_layout(batch, self.module.config)) is not None:
            input_ids, position_ids, segments, rows, cols = layout
            attention_mask = _block_mask(segments, self.compute_dtype).to(self.device)
        elif self.packed:
            # One row holding only the real tokens; position ids restart at every sequence, which
            # is how Hugging Face attention recognises packed sequences (no 2-D mask then).
            keep = attn.bool()
            input_ids = batch.input_ids[keep].unsqueeze(0)
            position_ids = torch.cat([torch.arange(int(n)) for n in keep.sum(-1)]).unsqueeze(0)
            packed_index = (keep.flatten().cumsum(0) - 1).view(B, T)
            # Response token j of row i is predicted at the packed position just before it.
            cols = packed_index[:, P:][scored] - 1
            rows = torch.zeros_like(cols)
            attention_mask = None
        else:
            input_ids = batch.input_ids
            position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
            attention_mask = attn.to(self.device)
            rows, cols = scored.nonzero(as_tuple=True)
            cols = cols + P - 1
        targets = batch.response_ids[scored]
        with self._autocast():
            lp, ent = self.module.verl_token_log_probs(
                input_ids.to(self.device), position_ids.to(self.device), attention_mask, rows.to(self.device),
                cols.to(self.device), targets.to(self.device), max(1, self.config.logits_chunk_size), with_entropy,
                vision or None)
        out_lp = lp.new_zeros(B, R).masked_scatter(scored.to(lp.device), lp)
        out_ent = ent.new_zeros(B, R).masked_scatter(scored.to(ent.device), ent) if with_entropy else None
        return out_lp, out_ent

    def _autocast(self) -> contextlib.AbstractContextManager:
        """``backend.autocast``: the forwards' lower-precision region."""
        return autocast(self.device.type, self.config.autocast)

    def _values_forward(self, batch: Batch) -> torch.Tensor:
        input_ids = batch.input_ids.to(self.device)
        attn = batch.attention_mask.to(self.device)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        with self._autocast():
            out = self.module(input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=False)
        P, R = batch.prompt_ids.shape[1], batch.response_length
        # The value of response token t is read at the position before it (the state it was chosen in).
        return out.logits[:, P - 1:P + R - 1, 0].float()

    # ------------------------------------------------------------------ contract
    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, *, with_entropy: bool = False) -> LogProbs:
        check_sequence_length(batch, self.max_positions)
        self.module.train(False)
        lps, ents = [], []
        width = batch.response_length
        for micro in self._micro_batches(batch, self.config.log_prob_micro_batch_size):
            with self._oom_advice(micro, "log-prob pass"):
                lp, ent = self._forward(trim_padding(micro), with_entropy=with_entropy)
            lps.append(_pad_right(lp.cpu(), width))
            if ent is not None:
                ents.append(_pad_right(ent.cpu(), width))
        return LogProbs(torch.cat(lps), torch.cat(ents) if with_entropy else None)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        if self.role is not Role.CRITIC:
            return super().compute_values(batch)
        self.module.train(False)
        width = batch.response_length
        values = []
        for micro in self._micro_batches(batch, self.config.log_prob_micro_batch_size):
            with self._oom_advice(micro, "value pass"):
                values.append(_pad_right(self._values_forward(trim_padding(micro)).cpu(), width))
        return torch.cat(values)

    @torch.no_grad()
    def compute_scores(self, batch: Batch) -> torch.Tensor:
        if self.role is not Role.REWARD_MODEL:
            return super().compute_scores(batch)
        check_sequence_length(batch, self.max_positions)
        self.module.train(False)
        scores = []
        for micro in self._micro_batches(batch, self.config.log_prob_micro_batch_size):
            with self._oom_advice(micro, "reward-model pass"):
                scores.append(self._scores_forward(trim_padding(micro)).cpu())
        return torch.cat(scores)

    def _scores_forward(self, batch: Batch) -> torch.Tensor:
        input_ids = batch.input_ids.to(self.device)
        attn = batch.attention_mask.to(self.device)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        # HF pools at the rightmost token that is not the pad id, which is wrong when pad == eos ends a
        # response: take the per-token head output and read it at each row's last attended position.
        head = getattr(self.module, "score", None)
        captured: dict[str, torch.Tensor] = {}
        hook = head.register_forward_hook(lambda _m, _a, out: captured.setdefault("logits", out)) if head else None
        try:
            with self._autocast():
                out = self.module(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                                  use_cache=False)
        finally:
            if hook is not None:
                hook.remove()
        per_token = captured.get("logits")
        if per_token is None or per_token.dim() != 3:
            return out.logits[:, 0].float()
        last = attn.shape[1] - 1 - attn.flip(-1).argmax(-1)
        return per_token[torch.arange(per_token.shape[0], device=per_token.device), last, 0].float()

    def update_policy(self, batch: Batch, *, loss_fn: LossFn, mini_batch_size: int, epochs: int) -> dict[str, float]:
        if self.role is not Role.ACTOR:
            return super().update_policy(batch, loss_fn=loss_fn, mini_batch_size=mini_batch_size, epochs=epochs)

        def micro_loss(micro: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            # The loss reads the batch's advantages, old log-probs, masks: on the compute device.
            micro = trim_padding(micro).to(self.device)
            lp, ent = self._forward(micro, with_entropy=True)
            return loss_fn(batch=micro, log_probs=lp, entropy=ent)

        return self._optimize(batch, micro_loss, loss_fn, mini_batch_size, epochs, prefix="actor")

    def update_values(self, batch: Batch, *, loss_fn: LossFn, mini_batch_size: int, epochs: int) -> dict[str, float]:
        if self.role is not Role.CRITIC:
            return super().update_values(batch, loss_fn=loss_fn, mini_batch_size=mini_batch_size, epochs=epochs)
        def micro_loss(micro: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            micro = trim_padding(micro).to(self.device)
            return loss_fn(batch=micro, values=self._values_forward(micro))

        return self._optimize(batch, micro_loss, loss_fn, mini_batch_size, epochs, prefix="critic")

    def _optimize(self, batch: Batch, micro_loss: Any, loss_fn: LossFn, mini_batch_size: int, epochs: int, *,
                  prefix: str) -> dict[str, float]:
        check_sequence_length(batch, self.max_positions)
        self.module.train(True)
        mini = rank_mini_batch(mini_batch_size, len(batch), self.world.world_size)
        sums: dict[str, float] = {}
        norms: list[float] = []
        count = 0
        for _ in range(epochs):
            for mb in batch.split(mini):
                self.optimizer.zero_grad(set_to_none=True)
                micros = self._micro_batches(mb, self.config.micro_batch_size)
                # Each micro-batch counts by its share of the loss's units (tokens for token-mean) over
                # the mini-batch on all ranks: the gradient does not depend on how the batch was cut.
                weights = micro_batch_weights(loss_fn, micros, dp_size=self.world.world_size,
                                              sum_over_ranks=self._sum_over_ranks)
                bad_loss: float | None = None
                for index, (micro, share) in enumerate(zip(micros, weights)):
                    self._accumulating(index < len(micros) - 1)
                    with self._oom_advice(micro, f"{prefix} update"):
                        loss, metrics = micro_loss(micro)
                    if bad_loss is None and not torch.isfinite(loss):
                        # Finish the backward passes anyway: peers are in step with them, and the last
                        # one ends a one-rank FSDP accumulation (its unsharded gradients would outlive
                        # zero_grad otherwise). Then all ranks stop together, below.
                        bad_loss = float(loss.detach())
                    with self._oom_advice(micro, f"{prefix} update"):
                        (loss * share).backward()
                    # Metrics weighted like the loss: they describe the mini-batch, whatever its micro-batches.
                    for k, v in metrics.items():
                        sums[k] = sums.get(k, 0.0) + v * share
                count += 1
                if self._max_over_ranks(int(bad_loss is not None)):
                    self.optimizer.zero_grad(set_to_none=True)  # the last micro-batch ended any accumulation
                    what = (f"{prefix} loss is {bad_loss}" if bad_loss is not None
                            else f"{prefix} loss is not finite on another rank")
                    raise TrainingDivergedError(f"{what} at optimizer step {self.optimizer_steps + 1}; the update "
                                                f"was not applied (lower backend.lr, or check the rewards for NaN)")
                norm = self._clip_grad()
                if not math.isfinite(norm):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise TrainingDivergedError(f"{prefix} gradient norm is {norm} at optimizer step "
                                                f"{self.optimizer_steps + 1}; the update was not applied")
                with self._oom_advice(None, f"{prefix} optimizer step"):
                    self.optimizer.step()
                self.optimizer_steps += 1
                norms.append(norm)
        out_lr = self.optimizer.param_groups[0]["lr"]  # the rate this update used
        self.scheduler.step()  # once per training step, whatever the number of mini-batches
        self._accumulating(False)
        if self.device.type == "cpu" and self.config.release_host_memory:
            _release_host_memory()
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out[f"{prefix}/grad_norm"] = sum(norms) / len(norms)
        out[f"{prefix}/lr"] = out_lr
        # Reported with the update, so a controller on another process needs no extra call for it.
        out[f"memory/{prefix}_peak_gb"] = self.peak_memory_gb()
        self.module.train(False)
        return out

    def _accumulating(self, more_to_come: bool) -> None:
        """At one rank, keep parameters gathered and gradients local while micro-batches remain.

        With a single shard FSDP's per-micro-batch all-gather and reduce-scatter are whole-model
        copies that achieve nothing; they only need to happen around the optimizer step. With
        more ranks each micro-batch keeps the usual reshard/reduce (the memory saving is the point).
        """
        if self.world.world_size != 1 or not self.sharded:
            return
        # Called before every micro-batch, so any exception mid-update leaves at most one
        # micro-batch's setting behind, and the last micro-batch always restores the defaults.
        self.module.set_requires_gradient_sync(not more_to_come)
        self.module.set_reshard_after_backward(not more_to_come)
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.set_reshard_after_forward(False if more_to_come else self.config.reshard_after_forward,
                                            recurse=False)

    @contextlib.contextmanager
    def _oom_advice(self, micro: Batch | None, what: str) -> Iterator[None]:
        """Turn an out-of-memory error into one that names the knobs to turn.

        ``what`` is ``"actor update"``/``"critic update"`` (forward and backward of ``micro``),
        ``"... optimizer step"`` (``micro`` None) or a no-grad pass such as ``"log-prob pass"``.
        """
        try:
            yield
        except torch.OutOfMemoryError as exc:
            if micro is None:
                message = (f"out of memory in the {what} (AdamW holds two fp32 states per trainable parameter): "
                           f"enable backend.cpu_offload, train an adapter instead (backend.lora_rank), or add ranks")
            else:
                width = micro.prompt_ids.shape[1] + micro.response_length
                size = f"a micro-batch of {len(micro)} samples x {width} tokens"
                if what.endswith("update"):
                    knobs = (f"lower backend.micro_batch_size (now {self.config.micro_batch_size}) or set "
                             f"backend.micro_batch_max_tokens, or enable backend.activation_checkpointing / "
                             f"backend.cpu_offload")
                else:
                    knobs = (f"lower backend.log_prob_micro_batch_size (now {self.config.log_prob_micro_batch_size}) "
                             f"or set backend.micro_batch_max_tokens")
                    if what == "log-prob pass":
                        knobs += f", or lower backend.logits_chunk_size (now {self.config.logits_chunk_size})"
                message = f"out of memory in the {what} on {size}: {knobs}"
            raise torch.OutOfMemoryError(message) from exc

    def _clip_grad(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    @contextlib.contextmanager
    def generation_module(self) -> Iterator[torch.nn.Module]:
        """Gather full parameters once for a whole generation call, then shard them again."""
        if not self.sharded:
            yield self.module
            return
        fsdp_modules = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        for m in fsdp_modules:
            m.set_reshard_after_forward(False, recurse=False)
        self.module.unshard()
        for m in fsdp_modules:
            m.unshard()
        try:
            yield self.module
        finally:
            for m in fsdp_modules:
                m.reshard()
                m.set_reshard_after_forward(self.config.reshard_after_forward, recurse=False)

    def hf_module(self) -> torch.nn.Module:
        return self.module

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        # One parameter gathered at a time: never a second full copy of the model.
        state = self.module.state_dict()
        if not self.lora:
            for name, tensor in state.items():
                yield name, _full(tensor)
            return
        scale = self.config.lora_alpha / self.config.lora_rank
        for name, tensor in state.items():
            if ".lora_" in name:
                continue
            weight = _full(tensor)
            if name.endswith(".base_layer.weight"):
                prefix = name[: -len("base_layer.weight")]
                lora_a, lora_b = _full(state[prefix + "lora_A.default.weight"]), _full(state[prefix + "lora_B.default.weight"])
                weight = (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)
            # Hugging Face names, as an inference engine expects them.
            yield name.removeprefix("base_model.model.").replace(".base_layer.", "."), weight

    def lora_adapter(self) -> LoRAAdapter | None:
        if not self.lora or self.config.lora_sync != "adapters":
            return None
        # Gathered on every rank (the shards need all of them); PEFT's saved names drop the
        # adapter's name ("default").
        tensors = {name.replace(".default.", "."): _full(tensor).clone()
                   for name, tensor in self.module.state_dict().items() if ".lora_" in name}
        return LoRAAdapter(rank=self.config.lora_rank, alpha=self.config.lora_alpha,
                           target_modules=list(self.config.lora_target_modules), tensors=tensors)

    def peak_memory_gb(self) -> float:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)

    # ------------------------------------------------------------------ state
    def save_state(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        Path(path).mkdir(parents=True, exist_ok=True)
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            state = {"model": get_model_state_dict(self.module)}
        dcp.save(state, checkpoint_id=str(Path(path) / "dcp"))
        extra = {
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "optimizer_steps": self.optimizer_steps,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
            "world_size": self.world.world_size,
            **_shapes_and_dtypes(self.module),
        }
        torch.save(extra, Path(path) / f"extra_rank{self.world.rank}.pt")

    def load_state(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        extra_path = Path(path) / f"extra_rank{self.world.rank}.pt"
        if not extra_path.is_file():
            extra_path = Path(path) / "extra_rank0.pt"
        extra = torch.load(extra_path, weights_only=False)
        here = _shapes_and_dtypes(self.module)
        shapes, dtypes = here["shapes"], here["dtypes"]
        if extra["shapes"] != shapes:
            diff = sorted(k for k in set(shapes) | set(extra["shapes"]) if shapes.get(k) != extra["shapes"].get(k))
            raise ValueError(f"checkpoint {path} was saved from a different model: parameters {diff[:5]} differ "
                             f"in name or shape")
        saved = extra.get("dtypes", dtypes)  # checkpoints from before dtypes were recorded
        if saved != dtypes:
            k = next(k for k in dtypes if saved.get(k) != dtypes[k])
            raise ValueError(f"checkpoint {path} holds {saved.get(k)} weights (e.g. {k}) but this model is loaded in "
                             f"{dtypes[k]}; set model.dtype={saved.get(k)} to resume it (a silent cast would not "
                             f"resume exactly)")
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            state = {"model": get_model_state_dict(self.module)}
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
        if self.optimizer is not None:
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.module, state["model"])
        if self.scheduler is not None and extra["scheduler"] is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
            # The rate for the next step follows this run's schedule (a run resumed with a larger
            # run.max_steps stretches its cosine), not the rate the saved run had set for itself.
            # backend.lr (critic_lr) of this run too: the scheduler's saved base rates are replaced.
            lr = self.config.lr if self.role is Role.ACTOR else self.config.critic_lr
            self.scheduler.base_lrs = [lr] * len(self.optimizer.param_groups)
            factor = self.config.lr_factor(self.scheduler.last_epoch)
            for group in self.optimizer.param_groups:
                group["lr"] = lr * factor
        self.optimizer_steps = extra["optimizer_steps"]
        if extra["world_size"] == self.world.world_size:
            # RNG streams are per rank: only meaningful at the same world size.
            rng = extra["rng"]
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            if rng.get("numpy") is not None:
                import numpy

                numpy.random.set_state(rng["numpy"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        elif self.world.rank == 0:
            logger.warning("checkpoint %s was saved at world size %d, this run has %d: weights, optimizer and "
                           "schedule are resharded exactly, random streams start afresh", path,
                           extra["world_size"], self.world.world_size)

    def export_hf(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.lora:
            full = dict(self.iter_weights())  # merged adapters, plain Hugging Face names
        else:
            full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.world.rank != 0:
            return
        from transformers import AutoTokenizer

        config = self.module.config
        with torch.device("meta"):
            fresh = auto_model_class(config).from_config(config)
        fresh.load_state_dict(full, assign=True)
        fresh.save_pretrained(path, safe_serialization=True)
        tok_path = self.spec.tokenizer_path or self.spec.path
        if tok_path and Path(tok_path).exists():
            AutoTokenizer.from_pretrained(tok_path).save_pretrained(path)
        _copy_processor_files(self.spec.path, path)

    def close(self) -> None:
        """Free the module, optimizer and device mesh now, before the process group is destroyed.

        The module holds itself in a reference cycle (its bound log-prob method) and, through its
        FSDP state, the process group; left to the garbage collector it can be freed during
        interpreter shutdown, while the group's communication threads are being torn down.
        """
        if self.module is None:
            return
        self.module.__dict__.pop("verl_token_log_probs", None)  # the bound method's cycle
        self.optimizer = self.scheduler = None
        self.module = self.mesh = None
        if self.sharded:  # FSDP's own state has cycles too; only these hold the process group
            gc.collect()


def _release_host_memory() -> None:
    """Give the update's freed activations and gradients back to the OS (glibc keeps them for
    reuse); ``FSDPConfig.release_host_memory`` has what it costs and saves. A no-op where the C
    library has no ``malloc_trim``.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def _add_lora(module: torch.nn.Module, config: FSDPConfig) -> torch.nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("backend.lora_rank > 0 needs peft: pip install 'verl-backend-fsdp[lora]'") from exc
    return get_peft_model(module, LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                             lora_dropout=config.lora_dropout,
                                             target_modules=list(config.lora_target_modules), bias="none"))


class AdapterOffReference(TrainingWorker):
    """The reference policy of a LoRA actor: the actor's module with its adapters switched off."""

    role = Role.REFERENCE

    def __init__(self, actor: "FSDPWorker") -> None:
        self.actor = actor

    def compute_log_probs(self, batch: Batch, *, with_entropy: bool = False) -> LogProbs:
        with self.actor.module.disable_adapter():
            return self.actor.compute_log_probs(batch, with_entropy=with_entropy)

    def save_state(self, path: str) -> None:
        """Nothing to save: the base weights are in the actor's checkpoint."""

    def load_state(self, path: str) -> None:
        """Nothing to load: see :meth:`save_state`."""


def _token_log_probs(module: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None, rows: torch.Tensor, cols: torch.Tensor,
                     targets: torch.Tensor, chunk: int, with_entropy: bool,
                     vision: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` read from the hidden states at ``(rows, cols)``, flat ``[N]``.

    Bound to the root module and registered as an FSDP forward method. The LM head runs over
    ``chunk`` scored positions at a time and, when gradients are needed, each chunk but the last is
    recomputed in backward instead of kept: the float32 ``[positions, vocab]`` logits never
    exist for more than one chunk, forward or backward. A vision-language model runs its whole
    base model (vision tower, image features merged into the embeddings, language model) with
    ``vision``, the rows' image tensors.
    """
    if is_vision_model(module.config):
        hidden = _base_model(module)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                     use_cache=False, **(vision or {})).last_hidden_state
    else:
        hidden = module.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                      use_cache=False).last_hidden_state
    scored = hidden[rows, cols]
    head = module.get_output_embeddings()

    def score(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(head(h).float(), dim=-1)
        lp = logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1) if with_entropy else lp.new_zeros(())
        return lp, ent

    lps, ents = [], []
    total = scored.shape[0]
    for s in range(0, max(1, total), chunk):
        h, t = scored[s:s + chunk], targets[s:s + chunk]
        # The last chunk is not recomputed: backward reaches it first, so keeping its activations
        # adds nothing to the peak that its recompute would not (a chunk's logits plus their
        # gradient), and a response that fits one chunk pays no second pass through the head.
        if torch.is_grad_enabled() and h.requires_grad and h.shape[0] and s + chunk < total:
            lp, ent = torch.utils.checkpoint.checkpoint(score, h, t, use_reentrant=False)
        else:
            lp, ent = score(h, t)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def _base_model(module: torch.nn.Module) -> torch.nn.Module:
    """The vision-language base model under the LM head (``Qwen2VLModel``: vision tower + language model)."""
    base = getattr(module, "model", None)
    if base is None:
        raise ValueError(f"{type(module).__name__}: no base model under the LM head (expected a .model)")
    return base


def _text_responses(input_ids: torch.Tensor, prompt_length: int, config: Any, pad_id: int) -> torch.Tensor:
    """``input_ids`` with any vision placeholder in the responses fed as padding: the model would take
    it for an image without pixels (engines do not sample them; one that does is not fed as an image)."""
    response = input_ids[:, prompt_length:]
    stray = torch.isin(response, torch.tensor(vision_token_ids(config), dtype=input_ids.dtype))
    if not bool(stray.any()):
        return input_ids
    out = input_ids.clone()
    out[:, prompt_length:][stray] = pad_id
    return out


def _vision_tower(module: torch.nn.Module) -> torch.nn.Module:
    base = getattr(module, "model", module)
    for name in ("visual", "vision_tower", "vision_model"):
        tower = getattr(base, name, None)
        if isinstance(tower, torch.nn.Module):
            return tower
    raise ValueError(f"backend.freeze_vision_tower: {type(module).__name__} has no vision tower "
                     f"(it is not a vision-language model); unset it")


def _model_position_ids(module: torch.nn.Module, input_ids: torch.Tensor, attn: torch.Tensor,
                        vision: dict[str, torch.Tensor]) -> torch.Tensor:
    """Position ids as the model computes them in ``generate``: Qwen2-VL's mRoPE ``[3, B, T]`` (image
    tokens on a 2-D grid, text after them), counted over each row's real tokens only."""
    text = (attn.cumsum(-1) - 1).clamp(min=0)
    rope_index = getattr(_base_model(module), "get_rope_index", None)
    if rope_index is None:
        return text
    token_types = vision.get("mm_token_type_ids")
    if token_types is None:
        token_types = torch.zeros_like(input_ids, dtype=torch.int)
    ids = input_ids.to(token_types.device)
    positions, _ = rope_index(ids, mm_token_type_ids=token_types, image_grid_thw=vision.get("image_grid_thw"),
                              attention_mask=attn.to(token_types.device))
    return positions


def _copy_processor_files(source: str | None, target: str) -> None:
    """An export keeps the model's image processor (and any processor or chat template files)."""
    if not source or not Path(source).is_dir():
        return
    import shutil

    for name in ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                 "chat_template.json", "chat_template.jinja"):
        src = Path(source) / name
        if src.is_file() and not (Path(target) / name).exists():
            shutil.copyfile(src, Path(target) / name)


def _wants_packing(setting: str, module: torch.nn.Module) -> bool:
    setting = str(setting).lower()
    if setting != "auto":
        return setting == "true"
    implementation = str(getattr(getattr(module, "config", None), "_attn_implementation", "") or "")
    return implementation.startswith("flash_attention")


def _wants_shared_prompt(setting: str, module: torch.nn.Module, packed: bool) -> bool:
    setting = str(setting).lower()
    if setting == "false":
        return False
    unable = ("its forwards run packed (backend.remove_padding)" if packed
              else "it is a vision-language model (image rows are laid out per sample)"
              if is_vision_model(module.config) else None)
    if unable and setting == "true":
        raise ValueError(f"backend.shared_prompt=true: {type(module).__name__} cannot share prompts, {unable}; "
                         f"set backend.shared_prompt to 'auto' or 'false'")
    return unable is None


def _shared_prompt_layout(batch: Batch, config: Any) -> tuple[torch.Tensor, ...] | None:
    """Rows of ``[prompt, response, response, ...]`` for the samples of a batch that share a prompt.

    Returns ``(input_ids, position_ids, segments, rows, cols)``: ``[G, L]`` rows, the segment of each
    column (0 the prompt, ``k`` the row's k-th response, -1 padding; :func:`_block_mask` turns it
    into the attention mask) and, for every scored response token in the batch's row-major order,
    where the hidden state that predicts it is. ``None`` when no two samples share a prompt or the
    responses are not left-aligned (the padded layout then serves the batch).
    """
    pm, rm = batch.prompt_mask.bool(), batch.response_attention_mask.bool()
    lengths = rm.sum(-1)
    R = rm.shape[1]
    if not bool((rm == (torch.arange(R) < lengths.unsqueeze(-1))).all()) or not bool(pm.any(-1).all()):
        return None
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(batch)):
        groups.setdefault(tuple(batch.prompt_ids[i][pm[i]].tolist()), []).append(i)
    if len(groups) == len(batch):
        return None
    width = int(getattr(config, "hidden_size", 0) or 0)
    ffn = int(getattr(config, "intermediate_size", 0) or 4 * width)
    pad_id = int(batch.info.get("pad_token_id", 0))
    rows_ids, rows_pos, rows_seg = [], [], []
    where: dict[int, tuple[int, int, int]] = {}  # sample -> (row, column of its prompt's last token, start)
    for prompt, members in groups.items():
        # Chosen from the group alone, so a group is laid out the same in any batch or on any rank.
        mean_response = max(1.0, float(lengths[members].float().mean()))
        per_row = _responses_per_row(len(prompt), mean_response, len(members), width, ffn)
        for s in range(0, len(members), per_row):
            ids, pos, seg = list(prompt), list(range(len(prompt))), [0] * len(prompt)
            for k, m in enumerate(members[s:s + per_row], start=1):
                n = int(lengths[m])
                where[m] = (len(rows_ids), len(prompt) - 1, len(ids))
                ids += batch.response_ids[m, :n].tolist()
                pos += range(len(prompt), len(prompt) + n)
                seg += [k] * n
            rows_ids.append(ids)
            rows_pos.append(pos)
            rows_seg.append(seg)
    L = max(map(len, rows_ids))
    input_ids = torch.tensor([r + [pad_id] * (L - len(r)) for r in rows_ids])
    position_ids = torch.tensor([r + [0] * (L - len(r)) for r in rows_pos])
    segments = torch.tensor([r + [-1] * (L - len(r)) for r in rows_seg])
    rows, cols = [], []
    for m in range(len(batch)):
        row, last_prompt, start = where[m]
        n = int(lengths[m])
        rows += [row] * n
        # Token 0 is predicted at the prompt's last token, token t at the response's token t - 1.
        cols += [last_prompt, *range(start, start + n - 1)][:n]
    return input_ids, position_ids, segments, torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)


def _responses_per_row(prompt: int, response: float, n: int, width: int, ffn: int) -> int:
    """How many of a prompt's ``n`` responses share one row: the fewest estimated FLOPs, counting the
    projections and MLP per token (``8 d^2 + 6 d ffn``) and the masked attention over the whole row
    (``4 d L^2``, which the block mask does not skip)."""
    if not width:
        return n

    def cost(k: int) -> float:
        rows, length = -(-n // k), prompt + k * response
        return rows * (length * (8 * width * width + 6 * width * ffn) + 4 * width * length * length)

    return min(range(1, n + 1), key=cost)


def _block_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``[G, 1, L, L]`` mask of :func:`_shared_prompt_layout`'s rows: a token attends to the
    earlier tokens of its own segment and to the prompt (segment 0); padding attends to itself only."""
    L = segments.shape[1]
    q, k = segments.unsqueeze(-1), segments.unsqueeze(-2)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    allowed = causal & (k >= 0) & ((k == 0) | (k == q))
    allowed |= torch.eye(L, dtype=torch.bool)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


def _shapes_and_dtypes(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """What a checkpoint records of each parameter and buffer, and a load compares with."""
    state = module.state_dict()
    return {"shapes": {k: list(v.shape) for k, v in state.items()},
            "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in state.items()}}


def _numpy_rng_state() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()


def _split_to(groups: list[list[int]], lengths: list[int], target: int) -> list[list[int]]:
    """``groups`` (consecutive sample indices) split until there are ``target`` of them: the group
    with the most tokens is halved each time, keeping the samples in order."""
    groups = [list(g) for g in groups]
    while len(groups) < target:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            raise RuntimeError(f"cannot split {sum(map(len, groups))} samples into {target} micro-batches: the "
                               f"data-parallel ranks hold shards of different sizes")
        i = max(splittable, key=lambda j: sum(lengths[k] for k in groups[j]))
        half = len(groups[i]) // 2
        groups[i:i + 1] = [groups[i][:half], groups[i][half:]]
    return groups


def _pad_right(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad ``[B, r]`` to ``[B, width]`` (outputs of padding-trimmed micro-batches)."""
    return t if t.shape[1] == width else torch.nn.functional.pad(t, (0, width - t.shape[1]))


def _decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (what HF marks as ``_no_split_modules``)."""
    names = set(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in module.modules() if type(m).__name__ in names]
    if layers:
        return layers
    for attr in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj: Any = module
        try:
            for part in attr.split("."):
                obj = getattr(obj, part)
            return list(obj)
        except AttributeError:
            continue
    return []
