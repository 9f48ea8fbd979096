"""The built-in visual task: "What colour is the largest shape?" on images drawn here with PIL.

* ``builtin:vision-shapes`` (``verl.datasets``): 64x64 PNG images (in verl's ``images`` column, with an
  ``<image>`` placeholder in the prompt) of two or three shapes (circles, squares, triangles) in
  different colours, one clearly the largest; the answer is its colour (red, green, blue or
  yellow), data_source ``vision_shapes``; fixed train/test splits.
* ``builtin:vision-shapes-blank``: the same rows with every image blank (white), the text-only
  control: the question alone says nothing about the answer (25% by chance).
* ``builtin:tiny-qwen2-vl`` (``verl.models``): a Qwen2-VL (``Qwen2VLForConditionalGeneration``:
  vision transformer, patch merger, mRoPE language model) of ~0.3M parameters with a byte-level
  tokenizer, the Qwen2-VL chat layout and a PIL image processor (``Qwen2VLImageProcessorPil``, 8-pixel
  patches merged 2x2: 16 image tokens per image), after a short supervised warm start: the answer
  format on blank images, then real images until ``WARM_START_TARGET`` greedy accuracy, so that RL
  has room to improve.
* ``vision_shapes`` (``verl.rewards``): 1 when the answer is the colour, and nothing more.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pathlib
import random
from typing import Any, Sequence

from verl_core.contracts import DatasetProvider, ModelProvider

__all__ = ["TinyQwen2VL", "VisionShapes", "VisionShapesBlank", "VisionShapesReward", "build_tokenizer",
           "build_image_processor", "build_model", "make_dataset", "draw_shapes", "ensure_model", "COLOURS",
           "QUESTION", "DATA_SOURCE"]

logger = logging.getLogger(__name__)

DATA_SOURCE = "vision_shapes"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 200, 20)}
QUESTION = "What colour is the largest shape?"
SIZE = 64
SEED = 0
N_TRAIN = 2000
N_TEST = 200
WARM_START_TARGET = 0.4
WARM_START_MAX_STEPS = 200
WARM_START_FORMAT_STEPS = 80
_VERSION = "v2"
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>")
# Frequent strings of the task as single tokens, as BPE merges would make them.
MERGED = ("user", "assistant", "system", QUESTION, *COLOURS)
# Qwen2-VL's chat layout: an image part is <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> Any:
    """Byte-level (no merges), the ChatML and vision markers as single special tokens."""
    from verl_kit.builtin import byte_level_tokenizer

    return byte_level_tokenizer(pad=SPECIAL[0], eos=SPECIAL[2], special=[SPECIAL[1], *SPECIAL[3:]], merged=MERGED,
                                chat_template=CHAT_TEMPLATE)


def build_image_processor() -> Any:
    """Qwen2-VL's image processor, PIL backend (no torchvision): 64x64 images, 8-pixel patches, 2x2 merge."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=SIZE * SIZE,
                                    max_pixels=SIZE * SIZE)


