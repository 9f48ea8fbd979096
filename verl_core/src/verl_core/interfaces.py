"""The contracts every plugin implements.

Each extension kind has one uniform interface with keyword-only arguments over the typed
:class:`~verl_core.batch.Batch`: training backends (worker roles), rollout engines, algorithms,
rewards, environments and executors. The controller talks to plugins only through these, so it
never needs to know which plugin it drives. The conformance suites in :mod:`verl_core.testing`
check an implementation against them.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import math
from dataclasses import dataclass, field
from typing import (Any, Awaitable, Callable, ClassVar, Iterable, Iterator, Literal, Mapping, Protocol, Sequence,
                    runtime_checkable)

from typing import TYPE_CHECKING

# Annotations only: importing the contracts costs no torch (reward worker processes read RewardInput).
if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from verl_core.batch import Batch

__all__ = [
    "ConfigError",
    "Role",
    "ModelSpec",
    "WorldInfo",
    "LogProbs",
    "LoRAAdapter",
    "LossFn",
    "AlgorithmLoss",
    "micro_batch_weights",
    "rank_mini_batch",
    "check_sequence_length",
    "TrainingWorker",
    "TrainingBackend",
    "BackendConfig",
    "SamplingParams",
    "PromptIds",
    "RolloutOutput",
    "RolloutEngine",
    "RolloutConfig",
    "Requirements",
    "RolloutRequest",
    "Algorithm",
    "AlgorithmConfig",
    "RewardFunction",
    "RewardInput",
    "RewardError",
    "RewardScorer",
    "ScorerConfig",
    "Environment",
    "EnvironmentConfig",
    "ENV_REWARDS",
    "ModelProvider",
    "DatasetProvider",
    "ConfigFormat",
    "StepResult",
    "Executor",
    "ExecutorConfig",
    "WorkerGroup",
    "WorkerFailedError",
    "dispatch",
    "dispatch_mode",
]


class Role(str, enum.Enum):
    """The jobs a training worker can do."""

    ACTOR = "actor"
    CRITIC = "critic"
    REFERENCE = "reference"
    REWARD_MODEL = "reward_model"


@dataclass(frozen=True)
class ModelSpec:
    """Where a worker gets its model.

    Attributes:
        path: a local Hugging Face model directory (or hub id where a network exists).
        tokenizer_path: tokenizer directory; defaults to ``path``.
        dtype: parameter dtype name (``"float32"``, ``"bfloat16"``).
        trust_remote_code: passed to ``from_pretrained``.
        module: an already loaded ``torch.nn.Module`` to use instead of loading ``path``.
    """

    path: str
    tokenizer_path: str | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False
    module: Any = None


@dataclass(frozen=True)
class WorldInfo:
    """Where a worker sits in its worker group, and in the group's parallel mesh.

    Executors fill in the first five fields. A backend that splits its ranks into model-parallel
    groups (tensor ``tp``, pipeline ``pp``) keeps its own copy with the mesh filled in as the
    worker's ``world`` attribute; executors read it after building the worker. ``"split"`` calls
    are then cut into ``dp_size`` shards, every rank of data-parallel group ``d`` gets shard ``d``,
    and each group's result is read from its :attr:`is_output_rank` (not once per model-parallel
    rank). Unset, the mesh is pure data parallel: ``dp_rank = rank``, ``dp_size = world_size``.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    threads: int = 1
    dp_rank: int | None = None
    dp_size: int | None = None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.dp_rank is None:
            object.__setattr__(self, "dp_rank", self.rank)
        if self.dp_size is None:
            object.__setattr__(self, "dp_size", self.world_size)

    @property
    def is_output_rank(self) -> bool:
        """The rank whose results stand for its data-parallel group: tensor rank 0 of the last pipeline stage."""
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1


