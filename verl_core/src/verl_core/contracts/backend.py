"""Training backends: the worker a backend builds per role and rank, and the loss a worker is given."""

from __future__ import annotations

import abc
import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Protocol

from verl_core.contracts.common import Role, dispatch

# Annotations only: importing the contracts loads no torch (reward worker processes read RewardInput).
if TYPE_CHECKING:
    import torch
    from verl_core.batch import Batch
    from verl_core.contracts.algorithm import Algorithm
    from verl_core.contracts.common import ModelSpec, WorldInfo

__all__ = ["LogProbs", "LossFn", "AlgorithmLoss", "BackendConfig", "LoRAAdapter", "TrainingWorker", "TrainingBackend"]


@dataclass
class LogProbs:
    """Per-token log-probs (and optionally entropy) of the response tokens, ``[B, R]``."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None


class LossFn(Protocol):
    """A loss over one micro-batch: returns a scalar tensor and float metrics.

    The value is a mean over some units of the micro-batch (its loss tokens, its sequences); a loss
    with a ``units(batch) -> float`` method says how many, so that backends can weight micro-batches
    into the loss of the whole mini-batch (``verl_kit.training.micro_batch_weights``). One without it is
    taken as a mean over samples.
    """

    def __call__(
        self, *, batch: Batch, log_probs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


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
        for key, low in (("micro_batch_size", 1), ("log_prob_micro_batch_size", 1), ("logits_chunk_size", 1),
                         ("grad_clip", 0), ("weight_decay", 0)):  # below: read as 1 or as "no clipping" before
            if getattr(self, key) < low:
                raise ValueError(f"{key}: must be >= {low}" + (" (0 disables clipping)" if key == "grad_clip" else ""))


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
    """A training engine (FSDP, Megatron, ...): builds one worker per role and rank.

    ``roles`` are the roles it builds workers for, each implementing what that role is asked
    (:class:`TrainingWorker`: log-probs for every role, the policy update and weights for the actor,
    values for the critic, scores for the reward model). The trainer refuses a run that needs another
    role before any model loads, naming the backend and the role.
    """

    Config: ClassVar[type[BackendConfig]] = BackendConfig
    roles: ClassVar[frozenset[Role]] = frozenset(Role)

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