# ---------------------------------------------------------------------- images and rows
def draw_shapes(rng: random.Random) -> tuple[Any, list[str]]:
    """A white image with 2-3 shapes of different colours; returns it and their colours, the largest's first."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    colours = rng.sample(list(COLOURS), rng.choice((2, 3)))
    # The first shape is the largest (half-size 11-15 px), the others at most half its size.
    big = rng.randint(11, 15)
    sizes = [big] + [rng.randint(3, big // 2) for _ in colours[1:]]
    order = list(range(len(colours)))
    rng.shuffle(order)  # drawing order: the largest is not always at the back
    for i in order:
        r = sizes[i]
        cx, cy = rng.randint(r, SIZE - 1 - r), rng.randint(r, SIZE - 1 - r)
        box = (cx - r, cy - r, cx + r, cy + r)
        kind = rng.choice(("circle", "square", "triangle"))
        fill = COLOURS[colours[i]]
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image, colours


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def make_dataset(*, seed: int = SEED, n_train: int = N_TRAIN, n_test: int = N_TEST, blank: bool = False,
                 ) -> tuple[list[dict], list[dict]]:
    """Train and test rows in the verl format, images as PNG bytes; ``blank`` whitens every image."""
    from PIL import Image

    rng = random.Random(seed)
    white = _png(Image.new("RGB", (SIZE, SIZE), (255, 255, 255)))
    rows = []
    for i in range(n_train + n_test):
        image, colours = draw_shapes(rng)
        colour = colours[0]
        rows.append({"prompt": [{"role": "user", "content": f"<image>{QUESTION}"}],
                     "images": [white if blank else _png(image)], "data_source": DATA_SOURCE,
                     "reward_model": {"style": "rule", "ground_truth": colour},
                     "extra_info": {"index": i, "colours": colours}})
    return rows[n_test:], rows[:n_test]


class VisionShapes(DatasetProvider):
    """``builtin:vision-shapes``."""

    splits = ("train", "test")
    blank = False

    def rows(self, *, split: str) -> list[dict[str, Any]]:
        if split not in self.splits:
            raise ValueError(f"builtin:vision-shapes has splits {list(self.splits)}, not {split!r}")
        train, test = make_dataset(blank=self.blank)
        return train if split == "train" else test


class VisionShapesBlank(VisionShapes):
    """``builtin:vision-shapes-blank``: the control, every image blank."""

    blank = True


class VisionShapesReward:
    """1.0 when the response is the largest shape's colour (and nothing else), else 0.0."""

    data_sources = (DATA_SOURCE,)

    def __call__(self, response: str, ground_truth: Any) -> float:
        answer = str(response).strip().rstrip(".").strip().lower()
        return 1.0 if answer == str(ground_truth).strip().lower() else 0.0


class TinyQwen2VL(ModelProvider):
    """``builtin:tiny-qwen2-vl``: the visual task's model after its warm start."""

    # Four optimizer steps per RL step (mini-batches of 64 of the 256 samples): on this task one step
    # per batch learned a third as fast (bench/results/vision.md).
    preset = {
        "backend": {"lr": 1e-3},
        "algorithm": {"mini_batch_size": 64},
        "rollout": {"max_new_tokens": 4, "n": 8},
        "data": {"max_prompt_length": 64, "batch_size": 32, "max_val_samples": 200},
        "run": {"max_steps": 40, "val_every": 10, "save_every": 20},
    }

    def model_dir(self) -> str:
        return str(ensure_model())


# ---------------------------------------------------------------------- the model and its warm start
def build_model(tokenizer: Any, *, seed: int = SEED) -> Any:
    """A Qwen2-VL of the real architecture, tiny: 2 vision blocks (dim 64), 2 language layers (dim 64)."""
    import torch
    import transformers

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model.eval()


def _encode_rows(processor: Any, rows: Sequence[dict]) -> list[dict]:
    """Rows rendered as the data stage renders them (a PromptIds with its images), for the warm start."""
    from verl_data import render_rows

    out, _ = render_rows(rows, processor.tokenizer, processor=processor, max_prompt_length=128, source="warm start")
    return out


def _greedy_accuracy(model: Any, processor: Any, rows: Sequence[dict], greedy: bool = True) -> float:
    from verl_core.contracts import ModelSpec, SamplingParams
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    tok = processor.tokenizer
    engine = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path="", module=model), tokenizer=tok)
    out = engine.generate([r["prompt_ids"] for r in rows], sampling=SamplingParams(n=1, greedy=greedy,
                                                                                   max_new_tokens=4))
    texts = tok.batch_decode(out.response_ids, skip_special_tokens=True)
    reward = VisionShapesReward()
    return sum(reward(t, r["ground_truth"]) for t, r in zip(texts, rows)) / max(1, len(rows))