@dataclass
class LogProbs:
    """Per-token log-probs (and optionally entropy) of the response tokens, ``[B, R]``."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None


class LossFn(Protocol):
    """A loss over one micro-batch: returns a scalar tensor and float metrics.

    The value is a mean over some units of the micro-batch (its loss tokens, its sequences); a loss
    with a ``units(batch) -> float`` method says how many, so that backends can weight micro-batches
    into the loss of the whole mini-batch (:func:`micro_batch_weights`). One without it is taken as a
    mean over samples.
    """

    def __call__(
        self, *, batch: Batch, log_probs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


def rank_mini_batch(mini_batch_size: int, rank_samples: int, dp_size: int) -> int:
    """Samples per optimizer step on one data-parallel rank. ``mini_batch_size`` counts samples over all
    ranks (as verl's ``ppo_mini_batch_size``; 0: the whole batch) and every rank holds an equal shard,
    so each steps on its share and all take the same number of optimizer steps."""
    if not mini_batch_size:
        return rank_samples
    if mini_batch_size % dp_size:
        raise ValueError(f"algorithm.mini_batch_size={mini_batch_size} is not a multiple of the {dp_size} "
                         f"data-parallel ranks; set it to a multiple, e.g. {dp_size * max(1, mini_batch_size // dp_size)}")
    return mini_batch_size // dp_size


def check_sequence_length(batch: Batch, max_positions: int | None) -> None:
    """Refuse a batch whose prompt plus response is longer than the model's positions, naming the settings."""
    total = batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    if max_positions and total > max_positions:
        raise ValueError(f"sequence length {total} (prompt {batch.prompt_ids.shape[1]} + response "
                         f"{batch.response_ids.shape[1]}) exceeds the model's max_position_embeddings="
                         f"{max_positions}; lower data.max_prompt_length or rollout.max_new_tokens")


def micro_batch_weights(loss_fn: LossFn, micro_batches: Sequence[Batch], *, dp_size: int = 1,
                        sum_over_ranks: Callable[[float], float] | None = None) -> list[float]:
    """The factor each micro-batch's loss (and its metrics) is multiplied by before its backward.

    A mini-batch cut into micro-batches, on each of ``dp_size`` data-parallel ranks whose gradients
    are averaged, must give the gradient of the loss over the whole mini-batch, however it was cut.
    Each micro-batch's loss is a mean over its ``loss_fn.units``, so it counts by its units over the
    units of the mini-batch on all ranks (``sum_over_ranks`` adds this rank's total to its peers'),
    times ``dp_size`` to undo the average over ranks. A token-mean loss is thus divided by the
    mini-batch's global token count, as verl does, not by each micro-batch's.
    """
    units_of = getattr(loss_fn, "units", None)
    units = [float(units_of(m)) if units_of is not None else float(len(m)) for m in micro_batches]
    total = sum(units) if sum_over_ranks is None else float(sum_over_ranks(sum(units)))
    return [u * dp_size / total if total > 0 else 0.0 for u in units]


class AlgorithmLoss:
    """An algorithm's policy or value loss as a backend evaluates it, micro-batch by micro-batch, with
    the algorithm's :meth:`Algorithm.loss_units` as its ``units`` (a class, so it pickles).

    ``detach_old_log_probs``: each micro-batch gets ``old_log_probs = log_probs.detach()`` (the
    old-log-prob forward was left to the update).
    """

    def __init__(self, algorithm: "Algorithm", *, critic: bool = False, detach_old_log_probs: bool = False) -> None:
        self.algorithm = algorithm
        self.critic = critic
        self.detach_old_log_probs = detach_old_log_probs

    def __call__(self, *, batch: Batch, log_probs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if self.detach_old_log_probs:
            batch = batch.replace(old_log_probs=log_probs.detach())
        loss = self.algorithm.value_loss if self.critic else self.algorithm.policy_loss
        return loss(batch=batch, log_probs=log_probs, **kwargs)

    def units(self, batch: Batch) -> float:
        return float(self.algorithm.loss_units(batch))


class ConfigError(ValueError):
    """A configuration the run cannot start with; ``path`` is the dotted key at fault (also
    ``verl_core.config.ConfigError``)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


# ----------------------------------------------------------------------------- dispatch
_DISPATCH_ATTR = "__verl_dispatch__"


def dispatch(mode: str) -> Callable[[Callable], Callable]:
    """Declare how a worker-group call spreads over ranks.

    ``"split"``: the ``batch`` argument is cut into one shard per data-parallel rank and the
    results are gathered in order. ``"broadcast"``: every rank gets the same arguments and rank 0's
    result is returned. ``"all"``: every rank gets the same arguments and all results come back.
    Executors read this; the in-process executor calls the one worker directly.
    """
    if mode not in ("split", "broadcast", "all"):
        raise ValueError(f"unknown dispatch mode {mode!r}; use 'split', 'broadcast' or 'all'")

    def mark(fn: Callable) -> Callable:
        setattr(fn, _DISPATCH_ATTR, mode)
        return fn

    return mark


def dispatch_mode(fn: Callable | type | object, method: str | None = None) -> str:
    """The dispatch mode declared on a worker method (``"broadcast"`` if none).

    ``dispatch_mode(fn)`` reads the mark on one function. ``dispatch_mode(cls, "name")`` (a class
    or an instance) looks ``name`` up through the MRO and returns the first mark found, so an
    implementation that overrides a base method inherits the mode the base declared: the marks
    sit on :class:`TrainingWorker`'s abstract methods, not on every backend's overrides.
    """
    if method is None:
        return getattr(fn, _DISPATCH_ATTR, "broadcast")
    cls = fn if isinstance(fn, type) else type(fn)
    for klass in cls.__mro__:
        attr = klass.__dict__.get(method)
        if attr is None:
            continue
        mode = getattr(getattr(attr, "__func__", attr), _DISPATCH_ATTR, None)  # unwrap static/classmethods
        if mode is not None:
            return mode
    return "broadcast"


# ----------------------------------------------------------------------------- backends
@dataclass
class BackendConfig:
    """Settings every training backend understands. Backends subclass it to add their own.

    Attributes:
        lr: actor learning rate.
        critic_lr: critic learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warm-up length in training steps. The learning rate changes once
            per training step (per update call, however many optimizer steps its mini-batches and
            epochs take), as in verl, so the schedule does not depend on batch sizes. Training
            step ``k`` (1-based) of the warm-up uses ``lr * k / warmup_steps``: the first update
            already moves, and the last warm-up step reaches ``lr``.
        lr_schedule: ``"constant"`` or ``"cosine"`` after warm-up.
        min_lr_ratio: floor of the cosine schedule as a fraction of ``lr``.
        total_training_steps: training steps the cosine schedule spans; 0 lets the trainer fill
            in the run's length (``run.max_steps``, or the steps ``run.epochs`` gives). The cosine
            starts at ``lr`` on the first step after warm-up and falls over
            ``total_training_steps - warmup_steps`` steps to ``lr * min_lr_ratio``, reached on step
            ``total_training_steps + 1`` (the first one past the span) and kept.
        grad_clip: clip the global gradient norm to this (0 disables).
        micro_batch_size: samples per forward/backward (gradient accumulation inside a mini-batch).
        log_prob_micro_batch_size: samples per forward when only computing log-probs.
        logits_chunk_size: response tokens per chunk when turning hidden states into log-probs.
    """

    lr: float = 1e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    total_training_steps: int = 0
    grad_clip: float = 1.0
    micro_batch_size: int = 64
    log_prob_micro_batch_size: int = 256
    logits_chunk_size: int = 1024

    def compute_dtype(self, model_dtype: str) -> str:
        """The dtype forward passes run in (``model.dtype`` unless the backend casts, e.g. mixed precision)."""
        return model_dtype

    def lr_factor(self, step: int) -> float:
        """The learning-rate multiplier at training step ``step`` (0-based: the updates done so far):
        the warm-up, then constant or the cosine down to ``min_lr_ratio`` (see the attributes)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_schedule != "cosine" or not self.total_training_steps:
            return 1.0
        done = min(1.0, (step - self.warmup_steps) / max(1, self.total_training_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done))

    def for_single_process(self) -> BackendConfig:
        """These settings with any parallel layout collapsed to one process.

        ``verl export`` builds the actor from a checkpoint's saved config in one process, whatever
        group size wrote it, and loads the state resharded. A backend whose settings name a layout
        (tensor or pipeline parallel sizes) returns a copy with that layout at 1; its ``load_state``
        must then read state saved at the original layout. The default has no layout: ``self``.
        """
        return self

    def validate(self) -> None:
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError("lr_schedule: must be 'constant' or 'cosine'")
        if self.warmup_steps < 0 or self.total_training_steps < 0:
            raise ValueError("warmup_steps/total_training_steps: must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("min_lr_ratio: must be in [0, 1] (a fraction of lr)")
        if self.micro_batch_size <= 0:
            raise ValueError("micro_batch_size: must be a positive number of samples")


class TrainingWorker(abc.ABC):
    """One model role (actor, critic, reference, reward model) on one rank of a training backend."""

    role: Role

    @dispatch("split")
    @abc.abstractmethod
    def compute_log_probs(self, batch: Batch, *, with_entropy: bool = False) -> LogProbs:
        """Log-probs of ``batch.response_ids`` given the prompts (no gradients)."""

    @dispatch("split")
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Critic values ``[B, R]`` for each response token."""
        raise NotImplementedError(f"the {self.role.value} role has no value head")

    @dispatch("split")
    def update_policy(self, batch: Batch, *, loss_fn: LossFn, mini_batch_size: int, epochs: int) -> dict[str, float]:
        """Optimise the policy on ``batch`` with ``loss_fn``; returns averaged metrics."""
        raise NotImplementedError(f"the {self.role.value} role cannot be trained as a policy")

    @dispatch("split")
    def update_values(self, batch: Batch, *, loss_fn: LossFn, mini_batch_size: int, epochs: int) -> dict[str, float]:
        """Optimise the value head on ``batch`` with ``loss_fn``; returns averaged metrics."""
        raise NotImplementedError(f"the {self.role.value} role has no value head")

    @dispatch("split")
    def compute_scores(self, batch: Batch) -> torch.Tensor:
        """Reward-model scores ``[B]``: one per (prompt, response) row, read at its last real token."""
        raise NotImplementedError(f"the {self.role.value} role has no reward head")

    @dispatch("broadcast")
    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights one tensor at a time, in Hugging Face parameter names."""
        raise NotImplementedError

    @dispatch("broadcast")
    def lora_adapter(self) -> LoRAAdapter | None:
        """The trained LoRA adapter, when this worker trains adapters and syncs them as such.

        ``None`` (the default) means rollout engines get full weights from :meth:`iter_weights`.
        """
        return None

    def hf_module(self) -> torch.nn.Module:
        """The live Hugging Face module, for engines that share weights in the same process."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its module in-process")

    def generation_module(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """A context giving a module an in-process engine can ``generate`` with on the live weights.

        The default yields :meth:`hf_module`; a backend that shards its parameters gathers them
        for the duration of the context (once per generation call, not once per token).
        """
        return contextlib.nullcontext(self.hf_module())

    @dispatch("all")
    def save_state(self, path: str) -> None:
        """Write model, optimizer, scheduler and RNG state under ``path`` (a directory)."""
        raise NotImplementedError

    @dispatch("all")
    def load_state(self, path: str) -> None:
        """Restore what :meth:`save_state` wrote."""
        raise NotImplementedError

    @dispatch("all")
    def load_saved_weights(self, path: str) -> None:
        """Restore only the model weights of what :meth:`save_state` wrote (``verl export`` needs no more).

        The default restores everything with :meth:`load_state`. A backend whose optimizer state is
        costly to allocate and read (Adam's moments are twice the weights) overrides it to read the
        weights alone; the optimizer, scheduler and random streams are then left as they were.
        """
        self.load_state(path)

    @dispatch("broadcast")
    def export_hf(self, path: str) -> None:
        """Write a ``save_pretrained`` Hugging Face directory of the current weights."""
        raise NotImplementedError

    def peak_memory_gb(self) -> float:
        """Peak memory this worker used since the last call, in GiB (0 if unknown)."""
        return 0.0

    def close(self) -> None:
        """Release resources."""


class TrainingBackend(abc.ABC):
    """A training engine (FSDP, Megatron, ...): builds one worker per role and rank."""

    Config: ClassVar[type[BackendConfig]] = BackendConfig

    def __init__(self, config: BackendConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def create_worker(self, *, role: Role, model: ModelSpec, world: WorldInfo, seed: int) -> TrainingWorker:
        """Build the worker for ``role`` on the rank described by ``world``.

        ``model`` is the role's own: the critic's may differ from the actor's (``model.critic_path``,
        ``Trainer(critic_model=...)``). A critic started from a causal LM gets a new value head; one
        started from a model with a one-label score head (a critic, a reward model) keeps that head.
        """

    def check(self, *, model: ModelSpec, world_size: int) -> None:
        """Check the settings against the model and the group's size before any worker starts.

        The trainer calls it once, before any model loads; raise
        :class:`~verl_core.config.ConfigError` naming the key (a parallel layout that does not divide
        the model's heads or layers, or the world size). The default checks nothing.
        """


# ----------------------------------------------------------------------------- rollout
@dataclass
class SamplingParams:
    """How to sample responses."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    greedy: bool = False
    logprobs: bool = True


class PromptIds(list):
    """A prompt's token ids (a ``list[int]``) and the multi-modal data that goes with them.

    What :meth:`RolloutEngine.generate` receives for each prompt. A plain list of ints is a
    text-only prompt; a prompt with images is a ``PromptIds`` whose ids already hold the
    processor's placeholder tokens (one per image token), with:

    * ``multi_modal_data``: the raw inputs by modality, ``{"image": [PIL images]}`` (what engines
      that run their own processor take, e.g. vLLM's ``multi_modal_data``);
    * ``multi_modal_inputs``: the processor's tensors for the model's forward (``pixel_values``,
      ``image_grid_thw``), which the batch carries per sample to the training backend.

    ``prompt + more_ids`` keeps the data (the agent loop appends turns), so code that treats a
    prompt as a list keeps working. An engine that reads the data declares
    :attr:`RolloutEngine.accepts_multi_modal`; the rollout stage refuses to hand images to one
    that does not, rather than let it sample from the text alone.
    """

    def __init__(self, ids: Iterable[int] = (), *, multi_modal_data: dict[str, list[Any]] | None = None,
                 multi_modal_inputs: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(ids)
        self.multi_modal_data = multi_modal_data or {}
        self.multi_modal_inputs = multi_modal_inputs or {}

    def __add__(self, other: Iterable[int]) -> "PromptIds":  # type: ignore[override]
        return PromptIds([*self, *other], multi_modal_data=self.multi_modal_data,
                         multi_modal_inputs=self.multi_modal_inputs)

    def __repr__(self) -> str:
        kinds = {k: len(v) for k, v in self.multi_modal_data.items()}
        return f"PromptIds({list.__repr__(self)}, multi_modal={kinds})"

    @staticmethod
    def inputs_of(prompt: Sequence[int]) -> dict[str, torch.Tensor]:
        """The processor tensors of ``prompt`` (``{}`` for a text-only prompt)."""
        return getattr(prompt, "multi_modal_inputs", None) or {}


@dataclass
class RolloutOutput:
    """Responses for ``len(prompts) * n`` samples, grouped by prompt (prompt 0's n samples first).

    Attributes:
        response_ids: token ids of each response, ending with the stop token if one was hit.
        log_probs: log-prob of each sampled token under the engine (None if not requested).
        finish_reasons: ``"stop"`` (a stop token) or ``"length"`` (hit ``max_new_tokens``).
        weight_version: how many weight syncs the engine had taken when it sampled these (None:
            the engine does not count); the batch carries it per sample.
    """

    response_ids: list[list[int]]
    log_probs: list[list[float]] | None
    finish_reasons: list[str]
    weight_version: int | None = None


@dataclass
class RolloutConfig:
    """Settings every rollout engine understands. Engines subclass it to add their own.

    Attributes:
        n: samples per prompt (the group size of GRPO).
        temperature: sampling temperature.
        top_p: nucleus sampling mass.
        top_k: top-k sampling (-1 disables).
        max_new_tokens: most tokens in a response.
        val_temperature: temperature for validation (0 means greedy).
        val_n: samples per prompt in validation.
        max_log_prob_gap: the weight-sync guard: over this mean absolute difference per token between
            the engine's and the trainer's log-probs of the sampled tokens, the step stops before
            training on them (0: off). Unset, it follows the least precise ``compute_dtype`` of the
            backend and the engine: 1e-3 for float32 (built-in task: 3e-7 with a good vLLM sync, 0.025
            with one tensor off by 10%: bench/results/weight_sync_guard.md), 0.1 for 16-bit.
        log_prob_gap_action: ``"error"`` stops the run naming the step, the gap and the engine;
            ``"warn"`` logs the same and goes on.
    """

    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    val_temperature: float = 0.0
    val_n: int = 1
    max_log_prob_gap: float | None = None
    log_prob_gap_action: Literal["error", "warn"] = "error"

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError("n: must be at least 1 sample per prompt")
        if self.temperature < 0:
            raise ValueError("temperature: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p: must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens: must be at least 1")
        if self.max_log_prob_gap is not None and self.max_log_prob_gap < 0:
            raise ValueError("max_log_prob_gap: must be >= 0 (0 turns the weight-sync guard off)")

    def compute_dtype(self, model_dtype: str) -> str:
        """The dtype the engine computes log-probs in (``model.dtype`` unless the engine casts)."""
        return model_dtype

    def sampling(self, *, seed: int | None = None, validation: bool = False) -> SamplingParams:
        if validation:
            greedy = self.val_temperature == 0
            return SamplingParams(n=self.val_n, temperature=self.val_temperature or 1.0, greedy=greedy,
                                  max_new_tokens=self.max_new_tokens, seed=seed)
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, seed=seed)


@dataclass
class LoRAAdapter:
    """A LoRA adapter as a rollout engine receives it (the PEFT format, in memory).

    Attributes:
        rank: ``r`` of the adapter.
        alpha: ``lora_alpha`` (the update is scaled by ``alpha / rank``).
        target_modules: module names that carry adapters (``q_proj``, ...).
        tensors: PEFT parameter names (``base_model.model.<HF name>.lora_A.weight``) -> full tensors.
    """

    rank: int
    alpha: int
    target_modules: list[str]
    tensors: dict[str, torch.Tensor]

    def peft_config(self, base_model_path: str) -> dict[str, Any]:
        """The ``adapter_config.json`` contents PEFT and inference engines read."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "target_modules": sorted(self.target_modules), "lora_dropout": 0.0, "bias": "none",
                "base_model_name_or_path": base_model_path, "fan_in_fan_out": False, "inference_mode": True}


class RolloutEngine(abc.ABC):
    """Generates responses from the current policy.

    Attributes:
        shares_actor_weights: True when the engine runs on the actor's own parameters in the same
            process, so a weight sync is a no-op.
        supports_memory_release: True when :meth:`release_memory` really frees memory.
        follows_actor_weights: False for an engine that serves fixed weights on purpose; the
            weight-sync guard then records the log-prob gap but never stops the run.
        accepts_lora_adapters: True when :meth:`load_lora_adapter` works (the engine serves the
            base weights plus an adapter, so a sync sends only the adapter).
        seeded_sampling: False for an engine that cannot honour ``SamplingParams.seed`` (the same
            seed then does not repeat a sample, and a resumed run samples anew).
        accepts_multi_modal: True when :meth:`generate` uses the images a :class:`PromptIds`
            carries; prompts with images are refused by engines that leave it False.
    """

    Config: ClassVar[type[RolloutConfig]] = RolloutConfig
    shares_actor_weights: ClassVar[bool] = False
    supports_memory_release: ClassVar[bool] = False
    follows_actor_weights: ClassVar[bool] = True
    seeded_sampling: ClassVar[bool] = True
    accepts_multi_modal: ClassVar[bool] = False

    def __init__(self, *, config: RolloutConfig, model: ModelSpec, tokenizer: Any,
                 actor: TrainingWorker | None = None, world: WorldInfo = WorldInfo()) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.actor = actor
        self.world = world

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[Sequence[int]], *, sampling: SamplingParams) -> RolloutOutput:
        """Sample ``sampling.n`` responses for each prompt (given as token ids, no re-tokenising; a
        :class:`PromptIds` also carries its images)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place with the given (name, full tensor) stream."""
        if not self.shares_actor_weights:
            raise NotImplementedError(f"{type(self).__name__} cannot load new weights")

    @property
    def accepts_lora_adapters(self) -> bool:
        return False

    def load_lora_adapter(self, adapter: LoRAAdapter) -> None:
        """Serve the base weights with ``adapter`` from now on (replacing any earlier adapter)."""
        raise NotImplementedError(f"{type(self).__name__} cannot load LoRA adapters")

    def release_memory(self) -> None:
        """Free weights/KV cache between rollouts where the engine can; a no-op otherwise."""

    def reacquire_memory(self) -> None:
        """Undo :meth:`release_memory`."""

    def close(self) -> None:
        """Shut the engine down."""


# ----------------------------------------------------------------------------- algorithms
@dataclass
class AlgorithmConfig:
    """Settings every algorithm has. Algorithms subclass it (the PPO family through
    :class:`verl_algorithms.base.PPOFamilyConfig`, in the verl-algorithms distribution).

    Attributes:
        epochs: passes over each batch per step.
        mini_batch_size: samples per optimizer step, counted over all data-parallel ranks (each
            rank steps on its equal share; 0 = the whole batch, one step per epoch).

    Every field must change what the step trains on (advantages, losses, update settings, the
    rollout request); the conformance suite moves each off its default and checks
    (:mod:`verl_core.testing`). The exceptions are declared, with the reason, in two class
    attributes that subclasses extend (they are merged along the MRO):

    * ``inert_fields``: field -> why it never changes them (a data column name: it acts when the
      batch is built from data, which the suite's fixed batch skips; say where it is tested);
    * ``inert_when``: ``(field, other)`` -> why ``field`` stops mattering once ``other`` moves (an
      epsilon of a division that ``other`` turns off).

    ``value_aliases`` maps a field to the other names its values accept (``{"kl_estimator": {"k3":
    "low_var_kl"}}``): an alias means what its target means, so the suite does not expect a change.
    """

    inert_fields: ClassVar[dict[str, str]] = {}
    inert_when: ClassVar[dict[tuple[str, str], str]] = {}
    value_aliases: ClassVar[dict[str, dict[str, str]]] = {}

    epochs: int = 1
    mini_batch_size: int = 0

    def validate(self) -> None:
        if self.epochs < 1:
            raise ValueError("epochs: must be at least 1")
        if self.mini_batch_size < 0:
            raise ValueError("mini_batch_size: must be >= 0 (0 = whole batch)")


@dataclass(frozen=True)
class Requirements:
    """What an algorithm needs besides the actor: worker roles, and the rows its training data must hold.

    Attributes:
        critic: a critic role (value model).
        reference: a reference role (the frozen initial policy).
        data: the training rows' format: ``"prompts"`` (a prompt and its ground truth: every online
            algorithm) or ``"preference_pairs"`` (also a preferred and a dispreferred response in
            ``chosen`` and ``rejected`` columns: the offline preference algorithms). A ``builtin:``
            dataset is asked for rows in this format (:attr:`DatasetProvider.formats`); one that
            cannot give them fails before any model loads. Data files are used as they are.
        off_policy: the algorithm trains correctly on samples a few weight versions old (its loss
            has an importance ratio against the sampling policy), so the overlapping trainer modes
            (``trainer.mode = "colocate_async"``/``"separate_async"``) may feed it; those modes refuse
            an algorithm that leaves this false.
    """

    critic: bool = False
    reference: bool = False
    data: str = "prompts"
    off_policy: bool = False


@dataclass(frozen=True)
class RolloutRequest:
    """What an algorithm asks of the run's rollout stage, beyond generating and scoring.

    Attributes:
        filter: keeps the samples worth training on (whole groups, e.g. DAPO's groups whose rewards
            differ); applied to the scored batch before anything else sees it.
        max_extra_rounds: while fewer groups than the step's prompts survive ``filter``, draw more
            prompts and generate again, at most this many times (dynamic sampling); 0 filters once.
        greedy_baseline: also score one greedy response per prompt with the current policy and put
            it in ``batch.extras["baseline_scores"]`` (ReMax's baseline).
    """

    filter: Callable[[Batch], Batch] | None = None
    max_extra_rounds: int = 0
    greedy_baseline: bool = False


class Algorithm(abc.ABC):
    """An RL or preference algorithm: its dataflow and the small pure functions the dataflow calls.

    The controller never looks at an algorithm's name: everything it needs comes through these
    methods. Policy-gradient algorithms usually subclass
    :class:`verl_algorithms.base.PolicyGradient` (verl-algorithms), which declares the standard step.
    """

    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig

    def __init__(self, config: AlgorithmConfig) -> None:
        self.config = config

    def requirements(self) -> Requirements:
        """Roles this algorithm needs besides the actor."""
        return Requirements()

    @abc.abstractmethod
    def build_dataflow(self, df: Any) -> None:
        """Declare the nodes of one RL step on a :class:`~verl_core.dataflow.DataflowBuilder`.

        Online algorithms start with ``df.rollout(...)`` (the run's rollout stage), offline ones with
        ``df.batch_from_data(...)``. The trainer syncs the rollout engine's weights after the step.
        """

    @abc.abstractmethod
    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(advantages, returns)``, both ``[B, R]``, from a scored batch."""

    @abc.abstractmethod
    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The actor's loss on one micro-batch (a :class:`LossFn`)."""

    def value_loss(self, *, batch: Batch, values: torch.Tensor | None = None, log_probs: torch.Tensor | None = None,
                   entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The critic's loss (only algorithms with a critic are asked for it)."""
        raise NotImplementedError(f"{type(self).__name__} has no critic")

    def loss_units(self, batch: Batch) -> float:
        """How many units :meth:`policy_loss` and :meth:`value_loss` on ``batch`` are a mean over.

        Backends weight each micro-batch's loss by its units over the whole mini-batch's (on every
        data-parallel rank), so the gradient does not depend on how the batch is cut. A token-mean
        loss returns ``batch.response_mask.sum()``; the default, one unit per sample, fits a mean
        over samples (or over pairs of two samples each).
        """
        return float(len(batch))

    def step_metrics(self, batch: Batch, metrics: Mapping[str, float]) -> dict[str, float]:
        """Figures of the algorithm's own, logged with the step's ``metrics`` (a KL, say); none by default.

        Called once per step after the dataflow ran, with the step's batch and its metrics so far.
        """
        return {}


# ----------------------------------------------------------------------------- rewards
@dataclass
class RewardInput:
    """What a batch reward function is given: parallel lists, one entry per response.

    Attributes:
        responses: the decoded responses.
        prompts: the rendered prompts the responses answer.
        ground_truths: each row's ``reward_model.ground_truth`` (or answer column).
        data_sources: each row's ``data_source``.
        extra_infos: each row's ``extra_info`` dict, passed through untouched.
    """

    responses: list[str]
    prompts: list[str]
    ground_truths: list[Any]
    data_sources: list[str]
    extra_infos: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.responses)

    def select(self, indices: Sequence[int]) -> "RewardInput":
        """The rows at ``indices``, in that order."""
        extras = self.extra_infos or [{} for _ in self.responses]
        return RewardInput(responses=[self.responses[i] for i in indices], prompts=[self.prompts[i] for i in indices],
                           ground_truths=[self.ground_truths[i] for i in indices],
                           data_sources=[self.data_sources[i] for i in indices],
                           extra_infos=[extras[i] for i in indices])


@runtime_checkable
class RewardFunction(Protocol):
    """Scores a batch of responses; may be ``async``. Returns one float per response."""

    def __call__(self, inputs: RewardInput) -> Sequence[float] | Awaitable[Sequence[float]]: ...


class RewardError(RuntimeError):
    """A reward failed on a sample and the run cannot go on (the CLI reports it as a user error)."""


@dataclass
class ScorerConfig:
    """Settings of ``[reward]`` that the core reads, whichever scorer fills the section (its ``Config``
    subclasses this).

    Attributes:
        on_invalid: a NaN or infinite reward (from the scorer or an environment): ``"stop"`` ends the
            run before the step trains, naming the plugin and row, and keeps the last checkpoint;
            ``"skip"`` drops those rows, counts them in ``reward/invalid_rows`` and goes on (the health
            checks warn).
    """

    on_invalid: str = "stop"

    def validate(self) -> None:
        if self.on_invalid not in ("stop", "skip"):
            raise ValueError(f"on_invalid: must be 'stop' or 'skip', not {self.on_invalid!r}")


class RewardScorer(abc.ABC):
    """The run's reward stage: one score per generated response (``verl.scorers``, ``reward.scorer``).

    The trainer builds it once, before any model loads, from the ``[reward]`` section: ``reward.scorer``
    names the plugin and the rest of the section fills its ``Config``. ``verl-rewards`` provides
    ``default``, which combines :class:`RewardFunction` plugins by data_source and weight.

    Args:
        config: the ``Config`` instance (``None`` when the class has no ``Config``).
        registry: the plugin registry, to find reward functions in.
        tokenizer: the policy's tokenizer (to decode responses).
        data_sources: every data_source the data holds; resolve their rewards now, so a missing one
            fails before any model loads.
    """

    Config: ClassVar[type | None] = None

    def __init__(self, *, config: Any, registry: Any, tokenizer: Any, data_sources: Iterable[str] = ()) -> None:
        self.config = config
        self.registry = registry
        self.tokenizer = tokenizer

    @abc.abstractmethod
    def score(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores ``[B]`` for a generated batch (decoded with ``tokenizer``), plus ``reward/...`` metrics."""

    @abc.abstractmethod
    def score_texts(self, responses: Sequence[str], meta: dict[str, list[Any]],
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores ``[N]`` for decoded responses, plus metrics (validation calls this).

        ``meta`` holds per-response lists: ``ground_truth``, ``data_source``, ``extra_info``,
        ``prompt_text`` and ``prompt_messages``.
        """

    def reward_model_path(self) -> str | None:
        """A reward model the trainer starts on the training backend as the ``reward_model`` role, if any."""
        return None

    def attach_reward_model(self, group: Any, tokenizer: Any) -> None:
        """Take the started ``reward_model`` worker group and its tokenizer (see :meth:`reward_model_path`)."""
        raise NotImplementedError(f"{type(self).__name__} uses no reward model")

    def close(self) -> None:
        """Release what the scorer holds (worker processes); called when the run ends."""


# ----------------------------------------------------------------------------- environments
#: ``batch.extras`` key of the environment's rewards in :meth:`Environment.run_episodes`'s batch, ``[B, R]``:
#: each turn's reward on the last model token of that turn. The rollout stage adds them to the scorer's.
ENV_REWARDS = "env_token_rewards"


@dataclass
class StepResult:
    """What an environment returns after the policy acts."""

    observation: list[dict[str, str]] | None
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnvironmentConfig:
    """Settings of the multi-turn loop every environment has (``[environment]``). Environments
    subclass it to add their own.

    Attributes:
        max_turns: model turns per trajectory at most.
        max_response_tokens: response tokens per trajectory, model and environment together; 0
            means ``rollout.max_new_tokens`` (the budget of one turn) times ``max_turns``.
        concurrency: environment steps (tool calls) run at once.
    """

    max_turns: int = 4
    max_response_tokens: int = 0
    concurrency: int = 8

    def validate(self) -> None:
        if self.max_turns < 1:
            raise ValueError("max_turns: must be at least 1")
        if self.max_response_tokens < 0:
            raise ValueError("max_response_tokens: must be >= 0 (0: rollout.max_new_tokens x max_turns)")
        if self.concurrency < 1:
            raise ValueError("concurrency: must be at least 1")


class Environment(abc.ABC):
    """A multi-turn environment, created once per trajectory: reset with a task, then step with
    each model turn. The class's :meth:`run_episodes` drives its instances; the rollout stage and
    validation call it instead of a plain ``generate`` when the run has an ``[environment]``.

    ``reset``, ``step`` and ``close`` may be coroutines. An environment that offers tools returns
    their OpenAI-style function schemas from :meth:`tools`; the chat template gets them as ``tools=``.
    ``task`` is the built-in task ``verl run --env NAME`` runs (settings by section, layered under
    the user's, e.g. ``{"model": {"path": "builtin:..."}, "data": {"train": "builtin:..."}}``).
    """

    Config: ClassVar[type[EnvironmentConfig]] = EnvironmentConfig
    task: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, config: EnvironmentConfig | None = None) -> None:
        self.config = config if config is not None else self.Config()

    @abc.abstractmethod
    def reset(self, *, prompt: list[dict[str, str]], extra_info: dict[str, Any]) -> list[dict[str, str]]:
        """Start an episode; return the chat messages the policy sees first."""

    @abc.abstractmethod
    def step(self, response: str) -> StepResult:
        """Apply the policy's turn (its text, without the stop token); return the observation
        messages to append (``None`` with ``done``), a reward for this turn, and whether it ended.
        ``info["tool_error"]`` counts a failed tool call in the metrics."""

    def tools(self) -> list[dict[str, Any]] | None:
        """Function schemas of the tools this environment offers (None: no tools)."""
        return None

    def close(self) -> None:
        """Release what the episode holds (processes, files)."""

    @classmethod
    def run_episodes(cls, engine: RolloutEngine, prompts: Sequence[dict[str, Any]], sampling: SamplingParams,
                     make_env: Callable[[], Environment], config: EnvironmentConfig, *, pad_id: int,
                     metrics: dict[str, float] | None = None, boundary: Any = None, step: int = 0) -> Batch:
        """Run ``sampling.n`` whole trajectories per prompt row on ``engine``, one environment from
        ``make_env()`` each, within ``config``'s limits; the batch of their responses, ``response_mask``
        0 on the environment's tokens, its rewards in ``extras[ENV_REWARDS]``. Adds ``env/...`` figures
        to ``metrics``; checks what the environments return with ``boundary``
        (:class:`~verl_core.boundary.Boundary`, which names the plugin in errors) at step ``step``.

        The multi-turn loop is not in the core: ``verl_env_kit.MultiTurnEnvironment`` implements it.
        """
        raise NotImplementedError(
            f"environment {cls.__name__} has no episode runner: subclass verl_env_kit.MultiTurnEnvironment "
            f"(pip install verl-env-kit), which runs the multi-turn loop, instead of verl_core's Environment")


# ----------------------------------------------------------------------------- executors
@dataclass
class ExecutorConfig:
    """Settings every executor understands.

    Attributes:
        world_size: training processes (data-parallel ranks) per worker group.
        threads_per_worker: torch threads per worker; 0 picks cores // workers.
    """

    world_size: int = 1
    threads_per_worker: int = 0


class WorkerFailedError(RuntimeError):
    """A worker process died (killed, out of memory, crashed), so the run cannot go on.

    Attributes:
        role: the role the failed call was made on (``"actor"``, ``"rollout"``, ...).
        rank: the worker's rank in its group.
        cause: what the executor knows about why it died.
    """

    def __init__(self, message: str, *, role: str, rank: int, cause: str) -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.cause = cause


class WorkerGroup(abc.ABC):
    """Workers of one role running SPMD; method calls dispatch per :func:`dispatch`."""

    role: Role
    world_size: int

    @abc.abstractmethod
    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the workers as its dispatch mode declares."""

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)


class Executor(abc.ABC):
    """Places worker groups on processes and runs independent dataflow nodes."""

    Config: ClassVar[type[ExecutorConfig]] = ExecutorConfig

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.plugins: tuple[tuple[str, str], ...] = ()

    def use_plugins(self, plugins: Sequence[tuple[str, str]]) -> None:
        """Name the ``(kind, name)`` plugins the run selected, before any group starts.

        Multi-process executors resolve them through the plugin registry in every worker process,
        so a plugin that cannot be found there fails at start-up with its name, not mid-run when a
        pickled object cannot be imported. An in-process executor has nothing to do.
        """
        self.plugins = tuple(plugins)

    @abc.abstractmethod
    def create_group(self, *, role: Role, factory: Callable[[WorldInfo], Any]) -> WorkerGroup:
        """Start a worker group; ``factory(world)`` builds the worker on each rank."""

    def create_rollout(self, *, engine: type[RolloutEngine], config: RolloutConfig, model: ModelSpec,
                       tokenizer: Any, actor: WorkerGroup) -> RolloutEngine:
        """Start the rollout engine that samples from ``actor``'s policy.

        The default builds the engine in this process on the actor group, which is what an
        in-process executor needs (an engine that shares the actor's weights reaches its module
        directly). A multi-process executor places the engine where its configuration says: inside
        the actor's worker processes (colocated: the engine gets the local actor worker) or on
        processes of its own (split: weights are sent over), and returns a stand-in that
        dispatches ``generate`` and ``load_weights`` to them.
        """
        return engine(config=config, model=model, tokenizer=tokenizer, actor=actor)

    @classmethod
    def is_controller(cls, config: ExecutorConfig) -> bool:
        """Whether this process drives the run: holds its directory's lock and writes it. A launcher
        that starts the same script on every rank (torchrun) answers False on the ranks that only serve
        the controller's calls; the default, one controller that starts its workers, True."""
        return True

    @classmethod
    def trainer_mode_problem(cls, config: ExecutorConfig, mode: str) -> str | None:
        """Why this executor cannot place the rollout producer of ``trainer.mode`` (None: it can).

        Asked before any model loads; the trainer reports the answer as an error on ``trainer.mode``. The
        overlapping modes run a producer thread in the controller. ``"colocate_async"`` gives it an engine
        in the controller's process (its own copy of the weights where the run's engine shares the
        actor's), which an in-process executor can; ``"separate_async"`` needs a rollout pool on processes
        of its own, which the default cannot place.
        """
        if mode == "separate_async":
            return (f"'separate_async' needs a rollout pool on processes of its own, which the {cls.__name__} "
                    f"cannot place; use trainer.mode='colocate_async', or executor.name='ray' with "
                    f"executor.pools={{gen=1}} and executor.placement={{rollout='gen'}}")
        return None

    def run_parallel(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run independent tasks; the default runs them one after the other."""
        return [task() for task in tasks]

    def shutdown(self) -> None:
        """Stop all workers."""


# ----------------------------------------------------------------------------- models and datasets built by name
class ModelProvider(abc.ABC):
    """A model verl can build locally by name: ``model.path = "builtin:<name>"``.

    Registered under ``verl.models`` with the name after ``builtin:``; verl builds it with no
    arguments. ``preset`` holds the settings the model was tuned with, by config section
    (``{"backend": {"lr": 1e-4}}``); they are layered under the user's config, whose settings win,
    as a Hugging Face model ships its generation config.
    """

    preset: ClassVar[dict[str, dict[str, Any]]] = {}

    @abc.abstractmethod
    def model_dir(self) -> str:
        """The local Hugging Face model directory, built and cached on first use."""


class DatasetProvider(abc.ABC):
    """A dataset verl can build locally by name: ``data.train`` / ``data.val = "builtin:<name>"``.

    Registered under ``verl.datasets`` with the name after ``builtin:``; verl builds it with no
    arguments. With ``data.train`` a ``builtin:`` dataset and no ``data.val``, validation reads
    its ``data.val_split`` split.

    ``formats`` lists the row formats (:attr:`Requirements.data`) the provider can build. Training
    asks for the algorithm's format, and validation for ``"prompts"``; ``rows`` is passed
    ``format=`` only when it is not ``"prompts"``, so a provider of prompts alone needs no such argument.
    """

    splits: ClassVar[tuple[str, ...]] = ("train",)
    formats: ClassVar[tuple[str, ...]] = ("prompts",)

    @abc.abstractmethod
    def rows(self, *, split: str) -> list[dict[str, Any]]:
        """The rows of ``split`` in the verl row format (``format=...``: with that format's columns too);
        ``ValueError`` for a split it lacks."""


# ----------------------------------------------------------------------------- config formats
class ConfigFormat(abc.ABC):
    """A config file format other than verl's TOML, for ``verl run -c FILE`` and ``verl config import FILE``.

    Registered under ``verl.config_formats``; the CLI builds each installed one with no arguments and
    uses the first, by name, that ``reads`` the file (verl-config-import's ``verl-yaml``: verl's
    ``ppo_trainer.yaml`` and TRL's GRPOConfig/PPOConfig as YAML or JSON).
    """

    @abc.abstractmethod
    def reads(self, path: Path | None) -> bool:
        """Whether this format reads ``path``, judged by its name alone; None: dotted overrides, no file."""

    @abc.abstractmethod
    def read(self, path: Path | None, *, overrides: Sequence[str] = (),
             registry: Any) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """``path`` and the format's own dotted ``overrides`` as our raw config (``{section: {key: value}}``)
        and the lines that tell the user how each key got there. ``ConfigError`` for what it cannot read."""
