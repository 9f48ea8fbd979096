"""Images in prompts: decoding them and turning chat + images into token ids and vision tensors
(handing those tensors to a model's forward is :mod:`verl_kit.multimodal`'s).

A row's images come from its ``data.image_key`` column (verl's ``images``: encoded bytes, a
``{"bytes": ..., "path": ...}`` dict as Hugging Face ``datasets`` stores them, a file path, or a PIL
image) and stand in the chat where the content says ``<image>`` or where a content part is
``{"type": "image"}``. :class:`ImageTextProcessor` renders the chat with the tokenizer's template,
runs the model's image processor, and expands each image placeholder into the image's tokens, as
the model's own processor does; the prompt then travels as a
:class:`~verl_core.contracts.PromptIds` that carries the images and their tensors.

The image processor is read from the model directory (``preprocessor_config.json``). transformers'
full ``AutoProcessor`` of Qwen2-VL also builds a video processor, which needs torchvision; the
image processors with a PIL backend (``Qwen2VLImageProcessorPil``) do not, so this module composes
the image processor and the tokenizer itself and works on machines without torchvision.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Sequence

import torch

from verl_core.contracts import PromptIds

__all__ = ["ImageTextProcessor", "load_processor", "decode_image", "row_images", "image_messages", "IMAGE_PLACEHOLDER",
           "DEFAULT_MAX_IMAGE_PIXELS"]

#: verl's placeholder for an image inside a string message.
IMAGE_PLACEHOLDER = "<image>"
#: ``data.max_image_pixels`` by default (4096 x 4096); bigger images are bad rows.
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
_PROCESSOR_FILE = "preprocessor_config.json"


def decode_image(value: Any, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, base_dir: Path | None = None) -> Any:
    """An RGB PIL image from encoded bytes, a ``{"bytes", "path"}`` dict, a path, or a PIL image.

    The size is checked from the header before the pixels are decoded, so an oversized image costs
    no memory. Raises ``ValueError`` saying what is wrong (corrupt, missing, too large).
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, Image.Image):
        image = value
    else:
        if isinstance(value, (bytes, bytearray, memoryview)):
            source: Any = io.BytesIO(bytes(value))
            what = f"{len(value)} encoded bytes"
        elif isinstance(value, str) and value:
            path = Path(value).expanduser()
            if not path.is_absolute() and base_dir is not None and not path.exists():
                path = base_dir / path
            if not path.is_file():
                raise ValueError(f"image file {value!r} does not exist")
            source, what = path, f"image file {value!r}"
        else:
            raise ValueError(f"an image must be encoded bytes, a file path or a {{'bytes': ...}} dict, got "
                             f"{type(value).__name__}")
        try:
            image = Image.open(source)
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"{what} are not a readable image ({exc})") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"image of {width}x{height} = {width * height} pixels is larger than "
                         f"data.max_image_pixels={max_pixels} (raise it, or resize the images)")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt pixel data
        raise ValueError(f"image of {width}x{height} is corrupt: {exc}") from exc
    return image.convert("RGB")


def row_images(row: dict[str, Any], image_key: str) -> list[Any]:
    """The raw images of a row's ``image_key`` column (``[]`` when it has none)."""
    value = row.get(image_key)
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def image_messages(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """``messages`` with every ``<image>`` in string content made a ``{"type": "image"}`` part; also
    the number of image parts. Content already in parts is kept."""
    out: list[dict[str, Any]] = []
    count = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            parts: list[dict[str, Any]] = []
            for i, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
                if i:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            content = parts
        if isinstance(content, list):
            count += sum(1 for c in content if isinstance(c, dict) and c.get("type") == "image")
        out.append({**m, "content": content})
    return out, count


class ImageTextProcessor:
    """Chat + images -> token ids (image placeholders expanded) and the image processor's tensors.

    Works with image processors that report each image's patch grid (``image_grid_thw``) and
    ``merge_size``, the Qwen2-VL / Qwen2.5-VL family: an image becomes
    ``prod(grid) / merge_size**2`` copies of the image token.

    Args:
        image_processor: the model's image processor (``AutoImageProcessor``).
        tokenizer: the model's tokenizer; its chat template renders an image part as the image token
            (inside the model's vision start/end markers).
        image_token: the placeholder token the model replaces with image features.
    """

    def __init__(self, image_processor: Any, tokenizer: Any, *, image_token: str) -> None:
        if tokenizer.convert_tokens_to_ids(image_token) in (None, tokenizer.unk_token_id):
            raise ValueError(f"the tokenizer has no image token {image_token!r}")
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = image_token
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(image_token))
        self.merge = int(getattr(image_processor, "merge_size", 1) or 1)

    def encode(self, messages: Sequence[dict[str, Any]], images: Sequence[Any]) -> tuple[PromptIds, str]:
        """The prompt (a :class:`PromptIds` with its images and tensors) and its rendered text.

        Raises ``ValueError`` when the rendered chat does not hold one image token per image.
        """
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        found = text.count(self.image_token)
        if found != len(images):
            raise ValueError(f"the prompt has {found} image placeholders ({IMAGE_PLACEHOLDER} or "
                             f"{{'type': 'image'}} parts) for {len(images)} images; give one per image")
        inputs = dict(self.image_processor(images=list(images), return_tensors="pt"))
        grid = inputs.get("image_grid_thw")
        if grid is None:
            raise ValueError(f"{type(self.image_processor).__name__} reports no image_grid_thw; verl's image "
                             f"processing knows the Qwen2-VL family's (load a processor for other models)")
        pieces = text.split(self.image_token)
        expanded = pieces[0]
        for g, piece in zip(grid, pieces[1:]):
            expanded += self.image_token * (int(g.prod()) // self.merge ** 2) + piece
        ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        prompt = PromptIds(ids, multi_modal_data={"image": list(images)},
                           multi_modal_inputs={k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return prompt, text

    def save_pretrained(self, path: str) -> None:
        self.image_processor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def load_processor(model_path: str | None, tokenizer: Any) -> ImageTextProcessor | None:
    """The image-text processor of a model directory, or ``None`` for a text-only model.

    A model has one when its directory holds an image processor (``preprocessor_config.json``) and
    its config a vision tower (``vision_config``) and an image token.
    """
    if not model_path or not (Path(model_path) / _PROCESSOR_FILE).is_file():
        return None
    config_file = Path(model_path) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    token_id = config.get("image_token_id", config.get("image_token_index"))
    if "vision_config" not in config or token_id is None:
        return None
    from transformers import AutoImageProcessor

    image_processor = AutoImageProcessor.from_pretrained(model_path)
    return ImageTextProcessor(image_processor, tokenizer, image_token=tokenizer.convert_ids_to_tokens(int(token_id)))
