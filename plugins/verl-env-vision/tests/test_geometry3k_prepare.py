"""``verl data prepare geometry3k``: hiyouga/geometry3k's parquet layout becomes verl rows with images
that the data stage renders as image prompts."""

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from verl_data import DataError, load_rows, render_rows


def _png(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (48, 40), colour).save(buf, format="PNG")
    return buf.getvalue()


def _geometry3k(path, rows):
    """A parquet file in geometry3k's own layout (images as a list of {bytes, path} structs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_geometry3k_parquet_becomes_verl_rows_with_images_the_data_stage_renders(tmp_path, processor):
    from verl_data_prepare.prepare import prepare

    _geometry3k(tmp_path / "geo" / "data" / "train-00000-of-00001.parquet", [
        {"images": [{"bytes": _png((255, 0, 0)), "path": "a.png"}], "problem": "<image>Find x.", "answer": "3"},
        {"images": [{"bytes": _png((0, 0, 255)), "path": "b.png"}], "problem": "Find the area.", "answer": "12"},
    ])
    _geometry3k(tmp_path / "geo" / "data" / "test-00000-of-00001.parquet", [
        {"images": [{"bytes": _png((0, 255, 0)), "path": "c.png"}], "problem": "<image>Find y.", "answer": "\\sqrt{2}"},
    ])
    result = prepare("geometry3k", [tmp_path / "geo"], tmp_path / "out")
    assert {k: s.rows for k, s in result.splits.items()} == {"train": 2, "test": 1}
    rows = load_rows(str(tmp_path / "out" / "train.parquet"))
    assert rows[0]["data_source"] == "hiyouga/geometry3k" and rows[0]["reward_model"]["ground_truth"] == "3"
    assert rows[1]["prompt"][0]["content"].startswith("<image>Find the area.")  # placeholder added in front
    out, stats = render_rows(rows, processor.tokenizer, processor=processor, max_prompt_length=256)
    assert stats.kept == 2
    red = out[0]["prompt_ids"].multi_modal_data["image"][0]
    assert red.getpixel((0, 0)) == (255, 0, 0) and out[0]["prompt_ids"].count(processor.image_token_id) > 0


def test_geometry3k_rows_without_images_are_refused_naming_the_column(tmp_path):
    from verl_data_prepare.prepare import prepare

    _geometry3k(tmp_path / "train.parquet", [{"images": [], "problem": "Find x.", "answer": "3"}])
    with pytest.raises(DataError, match="train row 0 has no images in column 'images'"):
        prepare("geometry3k", [tmp_path / "train.parquet"], tmp_path / "out")


def test_geometry3k_answers_are_scored_by_the_math_reward():
    from verl_reward_rules.rules import MathReward

    assert "hiyouga/geometry3k" in MathReward.data_sources
    assert MathReward()("so x = \\boxed{3}", "3") == 1.0