def warm_start(model: Any, processor: Any, rows: Sequence[dict], held_out: Sequence[dict], *,
               format_steps: int = WARM_START_FORMAT_STEPS, max_steps: int = WARM_START_MAX_STEPS,
               batch_size: int = 32, lr: float = 1e-3, target: float = WARM_START_TARGET,
               seed: int = SEED) -> dict[str, Any]:
    """Supervised steps on (image, question, answer), loss on the answer and its end token only.

    First ``format_steps`` on the rows with blank images: the model learns to answer with a colour
    and stop, but nothing about the pixels (its answers are as good as chance). Then on the real
    images until greedy accuracy on ``held_out`` reaches ``target`` (checked after every step).
    """
    import torch

    from verl_core.kit import left_pad
    from verl_kit.multimodal import vision_forward_inputs

    tok = processor.tokenizer
    blank = _encode_rows(processor, _blanked(rows))
    train = _encode_rows(processor, rows)
    held = _encode_rows(processor, held_out)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step_on(data: Sequence[dict]) -> float:
        model.train()
        picked = rng.sample(list(data), batch_size)
        answers = [tok(r["ground_truth"] + tok.eos_token, add_special_tokens=False)["input_ids"] for r in picked]
        ids, mask = left_pad([list(r["prompt_ids"]) + a for r, a in zip(picked, answers)], tok.pad_token_id)
        vision = vision_forward_inputs([r["prompt_ids"].multi_modal_inputs for r in picked], ids, model.config,
                                       "cpu")
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False, **vision).logits[:, :-1]
        trained = torch.zeros_like(ids, dtype=torch.float32)
        for i, a in enumerate(answers):
            trained[i, ids.shape[1] - len(a):] = 1.0
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").view(len(picked), -1)
        loss = (nll * trained[:, 1:]).sum() / trained[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach())

    loss = 0.0
    for _ in range(format_steps):
        loss = step_on(blank)
    model.eval()
    after_format = _greedy_accuracy(model, processor, held)
    logger.info("vision-task warm start: %d format steps on blank images, loss %.3f, greedy accuracy %.3f",
                format_steps, loss, after_format)
    accuracy, step = after_format, 0
    for step in range(1, max_steps + 1):
        if accuracy >= target:
            step -= 1
            break
        loss = step_on(train)
        model.eval()
        accuracy = _greedy_accuracy(model, processor, held)
        logger.info("vision-task warm start: step %d on images, loss %.3f, greedy accuracy %.3f", step, loss, accuracy)
    return {"format_steps": format_steps, "format_accuracy": after_format, "image_steps": step,
            "held_out_accuracy": accuracy, "target": target, "loss": loss}


def _blanked(rows: Sequence[dict]) -> list[dict]:
    from PIL import Image

    white = _png(Image.new("RGB", (SIZE, SIZE), (255, 255, 255)))
    return [{**r, "images": [white] * len(r["images"])} for r in rows]


def build_untrained(path: str | os.PathLike) -> Any:
    """Write the untrained model, tokenizer and image processor to ``path``; returns the processor."""
    from verl_data import ImageTextProcessor

    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    processor = ImageTextProcessor(build_image_processor(), tokenizer, image_token="<|image_pad|>")
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(str(path))
    return model, processor


def ensure_model(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The directory of ``builtin:tiny-qwen2-vl``, built on first use (about a minute on one core)."""
    from verl_kit.builtin import build_once, one_torch_thread

    def build(tmp: pathlib.Path) -> None:
        import torch

        with one_torch_thread(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model, processor = build_untrained(tmp)
            train, _ = make_dataset()
            # Held-out rows from the training split: the test split stays unseen until validation.
            stats = warm_start(model, processor, train[:-100], train[-100:])
            model.save_pretrained(tmp, safe_serialization=True)
            (tmp / "warm_start.json").write_text(json.dumps(stats, indent=2) + "\n")

    return build_once(f"tiny-qwen2-vl-{_VERSION}", build, done_file="warm_start.json", cache_dir=cache_dir)
