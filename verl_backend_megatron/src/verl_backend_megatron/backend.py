"""Megatron-Core workers: actor, critic and reference roles as Megatron GPT models.

A Qwen2/Llama Hugging Face directory is built as a :class:`megatron.core.models.gpt.GPTModel` with the
local layer spec (TransformerEngine specs where TE is installed on a GPU), split over a
``tensor_parallel_size x pipeline_parallel_size`` model-parallel group, data-parallel over the rest of
the worker group. Updates run through Megatron's pipeline schedule (1F1B when pipelined), its DDP and
its optimizer (optionally the distributed optimizer); log-probs and entropy are computed from the
vocabulary-parallel logits without gathering the vocabulary. Weights come in from Hugging Face
safetensors one parameter at a time and go out (weight sync, export) in Hugging Face names, one
gathered parameter at a time; checkpoints are Megatron ``dist_checkpointing`` sharded states.

Each worker tells the executor its place in the mesh (:attr:`MegatronWorker.world`): split calls
are cut over its data-parallel groups and each group's result is read from its last pipeline stage
at tensor-parallel rank 0. On a machine without CUDA the shims of :mod:`verl_backend_megatron._cpu`
are applied around every call into Megatron; with CUDA it runs unpatched on NCCL.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import random
import resource
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from verl_core.batch import Batch
from verl_core.config import ConfigError
from verl_core.contracts import (
    BackendConfig,
    LogProbs,
    LossFn,
    ModelSpec,
    Role,
    TrainingBackend,
    TrainingWorker,
    WorldInfo,
)
from verl_kit.training import check_sequence_length, micro_batch_weights, rank_mini_batch, token_groups
from verl_kit.sharding import ensure_process_group
from verl_backend_megatron import _convert
from verl_backend_megatron._convert import Architecture, UnsupportedModelError
from verl_backend_megatron._cpu import model_compute

__all__ = ["MegatronBackend", "MegatronConfig", "MegatronWorker", "TrainingDivergedError", "TESTED_MEGATRON_CORE"]

logger = logging.getLogger(__name__)

#: megatron-core versions this backend was tested with (on CPU with gloo; see README.md).
TESTED_MEGATRON_CORE = ("0.16.1",)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TrainingDivergedError(FloatingPointError):
    """The loss or gradient norm became NaN/inf; the update was not applied."""


@dataclass
class MegatronConfig(BackendConfig):
    """Megatron-Core settings on top of the common backend settings.

    Attributes:
        tensor_parallel_size: ranks each layer's weights are split over (attention heads, MLP, vocabulary).
            Must divide the attention heads and the key/value heads.
        pipeline_parallel_size: pipeline stages the layers are split over (1F1B schedule over the
            micro-batches of a mini-batch). Must divide the layers.
        use_distributed_optimizer: shard the optimizer state over the data-parallel ranks (Megatron's
            distributed optimizer, ZeRO-1).
        allow_untested_version: run with a megatron-core version this backend was not tested with
            (``TESTED_MEGATRON_CORE``); off, such a version is refused before anything loads.
        sequence_parallel: Megatron's sequence parallelism: outside the tensor-parallel matmuls (norms,
            residuals, dropout) each tensor-parallel rank holds ``1/tensor_parallel_size`` of the sequence,
            with all-gathers / reduce-scatters in place of the all-reduces. Needs
            ``tensor_parallel_size > 1``; each micro-batch is then laid out as wide as a multiple of
            ``tensor_parallel_size`` (the extra columns are padding, never scored). The same results as
            without it, up to fp32 rounding; runs on CPU with gloo and on GPU with NCCL.

        micro_batch_max_tokens: token-budget micro-batches, as in the FSDP backend: consecutive
            samples are packed into micro-batches of at most this many real tokens (prompt +
            response; a longer sample goes alone) instead of ``micro_batch_size`` samples each, for
            updates and log-prob passes (0 disables). Needs ``pipeline_parallel_size=1``: without a
            pipeline Megatron's schedule takes micro-batches of any shape, each laid out only as
            wide as its longest sample; the pipelined schedule sends activations of one fixed shape
            between stages.

    The world size of the worker group must be a multiple of ``tensor_parallel_size x
    pipeline_parallel_size``; the quotient is the data-parallel size. ``micro_batch_size`` samples
    go through each forward/backward (with ``pipeline_parallel_size > 1`` the last micro-batch of a
    mini-batch is filled up with rows that are not scored, as the pipeline needs equal shapes).
    ``weight_decay`` follows Megatron's convention: biases and norm weights are not decayed.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    use_distributed_optimizer: bool = False
    allow_untested_version: bool = False
    micro_batch_max_tokens: int = 0
    sequence_parallel: bool = False

    def validate(self) -> None:
        super().validate()
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be at least 1, got {getattr(self, key)}")
        if self.sequence_parallel and self.tensor_parallel_size < 2:
            # Megatron would silently turn it off in its linear layers (layers.py:913) and not elsewhere.
            raise ValueError(f"sequence_parallel: splits the sequence over the tensor-parallel ranks, and "
                             f"tensor_parallel_size={self.tensor_parallel_size}; set tensor_parallel_size to 2 "
                             f"or more, or sequence_parallel=false")
        if self.micro_batch_max_tokens < 0:
            raise ValueError("micro_batch_max_tokens: must be >= 0 (0 uses micro_batch_size)")
        if self.micro_batch_max_tokens and self.pipeline_parallel_size > 1:
            # p2p_communication.py sends [seq_length, micro_batch_size, hidden] tensors between stages;
            # variable_seq_lengths=True would exchange shapes first, through torch.cuda.synchronize.
            raise ValueError(f"micro_batch_max_tokens: token-budget micro-batches vary in shape, and with "
                             f"pipeline_parallel_size={self.pipeline_parallel_size} Megatron's pipeline schedule "
                             f"sends activations of one fixed [sequence, micro-batch, hidden] shape between "
                             f"stages; set micro_batch_max_tokens=0 (micro_batch_size then sets the split) or "
                             f"pipeline_parallel_size=1")
        check_megatron_installed(allow_untested=self.allow_untested_version)

    def for_single_process(self) -> MegatronConfig:
        """TP = PP = 1: ``dist_checkpointing`` reshards a state saved at any layout on load."""
        return dataclasses.replace(self, tensor_parallel_size=1, pipeline_parallel_size=1, sequence_parallel=False)

    def check_layout(self, arch: Architecture, world_size: int, *, source: str) -> None:
        """The parallel layout fits the world size and the model; ``ConfigError`` naming the numbers if not."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if world_size % (tp * pp):
            raise ConfigError("backend.tensor_parallel_size", f"the worker group has {world_size} ranks, which is not "
                                                              f"a multiple of tensor_parallel_size={tp} x "
                                                              f"pipeline_parallel_size={pp} = {tp * pp}; set "
                                                              f"executor.world_size to a multiple of {tp * pp}")
        if arch.num_heads % tp or arch.num_kv_heads % tp:
            raise ConfigError("backend.tensor_parallel_size", f"{source} has {arch.num_heads} attention heads and "
                                                              f"{arch.num_kv_heads} key/value heads; "
                                                              f"tensor_parallel_size={tp} must divide both")
        if arch.num_layers % pp:
            raise ConfigError("backend.pipeline_parallel_size", f"{source} has {arch.num_layers} layers, which "
                                                                f"pipeline_parallel_size={pp} does not divide")


def check_megatron_installed(*, allow_untested: bool = False) -> str:
    """The installed megatron-core version (from metadata, nothing imported); ValueError if missing or untested."""
    try:
        version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        raise ValueError(f"megatron-core is not installed; pip install 'verl-backend-megatron' (it pins "
                         f"megatron-core=={TESTED_MEGATRON_CORE[-1]})") from None
    if version not in TESTED_MEGATRON_CORE and not allow_untested:
        raise ValueError(f"allow_untested_version: megatron-core {version} is installed, but this backend was "
                         f"tested with {', '.join(TESTED_MEGATRON_CORE)}; pip install "
                         f"megatron-core=={TESTED_MEGATRON_CORE[-1]}, or set backend.allow_untested_version=true")
    return version


def _architecture(model: ModelSpec) -> Architecture:
    source = f"model.path {model.path!r}" if model.module is None else "the model object given"
    try:
        if model.module is not None:
            return Architecture.from_hf_config(model.module.config, source=source)
        return Architecture.from_dir(model.path, source=source)
    except UnsupportedModelError as exc:
        raise ConfigError("backend.name", str(exc)) from None


class MegatronBackend(TrainingBackend):
    """Builds :class:`MegatronWorker` instances."""

    Config = MegatronConfig

    def check(self, *, model: ModelSpec, world_size: int) -> None:
        """The layout against the model's ``config.json`` and the group size, before any worker starts."""
        self.config.check_layout(_architecture(model), world_size, source=f"model {model.path!r}")

    #: No reward-model role: its workers have no score head (reward.reward_model needs backend fsdp).
    roles = frozenset({Role.ACTOR, Role.CRITIC, Role.REFERENCE})

    def create_worker(self, *, role: Role, model: ModelSpec, world: WorldInfo, seed: int) -> TrainingWorker:
        return MegatronWorker(config=self.config, role=Role(role), model=model, world=world, seed=seed)


