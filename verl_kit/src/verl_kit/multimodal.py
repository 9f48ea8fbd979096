"""The model side of images in prompts: the vision tensors a vision-language model's forward takes,
its vision token ids, and which ``transformers`` class builds it.

What a backend or a rollout engine needs to run a vision-language policy (the FSDP backend, the
Hugging Face rollout, the vision environment). The data side (decoding images, rendering chat and
images into token ids) is verl-data's :mod:`verl_data.images`; a prompt's images reach a batch as
its :attr:`~verl_core.batch.Batch.multi_modal_inputs`, which :func:`vision_forward_inputs` hands to
the model.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["vision_forward_inputs", "vision_token_ids", "is_vision_model", "auto_model_class"]


def vision_forward_inputs(samples: Sequence[dict[str, torch.Tensor]], input_ids: torch.Tensor, config: Any,
                          device: torch.device | str, *, prompt_length: int | None = None) -> dict[str, torch.Tensor]:
    """The keyword arguments a vision-language model's forward takes for these rows' images.

    ``samples`` are the rows' :attr:`~verl_core.batch.Batch.multi_modal_inputs` in row order (the
    image tensors are joined in that order, which is the order of the image tokens in
    ``input_ids``); ``mm_token_type_ids`` marks the image tokens (1) as Qwen2-VL's mRoPE needs, in
    the first ``prompt_length`` columns only (a response's tokens are text whatever their id).
    ``{}`` when no row has an image. With ``prompt_length``, prompts whose image tokens do not match
    the images given (inputs lost on the way) raise ``ValueError``.
    """
    present = [s for s in samples if s]
    image_token = getattr(config, "image_token_id", None)
    types = (input_ids == image_token).int() if image_token is not None else None
    if types is not None and prompt_length is not None:
        types[:, prompt_length:] = 0
        # Image tokens without their pixels would be read as text: refuse, never train on that.
        merge = int(getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1) or 1)
        per_row = samples if len(samples) == len(types) else [{}] * len(types)
        expected = [sum(int(g.prod()) // merge ** 2 for g in s.get("image_grid_thw", [])) for s in per_row]
        found = types.sum(-1).tolist()
        if found != expected:
            row = next(i for i, (f, e) in enumerate(zip(found, expected)) if f != e)
            raise ValueError(f"row {row} of the batch holds {found[row]} image tokens, and its images "
                             f"(multi_modal_inputs) give {expected[row]}: the vision inputs were lost or misaligned "
                             f"on the way (every sample must carry its own prompt's images)")
    if not present:
        return {}
    keys = present[0].keys()
    out = {k: torch.cat([s[k] for s in present], dim=0).to(device) for k in keys}
    if types is not None:
        out["mm_token_type_ids"] = types.to(device)
    return out


def vision_token_ids(config: Any) -> list[int]:
    """The ids of a vision-language model's image/video placeholder and marker tokens, which only
    the processor writes: rollout engines keep the policy from sampling them."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(getattr(config, n)) for n in names if getattr(config, n, None) is not None})


def is_vision_model(config: Any) -> bool:
    """Whether a Hugging Face model config has a vision tower."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config: Any) -> Any:
    """The ``transformers`` auto class that builds a policy of this config: image-text-to-text for
    vision-language models (``Qwen2VLForConditionalGeneration``), causal LM otherwise."""
    import transformers

    return transformers.AutoModelForImageTextToText if is_vision_model(config) else transformers.AutoModelForCausalLM
