"""Prompt data: every source format, both row shapes, chat templates, overlong prompts."""

import json
from types import SimpleNamespace

import pytest

from verl_core.config import DataConfig
from verl_data import DataError, build_datasets, load_rows, render_rows
from verl_core.testing import build_byte_tokenizer

VERL_ROWS = [
    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}
    for i in range(6)
]
PLAIN_ROWS = [{"question": f"Spell {w}.", "solution": w, "id": i} for i, w in enumerate(["cat", "dog", "emu"])]


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def _write(rows, path):
    import datasets

    ds = datasets.Dataset.from_list(rows)
    if path.suffix == ".parquet":
        ds.to_parquet(str(path))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        ds.save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("name", ["rows.parquet", "rows.jsonl", "rows.json", "saved_dataset"])
def test_every_local_format_loads_the_same_rows(tmp_path, name):
    rows = load_rows(_write(VERL_ROWS, tmp_path / name))
    assert rows == VERL_ROWS


def test_files_are_read_without_the_datasets_library(tmp_path):
    """A jsonl/json/parquet file is read directly: importing ``datasets`` costs ~80 MB of RSS in
    every training process. Rows missing a column get ``None`` there, as in a table."""
    import subprocess
    import sys

    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2", "extra": {"k": 1}}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")  # a trailing blank line is fine
    code = ("import sys; from verl_data import load_rows; "
            f"rows = load_rows({str(path)!r}); print(rows); assert 'datasets' not in sys.modules, 'datasets imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert load_rows(str(path)) == [{"prompt": "a", "answer": "1", "extra": None}, rows[1]]


def test_malformed_json_files_name_the_line_and_the_fix(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 2 is not valid JSON .* one row object"):
        load_rows(str(bad))
    scalars = tmp_path / "scalars.json"
    scalars.write_text("[1, 2]")
    with pytest.raises(DataError, match="row 1 is not a JSON object"):
        load_rows(str(scalars))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="broken.parquet: cannot read it as parquet"):
        load_rows(str(broken))


def test_dataset_directories_pick_the_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(VERL_ROWS[:4]),
                               "test": datasets.Dataset.from_list(VERL_ROWS[4:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(load_rows(str(tmp_path / "dd"), split="train")) == 4
    assert len(load_rows(str(tmp_path / "dd"), split="test")) == 2
    with pytest.raises(DataError, match=r"no 'validation' split; splits are \['train', 'test'\]"):
        load_rows(str(tmp_path / "dd"), split="validation")
    # A folder of data files named by split, like a Hub repository checked out by hand.
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    _write(VERL_ROWS[:5], repo / "train-00000-of-00001.parquet")
    _write(VERL_ROWS[5:], repo / "test-00000-of-00001.parquet")
    assert len(load_rows(str(tmp_path / "repo"), split="train")) == 5
    assert len(load_rows(str(tmp_path / "repo"), split="test")) == 1


def test_missing_and_unsupported_sources_say_what_to_use(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="does not exist"):
        load_rows(str(tmp_path / "nope.parquet"))
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_rows(str(tmp_path / "rows.csv"))
    # A Hub id is tried on the Hub; offline it fails with the way out.
    import datasets
    import huggingface_hub.constants

    # The libraries read the offline switches at import time, so set the parsed values.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="Hugging Face Hub .* point data.train / data.val at them"):
        load_rows("nobody-here/no-such-dataset")


def test_verl_rows_render_with_the_chat_template(tokenizer):
    rows, stats = render_rows(VERL_ROWS[:2], tokenizer, system_prompt="Be brief.")
    first = rows[0]
    assert first["prompt_text"] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 0 + 0?"
                                    "<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(first["prompt_ids"]) == first["prompt_text"]
    assert first["prompt_ids"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # a special token, not bytes
    assert first["ground_truth"] == "0" and first["data_source"] == "openai/gsm8k"
    assert first["extra_info"] == {"index": 0} and first["raw"]["ability"] == "math"
    assert first["prompt_messages"][0] == {"role": "system", "content": "Be brief."}
    assert stats.kept == 2 and stats.dropped == 0 and stats.own_system == 0


def test_a_row_with_its_own_system_message_keeps_it_and_is_counted(tokenizer, caplog):
    """data.system_prompt went unused on such rows without a word (verl-format data often carries one)."""
    from verl_data.rows import _report

    own = {**VERL_ROWS[0], "prompt": [{"role": "system", "content": "Answer in French."}, *VERL_ROWS[0]["prompt"]]}
    rows, stats = render_rows([own, VERL_ROWS[1]], tokenizer, system_prompt="Be brief.")
    assert [r["prompt_messages"][0]["content"] for r in rows] == ["Answer in French.", "Be brief."]
    assert stats.own_system == 1
    _report(SimpleNamespace(max_bad_rows=0, max_prompt_length=512, overlong="filter", answer_key="answer"),
            "training", stats)
    assert "data: 1 of 2 training prompts have a system message of their own, kept instead of data.system_prompt" \
        in caplog.text


def test_plain_columns_with_configured_names_and_raw_text(tokenizer):
    rows, _ = render_rows(PLAIN_ROWS, tokenizer, prompt_key="question", answer_key="solution",
                          apply_chat_template=False, data_source="spelling")
    assert [r["prompt_text"] for r in rows] == ["Spell cat.", "Spell dog.", "Spell emu."]
    assert [r["ground_truth"] for r in rows] == ["cat", "dog", "emu"]
    assert {r["data_source"] for r in rows} == {"spelling"}
    with pytest.raises(DataError, match=r"row 0 has no 'prompt' column; columns are \['id', 'question', "
                                         r"'solution'\] \(set data.prompt_key\)"):
        render_rows(PLAIN_ROWS, tokenizer)
    with pytest.raises(DataError, match="must be a string or a list of chat messages"):
        render_rows([{"prompt": 5}], tokenizer)


def test_a_tokenizer_without_chat_template_falls_back_to_raw_text(tokenizer):
    plain = build_byte_tokenizer()
    plain.chat_template = None
    rows, stats = render_rows(VERL_ROWS[:1], plain)
    assert rows[0]["prompt_text"] == "What is 0 + 0?" and stats.raw_text_fallback


def _lengths(rows):
    return [len(r["prompt_ids"]) for r in rows]


def test_overlong_prompts_are_filtered_and_counted(tokenizer):
    rows = [{"prompt": "x" * n} for n in (5, 50, 10, 80)]
    kept, stats = render_rows(rows, tokenizer, apply_chat_template=False, max_prompt_length=20)
    assert _lengths(kept) == [5, 10]
    assert (stats.rows, stats.kept, stats.dropped, stats.truncated) == (4, 2, 2, 0)
    with pytest.raises(DataError, match="no usable prompts .2 of 2 longer than data.max_prompt_length=20"):
        render_rows(rows[1::2], tokenizer, apply_chat_template=False, max_prompt_length=20)
    with pytest.raises(DataError, match="row 1 has a 50-token prompt, longer than data.max_prompt_length=20"):
        render_rows(rows, tokenizer, apply_chat_template=False, max_prompt_length=20, overlong="error")


@pytest.mark.parametrize("mode, expected", [
    ("truncate_left", "KLMNOPQRST"), ("truncate_right", "ABCDEFGHIJ"), ("truncate_middle", "ABCDEPQRST"),
])
def test_overlong_prompts_are_truncated_where_asked(tokenizer, mode, expected):
    rows, stats = render_rows([{"prompt": "ABCDEFGHIJKLMNOPQRST"}, {"prompt": "short"}], tokenizer,
                              apply_chat_template=False, max_prompt_length=10, overlong=mode)
    assert rows[0]["prompt_text"] == expected and tokenizer.decode(rows[0]["prompt_ids"]) == expected
    assert rows[1]["prompt_text"] == "short"
    assert stats.truncated == 1 and stats.dropped == 0


def test_build_datasets_reports_counts(tmp_path, tokenizer, caplog):
    rows = [{"prompt": "x" * n, "answer": "a"} for n in (5, 50, 10)]
    path = _write(rows, tmp_path / "d.jsonl")
    config = DataConfig(train=path, val=path, apply_chat_template=False, max_prompt_length=20, batch_size=1)
    with caplog.at_level("WARNING", logger="verl.data"):
        train, val, stats = build_datasets(config, tokenizer)
    assert len(train) == len(val) == 2
    assert stats["data/train_overlong_dropped"] == 1.0 and stats["data/val_overlong_dropped"] == 1.0
    assert stats["data/train_prompts"] == 2.0
    assert "dropped 1 of 3 training prompts longer than data.max_prompt_length=20" in caplog.text
