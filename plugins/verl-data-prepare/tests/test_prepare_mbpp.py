"""`verl data prepare mbpp`: MBPP rows (text, code, test_list) -> verl rows whose ground truth code_tests runs."""

import json

import pyarrow.parquet as pq
from typer.testing import CliRunner

from verl_cli.cli import add_plugin_commands, app
from verl_data_prepare.prepare import sample_path


def _prepare(*args):
    add_plugin_commands(app)
    return CliRunner().invoke(app, ["data", "prepare", *map(str, args)])


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_mbpp_round_trip(tmp_path):
    src = sample_path("mbpp")
    res = _prepare("mbpp", "--input", src, "--output", tmp_path)
    assert res.exit_code == 0, res.output
    assert "mbpp train: 8 rows" in res.output and "mbpp test: 4 rows" in res.output
    originals = _jsonl(src / "train.jsonl")
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) == len(originals)
    for original, row in zip(originals, rows):
        assert row["data_source"] == "google-research-datasets/mbpp" and row["ability"] == "code"
        prompt = row["prompt"][0]["content"]
        # The task, its asserts (they name the function) and the request for a fenced block, in that order.
        assert prompt.startswith(original["text"]) and all(t in prompt for t in original["test_list"])
        assert prompt.endswith("\nWrite the Python function in a ```python code block.")
        truth = json.loads(row["reward_model"]["ground_truth"])
        assert truth["test_list"] == original["test_list"]
        assert truth.get("test_setup_code", "") == original["test_setup_code"]
        assert row["extra_info"]["answer"] == original["code"]
        assert row["extra_info"]["task_id"] == str(original["task_id"])
    assert any("test_setup_code" in json.loads(r["reward_model"]["ground_truth"]) for r in rows)


def test_mbpp_sanitized_columns_and_rows_without_tests(tmp_path):
    # The Hub's "sanitized" files call the question "prompt" and carry test_imports.
    rows = [{"task_id": 1, "prompt": "Write a function f returning 1.", "code": "def f():\n    return 1",
             "test_imports": ["import math"], "test_list": ["assert f() == 1"]},
            {"task_id": 2, "prompt": "No tests here.", "code": "pass", "test_imports": [], "test_list": []}]
    (tmp_path / "sanitized-test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = _prepare("mbpp", "-i", tmp_path / "sanitized-test.jsonl", "-o", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "test: 1 rows" in res.output and "skipped 1 without an answer (first: test row 1: no test cases)" in res.output
    (row,) = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert json.loads(row["reward_model"]["ground_truth"]) == {"test_list": ["assert f() == 1"],
                                                               "test_imports": ["import math"]}
    assert row["prompt"][0]["content"].startswith("Write a function f returning 1. Your code should pass")


def test_a_file_that_is_not_mbpp_is_named(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "Q", "answer": "#### 1"}) + "\n")
    res = _prepare("mbpp", "-i", tmp_path / "train.jsonl", "-o", tmp_path / "out")
    assert res.exit_code == 2 and "no text column 'text'" in res.output