# ----------------------------------------------------------------------------- process and parallel state


def _quiet_megatron() -> None:
    """Megatron logs every DDP bucket's parameters at INFO and warns at import that TransformerEngine and
    Apex are absent (the README says what that means here); keep that out of a run's output unless the
    user configured megatron's logging."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(are|is) not installed")
    megatron_log = logging.getLogger("megatron.core")
    if megatron_log.level == logging.NOTSET:
        megatron_log.setLevel(logging.WARNING)


def _ensure_model_parallel(tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp) or ps.get_data_parallel_world_size() * tp * pp != dist.get_world_size():
            raise RuntimeError(f"this process already runs Megatron workers at tensor x pipeline parallel {have}; "
                               f"every role of one run uses the same layout, got ({tp}, {pp})")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def _mesh(world: WorldInfo) -> WorldInfo:
    from megatron.core import parallel_state as ps

    return dataclasses.replace(
        world, dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size())


def _transformer_config(arch: Architecture, cfg: MegatronConfig, dtype: torch.dtype, cuda: bool) -> Any:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, normalization="RMSNorm", layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, hidden_dropout=0.0,
        attention_dropout=arch.attention_dropout, tensor_model_parallel_size=cfg.tensor_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_parallel_size, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, attention_softmax_in_fp32=True, sequence_parallel=cfg.sequence_parallel,
        # perform_initialization also marks each weight as tensor-parallel (layers.py:149-170): without it
        # the gradient norm and the optimizer treat TP shards as duplicates. The HF weights then overwrite it.
        use_cpu_initialization=True, perform_initialization=True,
        # Fused kernels need CUDA; the explicit causal mask and these two p2p flags keep
        # Megatron from calling torch.cuda.synchronize (p2p_communication.py), see _cpu.
        gradient_accumulation_fusion=False, masked_softmax_fusion=cuda, bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda, apply_rope_fusion=False, persist_layer_norm=cuda,
        batch_p2p_comm=False, variable_seq_lengths=False)


def _layer_spec(cuda: bool, sequence_parallel: bool = False, num_layers: int = 0) -> Any:
    """The GPT layer spec; with ``sequence_parallel`` on the local spec, the block spec of ``num_layers``
    layers (this stage's) whose norms, final norm included, are :class:`_SequenceParallelRMSNorm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if cuda:
        try:
            import transformer_engine  # noqa: F401 - only whether it is there
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec()  # TENorm handles sequence parallelism
        except ImportError:
            pass
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if not cuda:
        spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    if not sequence_parallel:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    # Without Apex the local spec's norm is WrappedTorchNorm, which refuses sequence parallelism
    # (torch_norm.py:32), and TransformerBlock adds its own for the final norm (transformer_block.py:258).
    spec.submodules.input_layernorm = _SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = _SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=_SequenceParallelRMSNorm)


class _SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (what WrappedTorchNorm builds) over this rank's part of the sequence: its
    weight is marked ``sequence_parallel`` so that ``finalize_model_grads`` sums its gradient over the
    tensor-parallel group (finalize_model_grads.py:354), each rank having seen only its positions."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


