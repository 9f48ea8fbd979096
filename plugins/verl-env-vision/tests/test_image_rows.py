"""Rows with images: the forms verl reads, and the rows it refuses (clearly, or counted with max_bad_rows)."""

import io
import json

import pytest
import torch
from PIL import Image

from verl_data import DataError, build_datasets, render_rows
from verl_core.contracts import PromptIds
from verl_env_vision.task import QUESTION, make_dataset


def _png(colour=(255, 0, 0), size=(64, 64)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _row(images, content=f"<image>{QUESTION}"):
    return {"prompt": [{"role": "user", "content": content}], "images": images, "data_source": "vision_shapes",
            "reward_model": {"ground_truth": "red"}}


def test_placeholder_bytes_paths_dicts_and_content_parts_all_become_image_prompts(processor, tmp_path):
    (tmp_path / "red.png").write_bytes(_png())
    rows = [_row([_png()]),
            _row([str(tmp_path / "red.png")]),
            _row([{"bytes": _png(), "path": None}]),  # Hugging Face datasets' Image feature
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
             "images": [_png()], "reward_model": {"ground_truth": "red"}}]
    out, stats = render_rows(rows, processor.tokenizer, processor=processor)
    assert stats.kept == 4
    first = out[0]["prompt_ids"]
    assert isinstance(first, PromptIds) and first.count(processor.image_token_id) == 16  # 64x64: 8x8 patches / 2x2
    assert first.multi_modal_inputs["pixel_values"].shape == (64, 3 * 2 * 8 * 8)
    for r in out[1:]:  # the same red image, whatever the form: the same tokens and pixels
        assert list(r["prompt_ids"]) == list(first)
        assert torch.equal(r["prompt_ids"].multi_modal_inputs["pixel_values"], first.multi_modal_inputs["pixel_values"])


def test_text_rows_next_to_image_rows_stay_plain_token_lists(processor):
    out, _ = render_rows([_row([_png()]), {"prompt": "no image here", "answer": "x"}], processor.tokenizer,
                         processor=processor)
    assert isinstance(out[0]["prompt_ids"], PromptIds) and type(out[1]["prompt_ids"]) is list


def test_an_image_row_for_a_model_without_a_vision_tower_fails_naming_the_row(processor):
    with pytest.raises(DataError, match="row 0 has 1 images, and the model has no image processor and vision tower"):
        render_rows([_row([_png()])], processor.tokenizer, processor=None, source="data.jsonl")


@pytest.mark.parametrize("bad, reason", [
    (b"\x89PNG\r\n\x1a\nnot really a png", "not a readable image"),
    (_png()[:60], "corrupt|not a readable image"),  # truncated pixel data
    ("/nonexistent/x.png", "does not exist"),
])
def test_a_corrupt_or_missing_image_stops_the_run_or_is_counted_with_max_bad_rows(processor, bad, reason):
    rows = [_row([_png()]), _row([bad]), _row([_png((0, 0, 255))])]
    with pytest.raises(DataError, match=f"row 1: .*({reason}).*max_bad_rows"):
        render_rows(rows, processor.tokenizer, processor=processor)
    out, stats = render_rows(rows, processor.tokenizer, processor=processor, max_bad_rows=1)
    assert stats.bad == 1 and stats.kept == 2 and len(out) == 2  # the good rows are all kept


def test_an_image_over_the_pixel_limit_is_refused_before_it_is_decoded(processor):
    rows = [_row([_png(size=(300, 200))])]
    with pytest.raises(DataError, match=r"300x200 = 60000 pixels is larger than data.max_image_pixels=50000"):
        render_rows(rows, processor.tokenizer, processor=processor, max_image_pixels=50_000)
    _, stats = render_rows(rows + [_row([_png()])], processor.tokenizer, processor=processor,
                           max_image_pixels=50_000, max_bad_rows=1)
    assert stats.bad == 1 and stats.kept == 1


def test_placeholders_that_do_not_match_the_images_are_a_bad_row(processor):
    with pytest.raises(DataError, match="2 image placeholders .* for 1 images"):
        render_rows([_row([_png()], content=f"<image><image>{QUESTION}")], processor.tokenizer, processor=processor)


def test_an_image_prompt_over_max_prompt_length_is_dropped_not_cut_through_its_image(processor):
    rows = [_row([_png()]), {"prompt": "short", "answer": "x"}]
    out, stats = render_rows(rows, processor.tokenizer, processor=processor, max_prompt_length=20,
                             overlong="truncate_left")
    assert stats.dropped == 1 and len(out) == 1 and type(out[0]["prompt_ids"]) is list


def test_a_jsonl_file_with_relative_image_paths_loads_through_the_data_config(processor, tmp_path):
    from verl_core.config import DataConfig

    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(_png())
    rows = [{**_row(["imgs/a.png"]), "images": ["imgs/a.png"]}] * 2
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    train, _, stats = build_datasets(DataConfig(train=str(data), batch_size=1), processor.tokenizer,
                                     processor=processor)
    assert len(train) == 2 and train[0]["prompt_ids"].multi_modal_data["image"][0].size == (64, 64)


def test_the_built_in_task_has_fixed_splits_and_a_blank_control(processor):
    train, test = make_dataset(n_train=30, n_test=10)
    again, _ = make_dataset(n_train=30, n_test=10)
    assert [r["images"] for r in train] == [r["images"] for r in again]
    blank, _ = make_dataset(n_train=30, n_test=10, blank=True)
    assert [r["reward_model"] for r in blank] == [r["reward_model"] for r in train]
    pixels = Image.open(io.BytesIO(blank[0]["images"][0])).getextrema()
    assert pixels == ((255, 255),) * 3  # all white
    assert {r["reward_model"]["ground_truth"] for r in train} <= {"red", "green", "blue", "yellow"}


def test_data_image_key_names_the_column_the_images_are_read_from(processor, tmp_path):
    """``data.image_key`` is the column read: images under another name load only when it names them."""
    from verl_core.config import DataConfig

    row = {**_row(None), "pictures": [_png()]}
    del row["images"]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({**row, "pictures": ["a.png"]}) for _ in range(2)))
    (tmp_path / "a.png").write_bytes(_png())
    train, _, _ = build_datasets(DataConfig(train=str(data), batch_size=1, image_key="pictures"), processor.tokenizer,
                                 processor=processor)
    assert train[0]["prompt_ids"].multi_modal_data["image"][0].size == (64, 64)
    with pytest.raises(DataError):  # the default column ("images") is absent: the <image> placeholder has no image
        build_datasets(DataConfig(train=str(data), batch_size=1), processor.tokenizer, processor=processor)
