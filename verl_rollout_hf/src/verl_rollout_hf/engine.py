"""Rollout with Hugging Face ``generate``, sharing the actor's weights in the same process.

The engine runs on the actor worker's live module (no copy), so weight sync is free; it is the reference
implementation of the rollout contract and the fallback when no inference engine is installed. It generates
inside the worker's ``generation_module()`` context (part of the worker contract), where a backend that
shards parameters gathers them once for the whole call. Prompts with images (:class:`PromptIds`) are
generated with their vision tensors (``pixel_values``, ``image_grid_thw``) on a vision-language model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from verl_core.contracts import (ModelSpec, PromptIds, RolloutConfig, RolloutEngine, RolloutOutput, SamplingParams,
                                  WorldInfo)
from verl_kit.sharding import autocast, check_autocast

__all__ = ["HFRollout", "HFRolloutConfig"]


@dataclass
class HFRolloutConfig(RolloutConfig):
    """Settings of the Hugging Face rollout.

    Attributes:
        batch_size: prompts per ``generate`` call (0: all prompts at once).
        shared_prefill: when ``n > 1`` samples are drawn per prompt, run each prompt through the model
            once and give its ``n`` samples copies of that key/value cache, instead of letting
            ``generate`` prefill ``n`` identical rows (text models; the samples drawn are the same
            random stream either way).
        autocast: ``"bfloat16"`` or ``"float16"`` generates under ``torch.autocast`` (matmuls and
            attention in that dtype, the weights unchanged); ``"off"`` (the default) in the model's
            dtype. The log-probs it returns are then those of the lower-precision forward, and the
            weight-sync guard's default limit is the 16-bit one.
    """

    batch_size: int = 0
    shared_prefill: bool = True
    autocast: str = "off"

    def validate(self) -> None:
        super().validate()
        check_autocast(self.autocast)

    def compute_dtype(self, model_dtype: str) -> str:
        return model_dtype if self.autocast == "off" else self.autocast


class HFRollout(RolloutEngine):
    """``transformers`` generation on the actor's own module."""

    Config = HFRolloutConfig
    shares_actor_weights = True
    accepts_multi_modal = True

    def __init__(self, *, config: HFRolloutConfig, model: ModelSpec, tokenizer: Any, actor: Any = None,
                 world: WorldInfo = WorldInfo()) -> None:
        super().__init__(config=config, model=model, tokenizer=tokenizer, actor=actor, world=world)
        self._own = None
        if actor is None:
            # Stand-alone use (tests, evaluation): load our own copy and accept weight updates.
            from transformers import AutoConfig

            from verl_kit.multimodal import auto_model_class

            self._own = model.module or auto_model_class(AutoConfig.from_pretrained(
                model.path, trust_remote_code=model.trust_remote_code)).from_pretrained(
                model.path, dtype=getattr(torch, model.dtype), trust_remote_code=model.trust_remote_code)
            if world.device != "cpu":  # a CUDA trainer's producer copy; a caller's module stays where it is
                self._own.to(world.device)
            self._own.eval()
        # In-process on the actor's module, a weight sync has nothing to do.
        self.shares_actor_weights = self._own is None

    def _module_context(self) -> contextlib.AbstractContextManager:
        if self._own is not None:
            return contextlib.nullcontext(self._own)
        return self.actor.generation_module()

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], *, sampling: SamplingParams) -> RolloutOutput:
        tok = self.tokenizer
        eos = [tok.eos_token_id, *sampling.stop_token_ids]
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        chunk = self.config.batch_size or len(prompt_ids) or 1
        responses: list[list[int]] = []
        log_probs: list[list[float]] = []
        reasons: list[str] = []
        rng = torch.random.fork_rng() if sampling.seed is not None else contextlib.nullcontext()
        with rng, self._module_context() as module:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            was_training = module.training
            module.eval()
            try:
                for start in range(0, len(prompt_ids), chunk):
                    part = prompt_ids[start:start + chunk]
                    r, lp, fr = self._generate_chunk(module, part, sampling, eos, pad)
                    responses += r
                    log_probs += lp
                    reasons += fr
            finally:
                module.train(was_training)
        return RolloutOutput(responses, log_probs if sampling.logprobs else None, reasons)

    def _generate_chunk(self, module: torch.nn.Module, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                        eos: list[int], pad: int) -> tuple[list[list[int]], list[list[float]], list[str]]:
        from verl_core.kit import left_pad
        from verl_kit.multimodal import is_vision_model, vision_forward_inputs, vision_token_ids

        ids, mask = left_pad(prompts, pad)
        # On the module's device (a CUDA worker's): generate() does not move its inputs.
        ids, mask = ids.to(module.device), mask.to(module.device)
        vision: dict[str, Any] = vision_forward_inputs([PromptIds.inputs_of(p) for p in prompts], ids, module.config,
                                                        ids.device, prompt_length=ids.shape[1])
        if vision and not is_vision_model(module.config):
            raise ValueError(f"prompts have images, and the policy ({type(module).__name__}) has no vision tower")
        if is_vision_model(module.config):
            # Image placeholders come from the processor only; a sampled one would have no image.
            vision["suppress_tokens"] = vision_token_ids(module.config)
        kwargs: dict[str, Any] = dict(max_new_tokens=sampling.max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                                      num_return_sequences=sampling.n, return_dict_in_generate=True,
                                      output_logits=sampling.logprobs)
        if sampling.greedy:
            # transformers rejects num_return_sequences > 1 without sampling; greedy samples are
            # identical anyway, so decode each prompt once and repeat the result below.
            kwargs.update(do_sample=False, num_return_sequences=1)
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k if sampling.top_k > 0 else 0)
        try:
            with autocast(ids.device.type, self.config.autocast):
                if (self.config.shared_prefill and kwargs["num_return_sequences"] > 1 and not vision
                        and ids.shape[1] > 1):
                    ids, mask, kwargs["past_key_values"] = _shared_prefill(module, ids, mask,
                                                                           kwargs["num_return_sequences"])
                    kwargs["num_return_sequences"] = 1
                out = module.generate(input_ids=ids, attention_mask=mask, **vision, **kwargs)
        except RuntimeError as exc:
            if "probability tensor contains" not in str(exc):
                raise
            raise FloatingPointError("the policy's next-token probabilities are NaN/inf, so its weights have "
                                     "diverged (lower backend.lr, or check the rewards for NaN)") from exc
        new = out.sequences[:, ids.shape[1]:]
        if sampling.logprobs and new.shape[1]:
            logits = torch.stack(out.logits, dim=1).float()
            token_lp = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        else:
            token_lp = torch.zeros(new.shape)
        eos_set = set(eos)
        responses, lps, reasons = [], [], []
        for row, lp in zip(new.tolist(), token_lp.tolist()):
            cut = next((i + 1 for i, t in enumerate(row) if t in eos_set), None)
            responses.append(row[:cut] if cut else row)
            lps.append(lp[:cut] if cut else lp)
            reasons.append("stop" if cut else "length")
        if sampling.greedy and sampling.n > 1:
            n = sampling.n
            # Copies, so that editing one sample never edits its siblings.
            responses = [list(r) for r in responses for _ in range(n)]
            lps = [list(lp) for lp in lps for _ in range(n)]
            reasons = [r for r in reasons for _ in range(n)]
        return responses, lps, reasons

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._own is None:
            return  # the actor's module is our module: nothing to copy
        params = dict(self._own.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                if name in params:
                    params[name].copy_(tensor)

    def adopt_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take ``weights`` as the module's parameters, without a copy where shape, dtype and device match (a
        copy for the rest). The caller must not change them while the engine holds them: a rollout process
        given a published weight version in shared memory (``verl_trainer_async.engine_host``)."""
        if self._own is None:
            return
        params = dict(self._own.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in weights:
                param = params.get(name)
                if param is None:
                    continue
                if (param.shape, param.dtype, param.device) == (tensor.shape, tensor.dtype, tensor.device):
                    param.data = tensor
                else:
                    param.copy_(tensor)


def _shared_prefill(module: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int) -> tuple[Any, ...]:
    """Prefill each (left-padded) prompt once, all but its last token, and repeat rows and cache ``n`` times:
    ``generate`` then feeds only the last prompt token of every sample, as a cache it was handed says."""
    from transformers import DynamicCache

    cache = DynamicCache(config=module.config)
    head = mask[:, :-1]
    module(input_ids=ids[:, :-1], attention_mask=head, position_ids=(head.cumsum(-1) - 1).clamp(min=0),
           past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(n)
    return ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0), cache