@functools.lru_cache(maxsize=1)
def _sdpa_attention_class() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPAttention(DotProductAttention):
        """The local spec's core attention through ``torch.nn.functional.scaled_dot_product_attention``.

        Megatron's :class:`DotProductAttention` (the local spec's) repeats the key/value heads for
        GQA, then runs ``baddbmm``, a masked softmax and ``bmm`` with their backward, each a separate
        pass over ``[b, heads, s, s]`` scores; PyTorch's fused CPU kernel (the one the FSDP backend's
        Hugging Face model uses) does it in one, causal, with grouped key/value heads. The same
        attention up to fp32 rounding. Cases it does not cover (attention dropout while training,
        sliding windows, softmax offsets, query-key layer scaling, other masks) run Megatron's own.
        """

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
            self.sdpa = (attn_mask_type == AttnMaskType.causal and self.softmax_offset is None
                         and self.scale_mask_softmax.window_size is None
                         and not config.apply_query_key_layer_scaling)

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None,
                    ) -> torch.Tensor:
            if (not self.sdpa or (self.training and self.attention_dropout.p > 0) or attention_bias is not None
                    or packed_seq_params is not None or (attn_mask_type not in (None, AttnMaskType.causal))):
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            # [s, b, heads, d] -> [b, heads, s, d]; the worker's mask is the causal one (is_causal).
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    return SDPAttention


