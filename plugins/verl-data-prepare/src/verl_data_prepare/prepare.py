"""``verl data prepare``: convert public datasets' own files into verl-format parquet.

Supported datasets and the files they are distributed as:

* ``gsm8k``: JSON lines (``train.jsonl`` / ``test.jsonl`` of ``openai/grade-school-math``) or parquet (the
  Hub's ``main/train-*.parquet``) with ``question`` and ``answer`` columns, the answer's last line being
  ``#### 42``;
* ``math``: the original Hendrycks MATH tree (``train/<subject>/<n>.json``, one problem per file), or JSON
  lines / JSON / parquet files (``DigitalLearningGmbH/MATH-lighteval``) with ``problem`` and ``solution``
  columns, the answer being the solution's last ``\\boxed{...}``;
* ``geometry3k``: the parquet files of ``hiyouga/geometry3k`` (``data/train-*.parquet``, ...) with
  ``problem`` (the question, ``<image>`` where the diagram goes), ``answer`` and ``images`` (a list of
  ``{"bytes", "path"}`` images) columns; the images are kept in verl's ``images`` column, one
  ``<image>`` placeholder per image (added in front where the problem has fewer);
* ``mbpp``: the JSON lines of ``google-research/mbpp`` (``mbpp.jsonl``, with ``--split``) or the Hub's
  parquet files (``google-research-datasets/mbpp``: ``full/train-*.parquet``, or ``sanitized/...``, whose
  question column is ``prompt``) with ``text``, ``code`` and ``test_list`` columns. The prompt is the
  task, its asserts (which name the function) and a request for a ```` ```python ```` block; the ground
  truth is the JSON string ``{"test_list": [...], "test_setup_code": ..., "test_imports": [...]}`` that
  the ``code_tests`` reward (verl-env-tools) runs the model's program against.

Each input's split comes from its path (a ``train`` or ``test`` part of the name); splits are kept as
given and written to ``<output>/<split>.parquet`` in the verl format, with the same ``data_source`` names
verl's own preprocessing scripts use, so the rewards route the rows the same way::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "<question> Let's think step by step ..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "question": "...", "answer": "..."}}

Rows whose answer cannot be extracted are skipped and counted. The ground truths are taken with the
same extractors the rewards use (:mod:`verl_reward_rules`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from verl_core.kit import DataError
from verl_reward_rules import extract_gsm8k_answer, last_boxed, strip_boxed

__all__ = ["DATASETS", "PrepareResult", "prepare", "sample_path"]

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class DatasetRecipe:
    """How one public dataset becomes verl rows."""

    data_source: str
    instruction: str
    question_key: str
    solution_key: str
    extract: Callable[[str], str | None]
    extra_keys: tuple[str, ...] = ()
    images_key: str = ""
    ability: str = "math"
    # Where the question column may also be called something else (MBPP's sanitized files: "prompt").
    question_alt_key: str = ""
    # The prompt and ground truth from the whole row, where the question and solution alone do not hold them.
    render_question: Callable[[dict[str, Any], str], str] | None = None
    truth_from_row: Callable[[dict[str, Any]], str | None] | None = None


def _math_answer(solution: str) -> str | None:
    boxed = last_boxed(solution)
    return strip_boxed(boxed).strip() if boxed else None


MBPP_INSTRUCTION = "Write the Python function in a ```python code block."


def _mbpp_question(row: dict[str, Any], question: str) -> str:
    tests = "\n".join(str(t) for t in row.get("test_list") or [])
    return f"{question.strip()} Your code should pass these tests:\n\n{tests}\n"


def _mbpp_tests(row: dict[str, Any]) -> str | None:
    """The ``code_tests`` ground truth of an MBPP row (a JSON string), or ``None`` when it has no asserts."""
    tests = [str(t) for t in row.get("test_list") or [] if str(t).strip()]
    if not tests:
        return None
    truth: dict[str, Any] = {"test_list": tests}
    if str(row.get("test_setup_code") or "").strip():
        truth["test_setup_code"] = str(row["test_setup_code"])
    if row.get("test_imports"):
        truth["test_imports"] = [str(i) for i in row["test_imports"]]
    return json.dumps(truth)


DATASETS: dict[str, DatasetRecipe] = {
    "gsm8k": DatasetRecipe("openai/gsm8k", GSM8K_INSTRUCTION, "question", "answer", extract_gsm8k_answer),
    "math": DatasetRecipe("DigitalLearningGmbH/MATH-lighteval", MATH_INSTRUCTION, "problem", "solution",
                          _math_answer, extra_keys=("level", "type")),
    "geometry3k": DatasetRecipe("hiyouga/geometry3k", MATH_INSTRUCTION, "problem", "answer",
                                lambda answer: answer.strip() or None, images_key="images"),
    "mbpp": DatasetRecipe("google-research-datasets/mbpp", MBPP_INSTRUCTION, "text", "code", lambda code: None,
                          extra_keys=("task_id",), ability="code", question_alt_key="prompt",
                          render_question=_mbpp_question, truth_from_row=_mbpp_tests),
}
IMAGE_PLACEHOLDER = "<image>"


@dataclass
class SplitResult:
    """What was written for one split."""

    path: Path
    rows: int
    skipped: int
    first_skipped: str = ""


@dataclass
class PrepareResult:
    """What ``prepare`` wrote, per split."""

    dataset: str
    splits: dict[str, SplitResult] = field(default_factory=dict)


def sample_path(dataset: str) -> Path:
    """The directory of the tiny sample shipped for ``dataset`` (written for tests, same shape as the real files)."""
    return Path(__file__).parent / "datasets_samples" / dataset


# ----------------------------------------------------------------------------- reading
def _split_of(path: Path, root: Path | None) -> str | None:
    parts = path.relative_to(root).parts if root is not None else (path.name,)
    for part in reversed(parts):
        name = part.lower()
        for split in ("train", "test", "validation", "val"):
            if re.search(rf"(^|[^a-z]){split}([^a-z]|$)", name):
                return {"val": "validation"}.get(split, split)
    return None


def _natural_key(path: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def _read_file(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        text = path.read_text(encoding="utf-8")
        if suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read it: {type(exc).__name__}: {exc}") from exc
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if isinstance(data, dict):
        return [data]  # the original MATH layout: one problem per file
    if isinstance(data, list):
        return data
    raise DataError(f"{path}: expected a JSON object or a list of objects, got {type(data).__name__}")


def read_inputs(inputs: Sequence[str | Path], *, split: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Rows per split from files and directories (see the module docstring)."""
    by_split: dict[str, list[dict[str, Any]]] = {}
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _SUFFIXES),
                           key=_natural_key)
            root: Path | None = path
        elif path.is_file():
            if path.suffix.lower() not in _SUFFIXES:
                raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json or .parquet")
            files, root = [path], None
        else:
            raise DataError(f"--input {str(item)!r} does not exist")
        if not files:
            raise DataError(f"--input {str(item)!r} holds no .jsonl, .json or .parquet files")
        for f in files:
            name = split or _split_of(f, root)
            if name is None:
                raise DataError(f"{f}: cannot tell its split from its path (no 'train' or 'test' in the name); "
                                f"pass --split")
            by_split.setdefault(name, []).extend(_read_file(f))
    return by_split


