"""`verl data prepare`: the GSM8K and MATH samples round-trip into verl-format parquet that the rewards accept."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from verl_cli.cli import add_plugin_commands, app
from verl_data import load_rows, render_rows
from verl_core.testing import build_byte_tokenizer
from verl_data_prepare.prepare import sample_path
from verl_reward_rules import GSM8KReward, MathReward


def _prepare(*args):
    add_plugin_commands(app)  # what `verl` does at start-up: `data` comes from this package's entry point
    result = CliRunner().invoke(app, ["data", "prepare", *map(str, args)])
    return result


def test_verl_has_the_data_prepare_command():
    res = subprocess.run([sys.executable, "-m", "verl_cli", "data", "prepare", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--input" in res.stdout and "--output" in res.stdout and "skipping" not in res.stderr


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_gsm8k_round_trip(tmp_path):
    src = sample_path("gsm8k")
    res = _prepare("gsm8k", "--input", src / "train.jsonl", "--input", src / "test.jsonl", "--output", tmp_path)
    assert res.exit_code == 0, res.output
    assert f"gsm8k train: 30 rows -> {tmp_path / 'train.parquet'}" in res.output
    assert "gsm8k test: 12 rows" in res.output
    originals = _jsonl(src / "train.jsonl")
    rows = load_rows(str(tmp_path / "train.parquet"))
    assert len(rows) == len(originals) == 30
    for original, row in zip(originals, rows):
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["prompt"][0]["content"].startswith(original["question"])
        assert row["prompt"][0]["content"].endswith('output the final answer after "####".')
        final = original["answer"].rsplit("####", 1)[1].strip()
        assert row["reward_model"] == {"style": "rule", "ground_truth": final.replace(",", "")}
        assert row["extra_info"]["answer"] == original["answer"] and row["extra_info"]["split"] == "train"
        # The dataset's own solution scores 1 with the reward that will score the model.
        assert GSM8KReward()(original["answer"], row["reward_model"]["ground_truth"]) == 1.0
    assert any("," in r["answer"].rsplit("####", 1)[1] for r in originals)  # the sample has comma answers
    rendered, stats = render_rows(rows, build_byte_tokenizer())
    assert stats.kept == 30 and rendered[0]["prompt_text"].startswith("<|im_start|>user\n")


def test_math_round_trip_from_files_and_from_the_original_tree(tmp_path):
    src = sample_path("math")
    res = _prepare("math", "--input", src, "--output", tmp_path / "flat")
    assert res.exit_code == 0, res.output
    assert "math train: 24 rows" in res.output and "math test: 8 rows" in res.output
    rows = load_rows(str(tmp_path / "flat" / "test.parquet"))
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    assert "\\frac{5}{2}" in truths and "2\\sqrt{3}" in truths
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[0]["extra_info"]["level"] == "Level 2" and rows[0]["extra_info"]["type"] == "Algebra"
    for row in rows + load_rows(str(tmp_path / "flat" / "train.parquet")):
        assert MathReward()(row["extra_info"]["answer"], row["reward_model"]["ground_truth"]) == 1.0

    # The original Hendrycks layout: <split>/<subject>/<n>.json, one problem per file.
    tree = tmp_path / "MATH"
    for split in ("train", "test"):
        for i, problem in enumerate(_jsonl(src / f"{split}.jsonl")):
            subject = tree / split / problem["type"].lower().replace(" & ", "_")
            subject.mkdir(parents=True, exist_ok=True)
            (subject / f"{i}.json").write_text(json.dumps(problem))
    res = _prepare("math", "--input", tree, "--output", tmp_path / "tree")
    assert res.exit_code == 0, res.output
    from_tree = load_rows(str(tmp_path / "tree" / "test.parquet"))
    assert sorted(r["reward_model"]["ground_truth"] for r in from_tree) == sorted(truths)


def test_rows_without_an_answer_are_skipped_and_counted(tmp_path):
    rows = [{"question": "Q1?", "answer": "So 4.\n#### 4"}, {"question": "Q2?", "answer": "no final line"},
            {"question": "Q3?", "answer": "#### 1,000"}]
    (tmp_path / "my_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = _prepare("gsm8k", "-i", tmp_path / "my_train.jsonl", "-o", tmp_path / "out", "--instruction", "")
    assert res.exit_code == 0, res.output
    assert "train: 2 rows" in res.output and "skipped 1 without an answer (first: train row 1" in res.output
    out = load_rows(str(tmp_path / "out" / "train.parquet"))
    assert [r["prompt"][0]["content"] for r in out] == ["Q1?", "Q3?"]  # no instruction appended
    assert [r["reward_model"]["ground_truth"] for r in out] == ["4", "1000"]


def test_prepare_errors_are_user_errors(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"question": "Q", "answer": "#### 1"}) + "\n")
    res = _prepare("gsm8k", "-i", tmp_path / "rows.jsonl", "-o", tmp_path / "out")
    assert res.exit_code == 2 and "cannot tell its split" in res.output and "--split" in res.output
    res = _prepare("gsm8k", "-i", tmp_path / "rows.jsonl", "-o", tmp_path / "out", "--split", "train")
    assert res.exit_code == 0, res.output
    res = _prepare("math", "-i", tmp_path / "rows.jsonl", "-o", tmp_path / "out", "--split", "train")
    assert res.exit_code == 2 and "no text column 'problem'" in res.output
    res = _prepare("mmlu", "-i", tmp_path / "rows.jsonl", "-o", tmp_path / "out")
    assert res.exit_code == 2 and "unknown dataset 'mmlu'; available: ['geometry3k', 'gsm8k', 'math', 'mbpp']" in res.output


@pytest.mark.parametrize("dataset", ["gsm8k", "math", "mbpp"])
def test_samples_are_shipped_with_the_package(dataset):
    assert (sample_path(dataset) / "train.jsonl").is_file() and (sample_path(dataset) / "test.jsonl").is_file()