@functools.lru_cache(maxsize=1)
def _gpt_class() -> type:
    from megatron.core.models.gpt import GPTModel

    class HiddenStatesGPT(GPTModel):
        """A GPT model whose forward stops at the final norm: the heads (LM head over chosen positions,
        in chunks; a value head) are applied by the worker, so the full ``[tokens, vocab]`` logits
        are never made.

        With sequence parallelism the last stage all-gathers the sequence after the final norm (the
        worker picks scored positions from all of it), and the LM head takes its input as a plain
        column-parallel layer: the picked ``[n, 1, h]`` rows are no sequence to gather.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            head = getattr(self, "output_layer", None)
            if self.config.sequence_parallel and head is not None:
                # As GPTModel._postprocess does for inference (gpt_model.py:668-675): the input is gathered
                # already; its gradient is then all-reduced over the group (copy_to_tensor_model_parallel_region).
                head.sequence_parallel = False

        def _postprocess(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if self.config.sequence_parallel and self.post_process:
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                # The heads after it run the same on every tensor-parallel rank (their input gradient is
                # whole on each), so the backward takes this rank's part instead of reduce-scattering.
                return gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
            return hidden_states

        def sharded_state_dict(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "output_layer", None) is not None or not self.post_process:
                return super().sharded_state_dict(*args, **kwargs)
            # A critic's last stage has a value head in place of the LM head that Megatron's
            # language-model state dict expects there: the head is saved like any replicated module.
            self.post_process = False
            try:
                return super().sharded_state_dict(*args, **kwargs)
            finally:
                self.post_process = True

    return HiddenStatesGPT


# ----------------------------------------------------------------------------- batches
@dataclass
class _Micro:
    """One micro-batch laid out for Megatron: each row's real tokens moved to the front (RoPE
    positions start at 0 for every sample, so left padding needs no position ids), right-padded."""

    batch: Batch  # the real rows, as given (the loss reads it)
    tokens: torch.Tensor  # [b, T] with b >= len(batch): extra rows are filler (nothing scored)
    prompt_lengths: torch.Tensor  # [len(batch)]
    share: float = 1.0


def _layout(batch: Batch, width: int, rows: int) -> _Micro:
    attn = batch.attention_mask.bool()
    prompt_lengths = batch.prompt_mask.sum(-1)
    tokens = torch.zeros(rows, width, dtype=batch.input_ids.dtype)
    ids = batch.input_ids
    for i in range(len(batch)):
        real = ids[i, attn[i]][:width]
        tokens[i, : len(real)] = real
    if rows > len(batch):
        tokens[len(batch):] = tokens[:1]
    return _Micro(batch=batch, tokens=tokens, prompt_lengths=prompt_lengths)


def _without_shims(fn: Callable[..., Any], *args: Any) -> Any:
    """The heads and the loss (the worker's and the algorithm's code, no CUDA placements) run as plain torch."""
    with model_compute():
        return fn(*args)


def _width(batch: Batch) -> int:
    return max(1, int(batch.attention_mask.sum(-1).max()))


class MegatronWorker(TrainingWorker):
    """One role on one rank of the mesh: its stage of the GPT model, wrapped in Megatron DDP and
    with a Megatron optimizer for the trained roles."""

    def __init__(self, *, config: MegatronConfig, role: Role, model: ModelSpec, world: WorldInfo, seed: int) -> None:
        from verl_backend_megatron._cpu import megatron_on_cpu

        self.config, self.role, self.spec = config, role, model
        if model.dtype not in _DTYPES:
            raise ConfigError("model.dtype", f"the megatron backend trains {sorted(_DTYPES)} weights, not "
                                             f"{model.dtype!r}")
        check_megatron_installed(allow_untested=config.allow_untested_version)
        self.arch = _architecture(model)
        config.check_layout(self.arch, world.world_size, source=f"model {model.path!r}")
        torch.set_num_threads(max(1, world.threads))
        self.device = torch.device(world.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.device)
        ensure_process_group(world)
        _quiet_megatron()
        self._shims = megatron_on_cpu
        with self._shims():
            self._build(world, seed)

    def _build(self, world: WorldInfo, seed: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        cfg, arch = self.config, self.arch
        _ensure_model_parallel(cfg.tensor_parallel_size, cfg.pipeline_parallel_size)
        self.world = _mesh(world)
        torch.manual_seed(seed)
        random.seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.first_stage = ps.is_pipeline_first_stage()
        self.last_stage = ps.is_pipeline_last_stage()
        self.layer_offset = self.world.pp_rank * (arch.num_layers // cfg.pipeline_parallel_size)
        dtype = _DTYPES[self.spec.dtype]
        self.tconfig = _transformer_config(arch, cfg, dtype, self.cuda)
        critic = self.role is Role.CRITIC
        module = _gpt_class()(
            config=self.tconfig,
            transformer_layer_spec=_layer_spec(self.cuda, cfg.sequence_parallel,
                                               arch.num_layers // cfg.pipeline_parallel_size),
            vocab_size=arch.padded_vocab(cfg.tensor_parallel_size), max_sequence_length=arch.max_positions,
            pre_process=self.first_stage, post_process=self.last_stage,
            share_embeddings_and_output_weights=arch.tied_embeddings and not critic,
            position_embedding_type="rope", rotary_base=arch.rope_theta)
        if critic and self.last_stage:
            module.output_layer = None  # the value head replaces the LM head
            module.value_head = torch.nn.Linear(arch.hidden_size, 1, dtype=dtype)
        if self.cuda:
            module.cuda(torch.cuda.current_device())
        self._load_hf(module)
        self.module = module
        self.trainable = self.role in (Role.ACTOR, Role.CRITIC)
        self.optimizer = None
        self.ddp = None
        self.optimizer_steps = 0
        self.training_steps = 0
        self._hf_cache: tuple[int, torch.nn.Module] | None = None
        if self.trainable:
            self._build_optimizer()
        else:
            for p in module.parameters():
                p.requires_grad_(False)
        self.module.eval()

    def _build_optimizer(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.config
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=cfg.use_distributed_optimizer)
        self.ddp = DistributedDataParallel(config=self.tconfig, ddp_config=ddp_config, module=self.module)
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.tconfig.no_sync_func = self.ddp.no_sync
        lr = cfg.lr if self.role is Role.ACTOR else cfg.critic_lr
        # clip_grad=0 in Megatron also skips computing the norm; an infinite bound reports it unclipped.
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        ocfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0],
                               adam_beta2=cfg.betas[1], adam_eps=cfg.eps, clip_grad=clip,
                               bf16=self.tconfig.bf16, params_dtype=self.tconfig.params_dtype,
                               use_distributed_optimizer=cfg.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(ocfg, [self.ddp])
        if not self.cuda:
            _fused_cpu_adamw(self.optimizer)
        self._set_lr(0)

    # ------------------------------------------------------------------ weights in
    def _load_hf(self, module: torch.nn.Module) -> None:
        source = _convert.HFSource(path=self.spec.path if self.spec.module is None else None, module=self.spec.module)
        critic = self.role is Role.CRITIC
        tp, tp_rank = self.config.tensor_parallel_size, self.world.tp_rank
        with torch.no_grad():
            for name, param in module.named_parameters():
                kind, hf_names = _convert.mapping(name, arch=self.arch, layer_offset=self.layer_offset, critic=critic)
                if critic and name.startswith("value_head."):
                    # A critic or reward model's one-label score head is kept; a new one starts at 0.
                    if hf_names[0] in source and source.get(hf_names[0]).shape[0] == 1:
                        param.copy_(source.get(hf_names[0]))
                    else:
                        param.zero_()
                    continue
                missing = [n for n in hf_names if n not in source]
                if missing:
                    raise ValueError(f"model.path: {self.spec.path!r} lacks {missing[:3]} (needed for Megatron "
                                     f"parameter {name})")
                shard = _convert.load_shard(kind, [source.get(n) for n in hf_names], arch=self.arch, tp=tp,
                                            tp_rank=tp_rank)
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(f"model.path: {hf_names} give a {tuple(shard.shape)} shard for Megatron "
                                     f"parameter {name} of shape {tuple(param.shape)}")
                param.copy_(shard)

    # ------------------------------------------------------------------ forward pieces
    def _schedule(self, micros: list[_Micro], *, forward_only: bool, on_output: Callable[..., Any]) -> list[Any]:
        """Run micro-batches through Megatron's schedule; ``on_output(micro, hidden)`` on the last stage
        returns ``(loss, data)``. Returns the ``data`` of every micro-batch (last stage; [] elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # seq_length and micro_batch_size size the activations a pipeline sends between stages (all
        # micro-batches have that shape then); without a pipeline each micro-batch has its own.
        width = micros[0].tokens.shape[1]
        rows = micros[0].tokens.shape[0]
        model = self.ddp if self.ddp is not None else self.module
        causal: dict[int, torch.Tensor] = {}

        def forward_step(data_iterator: Iterator[_Micro], chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            micro = next(data_iterator)
            b, t = micro.tokens.shape
            if t not in causal:
                causal[t] = torch.triu(torch.ones(1, 1, t, t, dtype=torch.bool, device=self.device), diagonal=1)
            positions = torch.arange(t, device=self.device).unsqueeze(0).expand(b, t)
            with model_compute():
                hidden = chunk(micro.tokens.to(self.device), positions, causal[t])
            return hidden, functools.partial(_without_shims, on_output, micro)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micros), model=[model], num_microbatches=len(micros),
            seq_length=width, micro_batch_size=rows, forward_only=forward_only)

    def _micro_batches(self, batch: Batch, size: int) -> list[_Micro]:
        """``size`` samples each, or packed up to ``micro_batch_max_tokens`` real tokens when set.

        Without a pipeline each micro-batch is laid out as wide as its own longest sample (with
        ``sequence_parallel``, rounded up to a multiple of ``tensor_parallel_size``: :meth:`_padded`). Data-parallel
        ranks may cut different numbers of micro-batches: Megatron's DDP reduces gradients once, after
        the last (``overlap_grad_reduce`` is off), and tensor-parallel peers hold the same samples.
        """
        budget = self.config.micro_batch_max_tokens
        if self.config.pipeline_parallel_size > 1:
            # The pipeline sends fixed [width, rows, hidden] activations between stages: equal micro-batches
            # (validate() refuses a token budget with a pipeline).
            parts = list(batch.split(max(1, size)))
            width, rows = self._padded(_width(batch)), max(len(p) for p in parts)
            micros = [_layout(p, width, rows) for p in parts]
        else:
            parts = ([batch.select(g) for g in token_groups(batch, budget)] if budget
                     else list(batch.split(max(1, size))))
            micros = [_layout(p, self._padded(_width(p)), len(p)) for p in parts]
        return micros

    def _padded(self, width: int) -> int:
        """With sequence parallelism each tensor-parallel rank takes an equal part of the sequence
        (Megatron splits ``[s, b, h]`` along ``s``): the width rounded up to a multiple of the TP size.
        The extra columns are right padding, after every real token, so causal attention keeps them out
        of every scored position."""
        if not self.config.sequence_parallel:
            return width
        return -(-width // self.config.tensor_parallel_size) * self.config.tensor_parallel_size

    def _scored(self, micro: _Micro) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows, positions, targets)`` of the scored response tokens: each is predicted at the position before it."""
        scored = micro.batch.response_attention_mask.bool()
        rows, cols = scored.nonzero(as_tuple=True)
        return rows, micro.prompt_lengths[rows] + cols - 1, micro.batch.response_ids[scored]

    def _token_log_probs(self, micro: _Micro, hidden: torch.Tensor, with_entropy: bool,
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[b, R]`` log-probs (and entropy) of the response tokens from the last stage's hidden states ``[T, b, h]``."""
        rows, pos, targets = (t.to(self.device) for t in self._scored(micro))
        picked = hidden[pos, rows]  # [N, h]
        head = self.module.output_layer
        weight = self.module.shared_embedding_or_output_weight() if self.module.share_embeddings_and_output_weights \
            else None
        chunk = max(1, self.config.logits_chunk_size)
        lps, ents = [], []
        for s in range(0, max(1, picked.shape[0]), chunk):
            h, t = picked[s:s + chunk], targets[s:s + chunk]

            def score(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                logits, _ = head(h.unsqueeze(1), weight=weight)
                return self._vocab_parallel_log_probs(logits[:, 0].float(), t, with_entropy)

            if torch.is_grad_enabled() and h.requires_grad and s + chunk < picked.shape[0]:
                lp, ent = torch.utils.checkpoint.checkpoint(score, h, t, use_reentrant=False)
            else:
                lp, ent = score(h, t)
            lps.append(lp)
            ents.append(ent)
        B, R = micro.batch.response_ids.shape
        scored = micro.batch.response_attention_mask.bool().to(self.device)
        lp = torch.cat(lps)
        out_lp = lp.new_zeros(B, R).masked_scatter(scored, lp)
        out_ent = lp.new_zeros(B, R).masked_scatter(scored, torch.cat(ents)) if with_entropy else None
        return out_lp, out_ent

    def _vocab_parallel_log_probs(self, logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool,
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of ``targets`` and entropy from this rank's vocabulary slice ``[n, V/tp]``: only
        ``[n]``-sized sums cross the tensor-parallel group, never the vocabulary."""
        tp = self.config.tensor_parallel_size
        if tp == 1:
            logp = torch.log_softmax(logits[:, : self.arch.vocab_size], dim=-1)
            lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            ent = -(logp.exp() * logp).sum(-1) if with_entropy else lp.new_zeros(())
            return lp, ent
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

        local = logits.shape[-1]
        start = self.world.tp_rank * local
        padded = (torch.arange(local, device=logits.device) + start) >= self.arch.vocab_size
        logits = logits.masked_fill(padded, -1e30)  # padded vocabulary rows are never a token
        peak = logits.detach().max(-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.tp_group)
        shifted = logits - peak.unsqueeze(-1)
        log_z = tp_sum(shifted.exp().sum(-1)).log()
        index = targets - start
        mine = (index >= 0) & (index < local)
        picked = shifted.gather(-1, index.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1) * mine
        lp = tp_sum(picked) - log_z
        if not with_entropy:
            return lp, lp.new_zeros(())
        probs = (shifted - log_z.unsqueeze(-1)).exp()
        return lp, log_z - tp_sum((probs * shifted).sum(-1))

    def _values(self, micro: _Micro, hidden: torch.Tensor) -> torch.Tensor:
        """``[b, R]`` values: the value of response token ``j`` is read at the position before it."""
        rows, pos, _ = (t.to(self.device) for t in self._scored(micro))
        picked = self.module.value_head(hidden[pos, rows]).squeeze(-1).float()
        B, R = micro.batch.response_ids.shape
        scored = micro.batch.response_attention_mask.bool().to(self.device)
        return picked.new_zeros(B, R).masked_scatter(scored, picked)

    def _forward_only(self, batch: Batch, head: Callable[[_Micro, torch.Tensor], dict[str, torch.Tensor]],
                      like: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        check_sequence_length(batch, self.arch.max_positions)
        self.module.eval()

        def on_output(micro: _Micro, hidden: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return hidden.new_zeros(()), {k: v.detach().cpu() for k, v in head(micro, hidden).items()}

        with torch.no_grad(), self._shims():
            data = self._schedule(self._micro_batches(batch, self.config.log_prob_micro_batch_size),
                                  forward_only=True, on_output=on_output)
        if not self.last_stage:
            # Results live on the last pipeline stage (the rank executors read for this data-parallel group).
            return {k: torch.zeros(len(batch), *shape) for k, shape in like.items()}
        return {k: torch.cat([d[k] for d in data]) for k in data[0]}

    # ------------------------------------------------------------------ contract
    def compute_log_probs(self, batch: Batch, *, with_entropy: bool = False) -> LogProbs:
        if self.role not in (Role.ACTOR, Role.REFERENCE):
            raise NotImplementedError(f"the {self.role.value} role has no LM head")

        def head(micro: _Micro, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
            lp, ent = self._token_log_probs(micro, hidden, with_entropy)
            return {"log_probs": lp, **({"entropy": ent} if with_entropy else {})}

        R = batch.response_length
        out = self._forward_only(batch, head, {"log_probs": (R,), **({"entropy": (R,)} if with_entropy else {})})
        return LogProbs(out["log_probs"], out.get("entropy"))

    def compute_values(self, batch: Batch) -> torch.Tensor:
        if self.role is not Role.CRITIC:
            return super().compute_values(batch)
        return self._forward_only(batch, lambda m, h: {"values": self._values(m, h)},
                                  {"values": (batch.response_length,)})["values"]

    def update_policy(self, batch: Batch, *, loss_fn: LossFn, mini_batch_size: int, epochs: int) -> dict[str, float]:
        if self.role is not Role.ACTOR:
            return super().update_policy(batch, loss_fn=loss_fn, mini_batch_size=mini_batch_size, epochs=epochs)

        def loss(micro: _Micro, hidden: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            lp, ent = self._token_log_probs(micro, hidden, True)
            return loss_fn(batch=micro.batch.to(self.device), log_probs=lp, entropy=ent)

        return self._optimize(batch, loss, loss_fn, mini_batch_size, epochs, prefix="actor")

    def update_values(self, batch: Batch, *, loss_fn: LossFn, mini_batch_size: int, epochs: int) -> dict[str, float]:
        if self.role is not Role.CRITIC:
            return super().update_values(batch, loss_fn=loss_fn, mini_batch_size=mini_batch_size, epochs=epochs)

        def loss(micro: _Micro, hidden: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            return loss_fn(batch=micro.batch.to(self.device), values=self._values(micro, hidden))

        return self._optimize(batch, loss, loss_fn, mini_batch_size, epochs, prefix="critic")

    # ------------------------------------------------------------------ optimisation
    def _set_lr(self, step: int) -> float:
        base = self.config.lr if self.role is Role.ACTOR else self.config.critic_lr
        lr = base * self.config.lr_factor(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            # Megatron marks biases and norm weights wd_mult=0, which only its OptimizerParamScheduler (not used
            # here) applies: without this line they decayed like every other weight.
            group["weight_decay"] = self.config.weight_decay * group.get("wd_mult", 1.0)
        return lr

    def _sum_over_dp(self, value: float) -> float:
        """``value`` added up over this rank's data-parallel peers (tensor/pipeline peers hold the same samples)."""
        if self.world.dp_size == 1:
            return value
        from megatron.core import parallel_state

        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return float(t.item())

    def _any_rank(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _optimize(self, batch: Batch, micro_loss: Callable[..., Any], loss_fn: LossFn, mini_batch_size: int,
                  epochs: int, *, prefix: str) -> dict[str, float]:
        check_sequence_length(batch, self.arch.max_positions)
        mini = rank_mini_batch(mini_batch_size, len(batch), self.world.dp_size)
        lr = self._set_lr(self.training_steps)
        sums: dict[str, float] = {}
        norms: list[float] = []
        count = 0
        self.module.train()
        try:
            with self._shims():
                for _ in range(epochs):
                    for mb in batch.split(mini):
                        norms.append(self._step(mb, micro_loss, loss_fn, sums, prefix))
                        count += 1
        finally:
            self.module.eval()
        self.training_steps += 1  # the schedule moves once per training step, however many mini-batches
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out[f"{prefix}/grad_norm"] = sum(norms) / max(1, len(norms))
        out[f"{prefix}/lr"] = lr
        out[f"memory/{prefix}_peak_gb"] = self.peak_memory_gb()
        return out

    def _step(self, mb: Batch, micro_loss: Callable[..., Any], loss_fn: LossFn, sums: dict[str, float],
              prefix: str) -> float:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        micros = self._micro_batches(mb, self.config.micro_batch_size)
        count = len(micros)
        # Each micro-batch counts by its share of the loss's units (tokens for token-mean) over the
        # mini-batch on all data-parallel ranks: the gradient does not depend on how the batch was cut.
        for micro, weight in zip(micros, micro_batch_weights(loss_fn, [m.batch for m in micros],
                                                            dp_size=self.world.dp_size,
                                                            sum_over_ranks=self._sum_over_dp)):
            micro.share = weight
        bad: list[float] = []

        def on_output(micro: _Micro, hidden: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            loss, metrics = micro_loss(micro, hidden)
            if not torch.isfinite(loss):
                bad.append(float(loss.detach()))
            for k, v in metrics.items():  # weighted like the loss: they describe the mini-batch
                sums[k] = sums.get(k, 0.0) + float(v) * micro.share
            # The schedule divides by the number of micro-batches; each counts by its share of the units.
            return loss * (micro.share * count), {}

        self._schedule(micros, forward_only=False, on_output=on_output)
        if self._any_rank(bool(bad)):
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            what = f"{prefix} loss is {bad[0]}" if bad else f"{prefix} loss is not finite on another rank"
            raise TrainingDivergedError(f"{what} at optimizer step {self.optimizer_steps + 1}; the update was not "
                                        f"applied (lower backend.lr, or check the rewards for NaN)")
        optimizer = self.optimizer
        optimizer.prepare_grads()
        norm = float(optimizer.get_grad_norm())
        if not math.isfinite(norm):
            self.ddp.zero_grad_buffer()
            optimizer.zero_grad()
            raise TrainingDivergedError(f"{prefix} gradient norm is {norm} at optimizer step "
                                        f"{self.optimizer_steps + 1}; the update was not applied")
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = sub.get_parameters()
            if params and math.isfinite(sub.config.clip_grad):
                clip_grad_by_total_norm_fp32(params, max_norm=sub.config.clip_grad, total_norm=norm)
        optimizer.step_with_ready_grads()
        self.optimizer_steps += 1
        self._weights_changed()
        return norm

    def _weights_changed(self) -> None:
        self._hf_cache = None if self._hf_cache is None else (-1, self._hf_cache[1])

    # ------------------------------------------------------------------ weights out
    def _owner_stage(self, where: str, layer: int | None) -> int:
        pp = self.config.pipeline_parallel_size
        if where == "first":
            return 0
        if where == "last":
            return pp - 1
        return layer // (self.arch.num_layers // pp)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights in Hugging Face names, one Megatron parameter gathered at a time (on every rank)."""
        critic = self.role is Role.CRITIC
        params = dict(self.module.named_parameters())
        pp_ranks = dist.get_process_group_ranks(self.pp_group) if self.config.pipeline_parallel_size > 1 else None
        for name, layer, where in _convert.hf_param_order(self.arch, critic=critic):
            owner = self._owner_stage(where, layer)
            kind, hf_names = _convert.mapping(name, arch=self.arch, layer_offset=0, critic=critic)
            tensors: list[torch.Tensor] | None = None
            if owner == self.world.pp_rank:
                local = name if layer is None else name.replace(
                    f"decoder.layers.{layer}.", f"decoder.layers.{layer - self.layer_offset}.", 1)
                tensors = _convert.to_hf(kind, self._gather_tp(params[local].detach(), kind), arch=self.arch)
            if pp_ranks is not None:
                tensors = self._from_stage(tensors, pp_ranks[owner])
            yield from zip(hf_names, tensors)

    def _gather_tp(self, tensor: torch.Tensor, kind: str) -> list[torch.Tensor]:
        if self.config.tensor_parallel_size == 1 or _convert.gather_dim(kind) is None:
            return [tensor]
        shards = [torch.empty_like(tensor) for _ in range(self.config.tensor_parallel_size)]
        dist.all_gather(shards, tensor.contiguous(), group=self.tp_group)
        return shards

    def _from_stage(self, tensors: list[torch.Tensor] | None, src: int) -> list[torch.Tensor]:
        """The owning pipeline stage's tensors on every stage (their shapes go first, as metadata)."""
        meta = [[(tuple(t.shape), t.dtype) for t in tensors] if tensors is not None else None]
        dist.broadcast_object_list(meta, src=src, group=self.pp_group)
        if tensors is None:
            tensors = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta[0]]
        for t in tensors:
            dist.broadcast(t, src=src, group=self.pp_group)
        return tensors

    def _hf_model(self) -> torch.nn.Module:
        """A Hugging Face module holding the current weights (built once, refreshed after updates)."""
        version = self.optimizer_steps
        if self._hf_cache is not None and self._hf_cache[0] == version:
            return self._hf_cache[1]
        if self._hf_cache is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = (self.spec.module.config if self.spec.module is not None
                      else AutoConfig.from_pretrained(self.spec.path, trust_remote_code=self.spec.trust_remote_code))
            with torch.device("meta"):
                hf = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[self.spec.dtype])
            hf.to_empty(device=self.device)
            hf.eval()
            for p in hf.parameters():
                p.requires_grad_(False)
        else:
            hf = self._hf_cache[1]
        state = hf.state_dict()
        with torch.no_grad():
            for name, tensor in self.iter_weights():
                state[name].copy_(tensor)
        if self.arch.tied_embeddings:
            hf.tie_weights()
        if self._hf_cache is None:
            # Buffers (RoPE inverse frequencies) are not weights and were left empty by to_empty: take
            # them from a freshly built copy of each module that holds some.
            for module in hf.modules():
                if module._buffers and hasattr(module, "config") and not list(module.children()):
                    fresh = type(module)(module.config)
                    for key, buffer in fresh.named_buffers(recurse=False):
                        module._buffers[key] = buffer.to(self.device)
        self._hf_cache = (version, hf)
        return hf

    def hf_module(self) -> torch.nn.Module:
        if self.role is not Role.ACTOR and self.role is not Role.REFERENCE:
            return super().hf_module()
        return self._hf_model()

    def export_hf(self, path: str) -> None:
        if self.role is not Role.ACTOR and self.role is not Role.REFERENCE:
            raise NotImplementedError(f"export_hf writes a causal LM; the {self.role.value} role has none")
        if self.world.rank != 0:
            for _ in self.iter_weights():  # the gathers are collective: take part, keep nothing
                pass
            return
        self._weights_changed()  # gather now, in step with the other ranks, even if a copy is cached
        self._hf_model().save_pretrained(path, safe_serialization=True)
        tok_path = self.spec.tokenizer_path or self.spec.path
        if tok_path and Path(tok_path).exists():
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tok_path).save_pretrained(path)

    def peak_memory_gb(self) -> float:
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    # ------------------------------------------------------------------ state
    def _sharded_state(self, *, loading: bool) -> dict[str, Any]:
        state = {"model": self.module.sharded_state_dict()}
        if self.optimizer is not None:
            _allocate_torch_adam_state(self.optimizer)
            # The distributed optimizer's state in the canonical per-parameter layout: it reshards over
            # any data-parallel size (its default, flattened ranges, is not supported by the torch_dist format).
            state["optimizer"] = self.optimizer.sharded_state_dict(
                state["model"], is_loading=loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        return state

    def _layout_record(self) -> dict[str, Any]:
        return {"architecture": dataclasses.asdict(self.arch), "role": self.role.value, "dtype": self.spec.dtype,
                "tensor_parallel_size": self.config.tensor_parallel_size,
                "pipeline_parallel_size": self.config.pipeline_parallel_size,
                "data_parallel_size": self.world.dp_size,
                "use_distributed_optimizer": self.config.use_distributed_optimizer}

    def save_state(self, path: str) -> None:
        from megatron.core import dist_checkpointing, tensor_parallel

        root = Path(path)
        (root / "megatron").mkdir(parents=True, exist_ok=True)  # dist_checkpointing writes into an existing directory
        _in_process_results_queue()
        with self._shims():
            dist_checkpointing.save(self._sharded_state(loading=False), str(root / "megatron"),
                                    async_sharded_save=False)
            extra = {"layout": self._layout_record(), "optimizer_steps": self.optimizer_steps,
                     "training_steps": self.training_steps,
                     "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_state(),
                             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
                             "cuda": torch.cuda.get_rng_state_all() if self.cuda else None}}
        torch.save(extra, root / f"extra_rank{self.world.rank}.pt")

    def _saved_extra(self, path: str, *, weights_only: bool) -> dict[str, Any]:
        """The non-tensor record :meth:`save_state` wrote, checked against this worker's model."""
        from verl_core.kit import CheckpointError

        root = Path(path)
        extra_path = root / f"extra_rank{self.world.rank}.pt"
        if not extra_path.is_file():
            extra_path = root / "extra_rank0.pt"
        if not extra_path.is_file() or not (root / "megatron").is_dir():
            raise CheckpointError(f"{path} holds no Megatron state (was it saved by another backend? resume it with "
                                  f"the backend that wrote it)")
        extra = torch.load(extra_path, weights_only=False)
        saved, here = extra["layout"], self._layout_record()
        for key in ("architecture", "role", "dtype"):
            same = saved[key] == here[key]
            if key == "role" and weights_only:
                # The actor and the reference are the same language model: either's weights load into the other.
                same = (saved[key] == Role.CRITIC.value) == (here[key] == Role.CRITIC.value)
            if not same:
                raise CheckpointError(f"checkpoint {path} was saved from a different {key}: {saved[key]!r} there, "
                                      f"{here[key]!r} here")
        return extra

    def load_saved_weights(self, path: str) -> None:
        """The model weights of a saved state alone (what ``verl export`` needs), at any layout.

        Only the model's shards are requested from ``dist_checkpointing``: the optimizer's state
        (Adam's two moments per weight, at any ``use_distributed_optimizer``) is neither allocated
        nor read, and the optimizer, step counters and random streams are left as they were.
        """
        from megatron.core import dist_checkpointing

        self._saved_extra(path, weights_only=True)
        with self._shims():
            state = dist_checkpointing.load({"model": self.module.sharded_state_dict()},
                                            str(Path(path) / "megatron"))
            self.module.load_state_dict(state["model"])
        self._weights_changed()

    def load_state(self, path: str) -> None:
        from megatron.core import dist_checkpointing, tensor_parallel

        from verl_core.kit import CheckpointError

        root = Path(path)
        extra = self._saved_extra(path, weights_only=False)
        saved, here = extra["layout"], self._layout_record()
        if self.optimizer is not None and saved["use_distributed_optimizer"] != here["use_distributed_optimizer"]:
            raise CheckpointError(f"checkpoint {path} was saved with use_distributed_optimizer="
                                  f"{saved['use_distributed_optimizer']}; resume with the same setting")
        with self._shims():
            state = dist_checkpointing.load(self._sharded_state(loading=True), str(root / "megatron"))
            self.module.load_state_dict(state["model"])
            if self.optimizer is not None:
                _load_optimizer_state(self.optimizer, state["optimizer"])
            same_layout = all(saved[k] == here[k] for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                                              "data_parallel_size"))
            if same_layout:
                rng = extra["rng"]
                torch.set_rng_state(rng["torch"])
                random.setstate(rng["python"])
                if rng.get("numpy") is not None:
                    import numpy

                    numpy.random.set_state(rng["numpy"])
                tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
                if rng.get("cuda") is not None and self.cuda:
                    torch.cuda.set_rng_state_all(rng["cuda"])
            elif self.world.rank == 0:
                logger.warning("checkpoint %s was saved at tensor/pipeline/data parallel %s, this run has %s: weights "
                               "and optimizer state are resharded, random streams start afresh", path,
                               tuple(saved[k] for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                                        "data_parallel_size")),
                               tuple(here[k] for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                                       "data_parallel_size")))
        self.optimizer_steps = extra["optimizer_steps"]
        self.training_steps = extra["training_steps"]
        if self.optimizer is not None:
            self._set_lr(self.training_steps)
        self._hf_cache = None if self._hf_cache is None else (-1, self._hf_cache[1])

    def close(self) -> None:
        self.optimizer = self.ddp = None
        self.module = None
        self._hf_cache = None