# ----------------------------------------------------------------------------- converting
def convert_rows(rows: Iterable[dict[str, Any]], recipe: DatasetRecipe, *, split: str, instruction: str | None = None,
                 data_source: str | None = None) -> tuple[list[dict[str, Any]], int, str]:
    """verl rows from the dataset's own rows; returns ``(rows, skipped, first_skipped_description)``."""
    instruction = recipe.instruction if instruction is None else instruction
    out: list[dict[str, Any]] = []
    skipped, first = 0, ""
    for i, row in enumerate(rows):
        question_key = recipe.question_key
        if recipe.question_alt_key and question_key not in row and recipe.question_alt_key in row:
            question_key = recipe.question_alt_key
        question, solution = row.get(question_key), row.get(recipe.solution_key)
        if not isinstance(question, str) or not isinstance(solution, str):
            missing = [k for k in (question_key, recipe.solution_key) if not isinstance(row.get(k), str)]
            raise DataError(f"{split} row {i} has no text column {missing[0]!r}; columns are {sorted(row)} "
                            f"(is this the right dataset?)")
        truth = recipe.truth_from_row(row) if recipe.truth_from_row else recipe.extract(solution)
        if truth is None:
            skipped += 1
            what = "test cases" if recipe.truth_from_row else f"answer in {solution[-80:]!r}"
            first = first or f"{split} row {i}: no {what}"
            continue
        text = recipe.render_question(row, question) if recipe.render_question else question
        sep = "" if text.endswith("\n") else " "
        content = f"{text}{sep}{instruction}" if instruction else text
        extra = {"split": split, "index": i, "question": question, "answer": solution}
        extra.update({k: str(row.get(k, "")) for k in recipe.extra_keys})
        images: dict[str, Any] = {}
        if recipe.images_key:
            value = row.get(recipe.images_key)
            if not isinstance(value, (list, tuple)) or not value:
                raise DataError(f"{split} row {i} has no images in column {recipe.images_key!r} (a list of "
                                f"{{'bytes', 'path'}} images); columns are {sorted(row)}")
            missing = len(value) - content.count(IMAGE_PLACEHOLDER)
            content = IMAGE_PLACEHOLDER * max(0, missing) + content
            images = {"images": [_image_entry(v, split, i) for v in value]}
        out.append({
            "data_source": data_source or recipe.data_source,
            "prompt": [{"role": "user", "content": content}],
            "ability": recipe.ability,
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": extra,
            **images,
        })
    return out, skipped, first


