"""Rollout engines: sampling settings, prompts, what an engine returns, and the engine contract."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Literal, Sequence

from verl_core.contracts.common import WorldInfo

# Annotations only: importing the contracts loads no torch (reward worker processes read RewardInput).
if TYPE_CHECKING:
    import torch
    from verl_core.contracts.backend import LoRAAdapter, TrainingWorker
    from verl_core.contracts.common import ModelSpec

__all__ = ["SamplingParams", "PromptIds", "RolloutOutput", "RolloutConfig", "RolloutEngine", "ServerError"]


class ServerError(RuntimeError):
    """An engine's server refused a request, or kept failing after all retries (``verl run`` reports it
    in one line; :class:`verl_kit.engine.RetryingClient` raises it)."""


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
        val_n: samples per prompt in validation; over 1 needs ``val_temperature > 0`` (greedy ones are copies).
        val_top_p: nucleus sampling mass in validation (verl's ``val_kwargs.top_p``; needs ``val_temperature > 0``).
        val_top_k: top-k sampling in validation (-1 disables; needs ``val_temperature > 0``).
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
    val_top_p: float = 1.0
    val_top_k: int = -1
    max_log_prob_gap: float | None = None
    log_prob_gap_action: Literal["error", "warn"] = "error"

    def validate(self) -> None:
        for name in ("", "val_"):  # the training sampling and the validation one
            if getattr(self, f"{name}n") < 1:
                raise ValueError(f"{name}n: must be at least 1 sample per prompt")
            if getattr(self, f"{name}temperature") < 0:
                raise ValueError(f"{name}temperature: must be >= 0")
            if not 0 < getattr(self, f"{name}top_p") <= 1:
                raise ValueError(f"{name}top_p: must be in (0, 1]")
        if self.val_n > 1 and self.val_temperature <= 0:
            raise ValueError(f"val_n: {self.val_n} greedy samples (val_temperature=0) are copies of one; set "
                             f"val_temperature > 0 to sample different ones, or val_n=1")
        if self.val_temperature <= 0 and (self.val_top_p < 1 or self.val_top_k > 0):
            raise ValueError(f"val_{'top_p' if self.val_top_p < 1 else 'top_k'}: greedy validation (val_temperature=0) "
                             f"samples nothing to cut; set val_temperature > 0, or leave val_top_p/val_top_k unset")
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
            return SamplingParams(n=self.val_n, temperature=self.val_temperature or 1.0, greedy=greedy, seed=seed,
                                  top_p=self.val_top_p, top_k=self.val_top_k, max_new_tokens=self.max_new_tokens)
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, seed=seed)


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