def _fused_cpu_adamw(optimizer: Any) -> None:
    """Step the ``torch.optim.AdamW`` that Megatron falls back to without TransformerEngine/Apex with
    PyTorch's fused CPU kernel (one vectorised pass per parameter, ``torch._fused_adamw_``).

    Megatron builds it with the defaults, and on CPU those pick the single-tensor loop: about ten
    elementwise passes over every parameter and both moments. On the ~32M bench model the step took
    78 ms that way and 25 ms fused (one thread), the same update up to fp32 rounding.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if any(p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16) for p in params):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False


def _torch_adam_distributed(optimizer: Any) -> list[Any]:
    """The distributed optimizers in ``optimizer`` that step a ``torch.optim`` Adam/AdamW.

    That is Megatron's optimizer without TransformerEngine/Apex (``distrib_optimizer.py:21-36``,
    ``HAVE_APEX_OR_TE = False``): on every CPU machine, and on a GPU without either. Its
    checkpoint code is written for their ``FusedAdam`` (state allocated with the optimizer, the step
    kept in the parameter groups) and misses three things for a torch Adam; the two helpers below
    answer them.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [sub for sub in subs
            if isinstance(sub, DistributedOptimizer) and isinstance(sub.optimizer, torch.optim.Adam | torch.optim.AdamW)]


