"""Prompt data: loading rows and rendering prompts to token ids (the ``standard`` data reader's work).

Rows are read from a parquet / jsonl / json file (with ``pyarrow`` / the ``json`` module), or with
the ``datasets`` library from a local Hugging Face dataset directory (``save_to_disk`` output, or a
folder of data files such as a cloned Hub repository) or a Hub dataset id where a network exists.
Two shapes are understood:

* the verl format, as is: ``data_source``, ``prompt`` (a chat message list), ``ability``,
  ``reward_model`` (``{"style": "rule", "ground_truth": ...}``) and ``extra_info``;
* plain text columns: a prompt string and an answer, with the column names set by ``data.prompt_key``
  and ``data.answer_key`` (``data.data_source`` then names the rows' source).

Each loaded row becomes a dict with ``prompt_ids``, ``prompt_text``, ``prompt_messages``,
``ground_truth``, ``data_source``, ``extra_info`` and ``raw`` (every column of the original row).
Prompts are rendered with the tokenizer's chat template (or kept as raw text), and prompts longer than
``data.max_prompt_length`` are dropped and counted, truncated, or refused, as ``data.overlong`` says.
Rows that cannot be used at all (a jsonl line that is not UTF-8 or not JSON, no prompt column, a
malformed prompt, a prompt over the limit with ``overlong="error"``, a corrupt or oversized image) stop
the run, naming the row, or with ``data.max_bad_rows = N`` up to N of them per source are skipped and
counted (``data/<split>_bad_rows``).

Rows with images (``data.image_key``, ``<image>`` placeholders or ``{"type": "image"}`` content parts)
are rendered by the model's image-text processor (:mod:`verl_data.images`); their ``prompt_ids`` is a
:class:`~verl_core.contracts.PromptIds` carrying the images. A model without one refuses them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from verl_core.config import GENERATED_DATA, HUB_ID
from verl_core.contracts import DataError

__all__ = ["load_rows", "check_data_source", "generated_provider", "tokenize_rows", "render_rows", "build_datasets",
           "PromptStats", "DataError", "OVERLONG_MODES"]

logger = logging.getLogger("verl.data")

OVERLONG_MODES = ("filter", "truncate_left", "truncate_right", "truncate_middle", "error")


# ----------------------------------------------------------------------------- loading
def load_rows(spec: str, *, split: str = "train", seed: int = 0, registry: Any = None,
              format: str = "prompts", bad: list[str] | None = None, size: int = 0,
              val_size: int = 0) -> list[dict[str, Any]]:
    """Raw rows (plain dicts) from a ``builtin:`` or generated dataset, a file, a dataset directory or a Hub id.

    Args:
        spec: what to load (see the module docstring); ``builtin:<name>`` is built by the
            ``verl.datasets`` plugin of that name (``builtin:addition``: ``verl-task-arithmetic``), and
            ``<name>:<argument>`` by the one that takes an argument (:func:`generated_provider`).
        split: the split to take from sources that hold several (dataset directories, Hub ids,
            ``builtin:`` datasets); a single file is one split already.
        seed: unused; kept for callers that pass it.
        registry: the plugin registry ``builtin:`` datasets are found in (a fresh one by default).
        format: the rows a ``builtin:`` dataset is asked for (:attr:`~verl_core.contracts.Requirements.data`);
            other sources are read as they are.
        bad: where a json/jsonl file's unreadable lines (not UTF-8, not JSON, not an object) are noted
            and skipped; ``None`` raises at the first.
        size, val_size: rows a generated dataset makes (``data.size`` / ``data.val_size``; 0: its default).

    Raises:
        DataError: the source does not exist, has an unsupported type, or lacks the split or the format.
        UnknownPluginError: no ``verl.datasets`` plugin provides the ``builtin:`` name.
    """
    provider = generated_provider(spec, size=size, val_size=val_size, registry=registry)
    if spec.startswith("builtin:"):
        from verl_core.registry import PluginRegistry, load_builtin

        provider = load_builtin(registry or PluginRegistry(), "dataset", spec, key="data")
    if provider is not None:
        formats = getattr(provider, "formats", ("prompts",))
        if format not in formats:
            raise DataError(f"data.train: the algorithm trains on {format!r} rows, and {spec} builds only "
                            f"{', '.join(map(repr, formats))}; point data.train at data with {format} (see "
                            f"verl_core.contracts.Requirements.data for their columns)")
        asked = {} if format == "prompts" else {"format": format}  # providers of prompts alone take no format
        try:
            return list(provider.rows(split=split, **asked))
        except ValueError as exc:
            raise DataError(f"{spec}: {exc}") from exc
    path = Path(spec).expanduser()
    if path.is_file():
        return _read_file(path, spec, bad)
    check_data_source(spec)
    from datasets.utils import logging as ds_logging

    # "Generating train split" bars for every small file are noise in a training log.
    bars = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        return _load_with_datasets(path, spec, split)
    finally:
        if bars:
            ds_logging.enable_progress_bar()


def check_data_source(spec: str, key: str = "", registry: Any = None) -> None:
    """Raise :class:`DataError` (naming ``key``) when ``spec`` is a local path that does not exist.

    Cheap, so the trainer calls it before anything loads; ``builtin:`` names and Hub ids pass, and a
    generated dataset's argument is checked by its provider (:func:`generated_provider`).
    """
    if generated_provider(spec, key=key or "data.train", registry=registry):
        return
    if not spec or spec.startswith("builtin:") or Path(spec).expanduser().exists() or HUB_ID.match(spec):
        return
    raise DataError(f"{key + ': ' if key else ''}data file {spec!r} does not exist (use a parquet/jsonl/json file, "
                    f"a dataset directory, a Hugging Face Hub id, or a builtin: dataset such as builtin:addition)")


def generated_provider(spec: str, *, size: int = 0, val_size: int = 0, registry: Any = None,
                       key: str = "data.train") -> Any:
    """The :class:`~verl_core.contracts.DatasetProvider` a ``<name>:<argument>`` spec names (``None`` for other
    specs), built by its ``from_spec``, which checks the argument without making rows.

    Raises:
        UnknownPluginError: no ``verl.datasets`` provider ``<name>`` is installed (the message lists them).
        DataError: the provider takes no argument, or refuses this one (naming ``key`` and the fix).
    """
    from verl_core.registry import PluginRegistry, UnknownPluginError

    if not (match := GENERATED_DATA.match(spec)):
        return None
    name, argument = match.groups()
    try:
        cls = (registry or PluginRegistry()).load("dataset", name)
    except UnknownPluginError as exc:
        exc.args = (f"{key}: {spec!r} is '<provider>:<argument>' data, and {exc} (a file or a Hub id is written "
                    f"without a 'name:' in front)",)
        raise
    if not getattr(cls, "argument", ""):
        raise DataError(f"{key}: the dataset {name!r} takes no argument; use {key} = 'builtin:{name}'")
    try:
        return cls.from_spec(argument, size=size, val_size=val_size)
    except ValueError as exc:
        raise DataError(f"{key}: {spec!r}: {exc}") from exc


def _read_file(path: Path, spec: str, bad: list[str] | None = None) -> list[dict[str, Any]]:
    """One parquet / jsonl / json file, read without the ``datasets`` library.

    A file is read whole into dicts anyway, and importing ``datasets`` (with ``pyarrow``) would add
    ~80 MB to every training process that only reads a jsonl file; parquet needs ``pyarrow`` alone.
    Like a table, every row gets every column: a key missing from some rows is ``None`` there.
    """
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DataError(f"{spec}: cannot read it as parquet: {type(exc).__name__}: {exc}") from exc
    if suffix not in (".jsonl", ".json"):
        raise DataError(f"{spec}: unsupported file type {suffix!r}; use .parquet, .jsonl or .json")
    import json

    def skip(message: str) -> None:
        if bad is None:
            raise DataError(f"{spec}: {message} (set data.max_bad_rows to skip such rows)")
        bad.append(message)

    data = path.read_bytes()
    if suffix == ".json" and data.lstrip().startswith(b"["):
        try:
            rows = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"{spec}: not valid JSON ({exc}); a .json file holds a list of row objects or one "
                            f"object per line") from exc
        numbered = [(f"row {i}", r) for i, r in enumerate(rows, 1)]
    else:  # JSON lines (a .json file may hold them too), each decoded alone so one bad line costs one row
        numbered = []
        for number, raw in enumerate(data.splitlines(), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                skip(f"line {number} is not UTF-8 text ({exc})")
                continue
            if line.strip():
                try:
                    numbered.append((f"line {number}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    skip(f"line {number} is not valid JSON ({exc}); each line holds one row object")
    rows = []
    for where, r in numbered:
        if isinstance(r, dict):
            rows.append(r)
        else:
            skip(f"{where} is not a JSON object; every row must be one, e.g. {{\"prompt\": ..., \"answer\": ...}}")
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k) for k in columns} for r in rows]


def _load_with_datasets(path: Path, spec: str, split: str) -> list[dict[str, Any]]:
    if path.is_dir():
        ds = _load_directory(path, split, spec)
    else:
        import datasets

        try:
            ds = datasets.load_dataset(spec, split=split)
        except Exception as exc:  # noqa: BLE001 - offline, unknown id, missing split, ...
            raise DataError(f"{spec!r} is not a local file or directory, and loading it from the Hugging Face Hub "
                            f"(split {split!r}) failed: {type(exc).__name__}: {exc}. Without a network, download "
                            f"the files elsewhere and point data.train / data.val at them") from exc
    return [dict(r) for r in ds]


def _load_directory(path: Path, split: str, spec: str) -> Any:
    import datasets

    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise _no_split(spec, split, ds)
            ds = ds[split]
        return ds
    # A folder of data files, e.g. a Hub repository cloned or downloaded by hand.
    try:
        loaded = datasets.load_dataset(str(path))
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{spec}: not a dataset directory (no save_to_disk files, and no readable data files): "
                        f"{type(exc).__name__}: {exc}") from exc
    if split not in loaded:
        if len(loaded) == 1 and split == "train":
            return next(iter(loaded.values()))
        raise _no_split(spec, split, loaded)
    return loaded[split]


def _no_split(spec: str, split: str, splits: Any) -> DataError:
    return DataError(f"{spec}: no {split!r} split; splits are {list(splits)} (set data.train_split / data.val_split)")


# ----------------------------------------------------------------------------- rendering
@dataclass
class PromptStats:
    """What happened to the rows of one source while rendering.

    Attributes:
        rows: rows read.
        kept: rows that became prompts.
        dropped: rows dropped for being longer than ``data.max_prompt_length`` (``overlong="filter"``).
        truncated: prompts cut to ``data.max_prompt_length`` (``overlong="truncate_*"``).
        missing_ground_truth: kept rows with neither ``reward_model.ground_truth`` nor an answer column.
        raw_text_fallback: chat template asked for, but the tokenizer has none (raw text used).
        own_system: rows that kept their own system message instead of ``data.system_prompt``.
        bad: rows skipped as unusable (``data.max_bad_rows``), unreadable lines included.
        bad_examples: what was wrong with the first few of them.
    """

    rows: int = 0
    kept: int = 0
    dropped: int = 0
    truncated: int = 0
    missing_ground_truth: int = 0
    raw_text_fallback: bool = False
    own_system: int = 0
    bad: int = 0
    bad_examples: list[str] = field(default_factory=list)

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"data/{prefix}_prompts": float(self.kept), f"data/{prefix}_overlong_dropped": float(self.dropped),
                f"data/{prefix}_overlong_truncated": float(self.truncated), f"data/{prefix}_bad_rows": float(self.bad)}

    def skip_bad(self, message: str, *, source: str, limit: int) -> None:
        """Count a bad row, or raise :class:`DataError` when it is one more than ``limit`` allows."""
        if limit == 0:
            raise DataError(f"{source}: {message} (set data.max_bad_rows to skip such rows)")
        self.bad += 1
        if len(self.bad_examples) < 3:
            self.bad_examples.append(message)
        if self.bad > limit:
            raise DataError(f"{source}: more than data.max_bad_rows={limit} bad rows; the first: "
                            f"{'; '.join(self.bad_examples)}. Fix the data, or raise data.max_bad_rows")


def _ground_truth(row: dict[str, Any], answer_key: str) -> Any:
    rm = row.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") is not None:
        return rm["ground_truth"]
    return row.get(answer_key)


def _messages(prompt: Any, *, source: str, index: int, prompt_key: str, system_prompt: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in prompt):
        # Content parts (text and images) stay a list; anything else is text.
        messages = [{"role": str(m.get("role") or "user"),
                     "content": list(m["content"]) if isinstance(m["content"], (list, tuple)) else str(m["content"])}
                    for m in prompt]
    else:
        raise DataError(f"{source}: row {index}: column {prompt_key!r} must be a string or a list of chat messages "
                        f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}: {str(prompt)[:80]!r}")
    if not messages:
        raise DataError(f"{source}: row {index}: column {prompt_key!r} is an empty message list")
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def _cut(ids: list[int], limit: int, mode: str) -> list[int]:
    if mode == "truncate_left":  # keep the end: the question and the generation prompt
        return ids[-limit:]
    if mode == "truncate_right":
        return ids[:limit]
    head = limit // 2
    return ids[:head] + ids[len(ids) - (limit - head):]


def render_rows(rows: Sequence[dict[str, Any]], tokenizer: Any, *, prompt_key: str = "prompt",
                answer_key: str = "answer", max_prompt_length: int = 512, overlong: str = "filter",
                apply_chat_template: bool = True, source: str = "data", system_prompt: str = "",
                data_source: str = "", max_bad_rows: int = 0, bad: Sequence[str] = (), processor: Any = None,
                image_key: str = "images", max_image_pixels: int = 0) -> tuple[list[dict[str, Any]], PromptStats]:
    """Render and tokenize prompts (see the module docstring). Returns ``(rows, stats)``.

    ``max_bad_rows`` rows that lack the prompt column, have a malformed prompt or (with
    ``overlong="error"``) a prompt that is too long are skipped and counted; ``bad`` are the
    unreadable lines the loader already skipped, counted against the same limit.

    Rows with images need ``processor`` (:func:`verl_data.images.load_processor`); a corrupt
    image, or one of more than ``max_image_pixels`` pixels, makes a bad row. A prompt with images
    that is too long is dropped (``overlong="filter"`` or a truncation: cutting would cut images) or
    a bad row (``"error"``).

    Raises:
        DataError: a bad row past ``max_bad_rows``, a row with images and no ``processor``, or no row is left.
    """
    if overlong not in OVERLONG_MODES:
        raise DataError(f"data.overlong={overlong!r}: use one of {list(OVERLONG_MODES)}")
    stats = PromptStats(rows=len(rows) + len(bad))
    for message in bad:
        stats.skip_bad(message, source=source, limit=max_bad_rows)
    use_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
    stats.raw_text_fallback = apply_chat_template and not use_template
    texts: list[str] = []
    all_messages: list[list[dict[str, str]]] = []
    usable: list[dict[str, Any]] = []
    with_images: dict[int, Any] = {}  # index in texts -> the PromptIds the processor made
    for i, row in enumerate(rows):
        if prompt_key not in row or row[prompt_key] is None:
            stats.skip_bad(f"row {i} has no {prompt_key!r} column; columns are "
                           f"{sorted(k for k, v in row.items() if v is not None)} (set data.prompt_key)",
                           source=source, limit=max_bad_rows)
            continue
        prompt = row[prompt_key]
        try:
            messages = _messages(prompt, source=source, index=i, prompt_key=prompt_key, system_prompt=system_prompt)
        except DataError as exc:
            stats.skip_bad(str(exc).removeprefix(f"{source}: "), source=source, limit=max_bad_rows)
            continue
        images = _images_of(row, i, messages, processor=processor, image_key=image_key, source=source,
                            max_image_pixels=max_image_pixels, stats=stats, limit=max_bad_rows)
        if images is None:
            continue
        stats.own_system += bool(system_prompt) and messages[0]["content"] != system_prompt  # a row kept
        if images[0] is not None:
            messages, with_images[len(texts)], text = images
        elif use_template:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        elif isinstance(prompt, str) and not system_prompt:
            text = prompt
        else:
            text = "\n".join(m["content"] for m in messages)
        texts.append(text)
        all_messages.append(messages)
        usable.append(row)
    # Chat templates write the special tokens themselves; raw text gets the tokenizer's own (e.g. BOS).
    encoded = tokenizer(texts, add_special_tokens=not use_template)["input_ids"] if texts else []
    out = _fitted_rows(usable, texts, all_messages, encoded, with_images, tokenizer, stats,
                       max_prompt_length=max_prompt_length, overlong=overlong, answer_key=answer_key,
                       data_source=data_source, source=source, max_bad_rows=max_bad_rows)
    stats.kept = len(out)
    if not stats.rows:
        what = "the file has no rows" if Path(source).expanduser().is_file() else "it has no rows"
        raise DataError(f"{source}: {what}; it needs one row per prompt, e.g. a jsonl line "
                        f"{{\"{prompt_key}\": \"What is 2+3?\", \"{answer_key}\": \"5\"}}")
    if not out:
        raise DataError(f"{source}: no usable prompts ({stats.dropped} of {stats.rows} longer than "
                        f"data.max_prompt_length={max_prompt_length}, {stats.bad} bad; raise it or set "
                        f"data.overlong='truncate_left')")
    return out, stats


def _fitted_rows(usable: list[dict[str, Any]], texts: list[str], all_messages: list[Any], encoded: list[Any],
                 with_images: dict[int, Any], tokenizer: Any, stats: PromptStats, *, max_prompt_length: int,
                 overlong: str, answer_key: str, data_source: str, source: str, max_bad_rows: int,
                 ) -> list[dict[str, Any]]:
    """The rendered rows in the verl row format, each prompt fitted to ``max_prompt_length`` as ``overlong``
    says (dropped, cut or a bad row), counted in ``stats``."""
    out: list[dict[str, Any]] = []
    for i, (row, text, messages, ids) in enumerate(zip(usable, texts, all_messages, encoded)):
        ids = with_images.get(i) or list(ids)
        if len(ids) > max_prompt_length:
            if overlong != "error" and i in with_images:
                stats.dropped += 1  # truncating would cut image tokens off their image
                continue
            if overlong == "error":
                stats.skip_bad(f"row {i} has a {len(ids)}-token prompt, longer than data.max_prompt_length="
                               f"{max_prompt_length} (raise it, or set data.overlong to 'filter' or 'truncate_left')",
                               source=source, limit=max_bad_rows)
                continue
            if overlong == "filter":
                stats.dropped += 1
                continue
            ids = _cut(ids, max_prompt_length, overlong)
            text = tokenizer.decode(ids, skip_special_tokens=False)
            stats.truncated += 1
        truth = _ground_truth(row, answer_key)
        if truth is None:
            stats.missing_ground_truth += 1
        out.append({"prompt_ids": ids, "prompt_text": text, "prompt_messages": messages, "ground_truth": truth,
                    "data_source": row.get("data_source") or data_source or "default",
                    "extra_info": row.get("extra_info") or {},
                    "raw": row})  # everything else the row carries (preference pairs, images, tools, ...)
    return out


def _images_of(row: dict[str, Any], index: int, messages: list[dict[str, Any]], *, processor: Any, image_key: str,
               source: str, max_image_pixels: int, stats: PromptStats, limit: int) -> Any:
    """For a row with images: ``(messages with image parts, PromptIds, rendered text)``; ``(None,)`` for a
    text-only row; ``None`` for a bad row that was skipped and counted."""
    from verl_data import images as mm

    raw = mm.row_images(row, image_key)
    parts, placeholders = mm.image_messages(messages)
    if not raw and not placeholders:
        return (None,)
    if processor is None:
        raise DataError(f"{source}: row {index} has {len(raw)} images, and the model has no image processor and "
                        f"vision tower (preprocessor_config.json and a vision_config); use a vision-language model "
                        f"(e.g. builtin:tiny-qwen2-vl), or drop the {image_key!r} column for a text-only run")
    base = Path(source).expanduser().parent if Path(source).expanduser().is_file() else None
    try:
        images = [mm.decode_image(v, max_pixels=max_image_pixels or mm.DEFAULT_MAX_IMAGE_PIXELS, base_dir=base)
                  for v in raw]
        prompt, text = processor.encode(parts, images)
    except ValueError as exc:
        stats.skip_bad(f"row {index}: {exc}", source=source, limit=limit)
        return None
    return parts, prompt, text


def tokenize_rows(rows: Sequence[dict[str, Any]], tokenizer: Any, *, prompt_key: str, answer_key: str,
                  max_prompt_length: int, overlong: str, apply_chat_template: bool, source: str,
                  system_prompt: str = "", data_source: str = "") -> tuple[list[dict[str, Any]], int]:
    """:func:`render_rows` returning ``(rows, dropped)``, the older form."""
    out, stats = render_rows(rows, tokenizer, prompt_key=prompt_key, answer_key=answer_key,
                             max_prompt_length=max_prompt_length, overlong=overlong,
                             apply_chat_template=apply_chat_template, source=source, system_prompt=system_prompt,
                             data_source=data_source)
    return out, stats.dropped


def build_datasets(config: Any, tokenizer: Any, registry: Any = None, *, format: str = "prompts", processor: Any = None,
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, float]]:
    """Training and validation prompts from a :class:`~verl_core.config.DataConfig`.

    ``format`` is the algorithm's :attr:`~verl_core.contracts.Requirements.data`, asked of a ``builtin:``
    training set (validation always generates from prompts); ``processor`` renders rows with images
    (:func:`verl_data.images.load_processor`). Returns ``(train_rows, val_rows, stats)``;
    ``stats`` holds ``data/...`` counts for the metrics. Dropped and truncated prompts are also reported
    on the ``verl.data`` logger.
    """
    limit = getattr(config, "max_bad_rows", 0)
    common = dict(prompt_key=config.prompt_key, answer_key=config.answer_key,
                  max_prompt_length=config.max_prompt_length, overlong=config.overlong,
                  apply_chat_template=config.apply_chat_template, system_prompt=config.system_prompt,
                  data_source=config.data_source, max_bad_rows=limit, processor=processor,
                  image_key=config.image_key, max_image_pixels=config.max_image_pixels)
    unreadable: list[str] | None = [] if limit else None
    sizes = dict(size=config.size, val_size=config.val_size, registry=registry)
    train_rows = load_rows(config.train, split=config.train_split, format=format, bad=unreadable, **sizes)
    train, train_stats = render_rows(train_rows, tokenizer, source=config.train, bad=unreadable or (), **common)
    stats = train_stats.metrics("train")
    _report(config, "training", train_stats)
    generated = config.train.startswith("builtin:") or GENERATED_DATA.match(config.train)
    val_spec = config.val or (config.train if generated else "")
    val: list[dict[str, Any]] = []
    if val_spec:
        unreadable = [] if limit else None
        val_rows = load_rows(val_spec, split=config.val_split, bad=unreadable, **sizes)
        val, val_stats = render_rows(val_rows, tokenizer, source=val_spec, bad=unreadable or (), **common)
        _report(config, "validation", val_stats)
        if config.max_val_samples:
            val = val[: config.max_val_samples]
        stats.update(val_stats.metrics("val"))
        stats["data/val_prompts"] = float(len(val))
    return train, val, stats


def _report(config: Any, what: str, stats: PromptStats) -> None:
    if stats.bad:
        logger.warning("data: skipped %d bad %s rows of %d (data.max_bad_rows=%d), e.g. %s", stats.bad, what,
                       stats.rows, config.max_bad_rows, "; ".join(stats.bad_examples))
    if stats.dropped:
        logger.warning("data: dropped %d of %d %s prompts longer than data.max_prompt_length=%d "
                       "(data.overlong='filter')", stats.dropped, stats.rows, what, config.max_prompt_length)
    if stats.truncated:
        logger.warning("data: truncated %d of %d %s prompts to data.max_prompt_length=%d (data.overlong=%r)",
                       stats.truncated, stats.rows, what, config.max_prompt_length, config.overlong)
    if stats.own_system:
        logger.warning("data: %d of %d %s prompts have a system message of their own, kept instead of "
                       "data.system_prompt", stats.own_system, stats.rows, what)
    if stats.raw_text_fallback:
        logger.warning("data: the tokenizer has no chat template; %s prompts are used as raw text "
                       "(set data.apply_chat_template=false to say so)", what)
    if stats.missing_ground_truth:
        logger.warning("data: %d %s rows have no reward_model.ground_truth and no %r column (set data.answer_key "
                       "if the answer is in another column)", stats.missing_ground_truth, what, config.answer_key)