def _image_entry(value: Any, split: str, index: int) -> dict[str, Any]:
    """One image as Hugging Face datasets stores it (``{"bytes", "path"}``), which verl reads."""
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        return {"bytes": value.get("bytes"), "path": value.get("path")}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value), "path": None}
    if isinstance(value, str) and value:
        return {"bytes": None, "path": value}
    raise DataError(f"{split} row {index}: an image must be {{'bytes', 'path'}}, bytes or a path, got "
                    f"{type(value).__name__}")


def prepare(dataset: str, inputs: Sequence[str | Path], output: str | Path, *, split: str | None = None,
            instruction: str | None = None, data_source: str | None = None) -> PrepareResult:
    """Convert ``inputs`` of ``dataset`` to ``<output>/<split>.parquet``.

    Args:
        dataset: a key of :data:`DATASETS` (``gsm8k``, ``math``, ``geometry3k``, ``mbpp``).
        inputs: files or directories of the dataset's own files.
        output: the output directory (created).
        split: the split of every input (default: read from each file's path).
        instruction: text appended to each question (default: the dataset's usual instruction; ``""``: none).
        data_source: the rows' ``data_source`` (default: the name verl's own scripts use).

    Raises:
        DataError: unknown dataset, unreadable or unsplittable inputs, rows without the expected columns,
            or a split in which no row had an answer.
    """
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset {dataset!r}; available: {sorted(DATASETS)}")
    recipe = DATASETS[dataset]
    by_split = read_inputs(inputs, split=split)
    out_dir = Path(output).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    result = PrepareResult(dataset)
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, rows in sorted(by_split.items()):
        converted, skipped, first = convert_rows(rows, recipe, split=name, instruction=instruction,
                                                 data_source=data_source)
        if not converted:
            raise DataError(f"{dataset}: none of the {len(rows)} {name} rows has an answer ({first})")
        path = out_dir / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(converted), path)
        result.splits[name] = SplitResult(path, len(converted), skipped, first)
    return result