def _allocate_torch_adam_state(optimizer: Any) -> None:
    """Allocate a torch Adam's state before its first step, as its first step would.

    ``DistributedOptimizer.state_dict`` (``distrib_optimizer.py:641-642``) reads the step from the
    per-parameter state and asserts it found exactly one: before the first step a torch Adam has
    no state yet (it allocates lazily), so saving or loading a fresh worker failed there
    (``sharded_state_dict`` calls ``state_dict`` on load too, ``:1246``). This is the state
    ``torch.optim.Adam._init_group`` creates: step 0 and zero moments, which the first step then
    uses as if it had made them (the update is the same bit for bit) and a load overwrites.
    """
    for sub in _torch_adam_distributed(optimizer):
        inner = sub.optimizer
        if len(inner.state):
            continue
        for group in inner.param_groups:
            on_param = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                state = {"step": torch.zeros((), dtype=torch.float32, device=p.device) if on_param
                         else torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                                           else torch.float32),
                         "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                         "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                inner.state[p] = state


def _load_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, with the two torch Adam fixes of a distributed optimizer.

    * ``DistributedOptimizer.load_state_dict`` puts the saved step (from the parameter groups,
      ``:818-825``) into every parameter's state, then copies the saved tensors over every key of
      that state (``_set_main_param_and_optimizer_states``, ``:936-940``); the saved tensors have no
      ``step`` (``:1496``, ``:2101``), so it failed with ``KeyError: 'step'``. Here the key it looks
      for is the step it has just set.
    * It sets one step tensor object for all parameters (``:821-825``), and ``Optimizer.load_state_dict``
      keeps it shared (a step is not copied when dtype and device already match): each later
      update would advance it once per parameter (``step_t += 1``, ``torch._foreach_add_``), and
      Adam's bias correction with it. Each parameter gets its own copy again, as torch makes them.
    """
    subs = _torch_adam_distributed(optimizer)

    def keep_step(sub: Any, model_param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
        if "step" not in tensors:
            group_index, group_order = sub.model_param_group_index_map[model_param]
            main_param = sub.optimizer.param_groups[group_index]["params"][group_order]
            tensors = {**tensors, "step": sub.optimizer.state[main_param]["step"]}
        type(sub)._set_main_param_and_optimizer_states(sub, model_param, tensors)

    for sub in subs:
        sub._set_main_param_and_optimizer_states = functools.partial(keep_step, sub)
    try:
        optimizer.load_state_dict(state)
    finally:
        for sub in subs:
            del sub._set_main_param_and_optimizer_states
    for sub in subs:
        for param_state in sub.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()


def _in_process_results_queue() -> None:
    """Give dist_checkpointing's writer an in-process results queue.

    ``strategies/filesystem_async.py:51-56`` makes it a ``Manager().Queue()`` of a *spawned* process,
    which re-imports the user's ``__main__``: a training script without an ``if __name__ ==
    "__main__"`` guard would start training again in it (and the save fails with EOFError). Saves
    here are synchronous (``async_sharded_save=False``): the queue is filled and read in this process.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()
