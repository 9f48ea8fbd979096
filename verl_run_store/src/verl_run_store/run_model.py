"""The run directory's own copy of the models it trains (issue 31): a run outlives its model directory.

A run writes ``<run_dir>/model/`` (and ``critic_model/`` for a critic of its own) once, when it starts:
the model's ``config.json``, generation config and initial weights (hard links to the model directory's
files where the filesystem allows, copies otherwise; ``save_pretrained`` for a model given as an object)
and the run's tokenizer with its chat template (``save_pretrained`` of the loaded tokenizer). A
``builtin:`` model needs none: its plugin rebuilds it into the cache from the name alone.
``Trainer.from_checkpoint`` and ``verl export`` use the copy, so both work after the model directory is
gone, and the resume check (:mod:`verl_run_store.rundir`) reads the copy as the model it was made from.

``verl_model.json`` in a copy records the config entries it stands for and the model's fingerprint
(architecture from ``config.json``, parameter names and shapes from the safetensors headers, a tokenizer
hash); a resume compares the model it is given with it before any weights load (:func:`check_same_model`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Any

from verl_core.contracts import ConfigError

__all__ = ["MODEL_COPY", "CRITIC_COPY", "write_run_models", "copy_overrides", "copied_keys", "stands_for",
           "stand_in", "check_same_model", "fingerprint"]

logger = logging.getLogger(__name__)

MODEL_COPY = "model"
CRITIC_COPY = "critic_model"
RECORD = "verl_model.json"
#: The ``[model]`` keys each copy can stand for.
COPY_OF = {"path": MODEL_COPY, "tokenizer": MODEL_COPY, "critic_path": CRITIC_COPY}
#: The ``config.json`` entries that say which architecture a model is.
ARCHITECTURE_KEYS = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings")


def _copyable(source: str) -> bool:
    """A local model directory (a ``builtin:`` name, an object entry or a Hub id is not)."""
    return bool(source) and Path(source).expanduser().is_dir()


def _link_tree(source: Path, target: Path) -> None:
    """Hard-link ``source``'s files into ``target`` (copies across filesystems), keeping what is there already."""
    for root, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        here = target / Path(root).relative_to(source)
        here.mkdir(parents=True, exist_ok=True)
        for name in files:
            dest = here / name
            if name.startswith(".") or dest.exists():
                continue
            real = os.path.realpath(Path(root) / name)  # a Hub cache's files are links to its blobs
            try:
                os.link(real, dest)
            except OSError:
                shutil.copy2(real, dest)


def _write_copy(target: Path, sources: dict[str, str], *, path: str, module: Any, tokenizer: Any) -> None:
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if tokenizer is not None:  # first: the model directory's own tokenizer files are not linked over it
        tokenizer.save_pretrained(str(tmp))
    if module is not None:
        module.save_pretrained(str(tmp))
    else:
        _link_tree(Path(path).expanduser(), tmp)
    record = {"sources": sources, "fingerprint": fingerprint(str(tmp), None, tokenizer)}
    (tmp / RECORD).write_text(json.dumps(record, indent=1))
    os.replace(tmp, target)


def write_run_models(run_dir: Path, model_config: Any, *, model: Any, tokenizer: Any, critic: Any) -> None:
    """Write the run's copies (see the module docstring) that it does not hold already (from an earlier segment).

    ``model_config`` is the run's ``[model]`` section; ``model``/``critic`` the objects it was given (or
    None). A critic without an object or ``critic_path`` of its own starts from the actor's model copy.
    """
    target = run_dir / MODEL_COPY
    if not (target / RECORD).is_file() and (model is not None or _copyable(model_config.path)):
        sources = {"model.path": model_config.path}
        if model_config.tokenizer:
            sources["model.tokenizer"] = model_config.tokenizer
        _write_copy(target, sources, path=model_config.path, module=model, tokenizer=tokenizer)
    target = run_dir / CRITIC_COPY
    if not (target / RECORD).is_file() and (critic is not None or _copyable(model_config.critic_path)):
        _write_copy(target, {"model.critic_path": model_config.critic_path}, path=model_config.critic_path,
                    module=critic, tokenizer=None)


def _record(run_dir: Path, copy: str) -> dict[str, Any]:
    try:
        return json.loads((run_dir / copy / RECORD).read_text())
    except (OSError, ValueError):
        return {}


def copied_keys(run_dir: Path, saved_model: dict[str, Any]) -> set[str]:
    """The ``[model]`` keys of the saved config that the run's copies stand for (as recorded when written)."""
    return {key for key, copy in COPY_OF.items() if saved_model.get(key)
            and _record(run_dir, copy).get("sources", {}).get(f"model.{key}") == saved_model[key]}


def copy_overrides(run_dir: Path, saved_model: dict[str, Any], *, given: set[str] = frozenset()) -> list[str]:
    """``model.<key>=<run_dir>/<copy>`` for each saved entry a copy stands for, but the keys in ``given``."""
    return [f"model.{key}={json.dumps(str(run_dir / COPY_OF[key]))}"
            for key in sorted(copied_keys(run_dir, saved_model) - set(given))]


def stands_for(run_dir: Path, key: str, saved: Any, new: Any) -> bool:
    """Whether ``new`` is the run's copy made from ``saved`` (the config entry ``key``, e.g. ``model.path``)."""
    copy = COPY_OF.get(key.removeprefix("model.")) if key.startswith("model.") else None
    if copy is None or not isinstance(new, str) or not new:
        return False
    here = run_dir / copy
    return (Path(new).expanduser().resolve() == here.resolve() and here.is_dir()
            and _record(run_dir, copy).get("sources", {}).get(key) == saved)


def stand_in(run_dir: Path, key: str, value: str, *, note: bool = True) -> str:
    """``value`` (the config entry ``key``), or the run's copy of it when it names a directory that is gone.

    So the same ``verl run`` (or script) run again continues after its model directory was deleted.
    """
    copy = run_dir / COPY_OF.get(key.removeprefix("model."), MODEL_COPY)
    if value and not Path(value).expanduser().exists() and stands_for(run_dir, key, value, str(copy)):
        if note:
            logger.warning("%s %r is gone; using the run's copy of it in %s", key, value, copy)
        return str(copy)
    return value


# ----------------------------------------------------------------------------- the model check
def _safetensors_shapes(path: Path) -> dict[str, list[int]] | None:
    """Parameter names and shapes from the headers of a directory's ``*.safetensors`` (no weights read)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for file in files:
        with open(file, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        shapes.update({k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def tokenizer_hash(tokenizer: Any) -> str | None:
    """A hash of the vocabulary and chat template (not of files: two spellings of one tokenizer hash alike)."""
    if tokenizer is None:
        return None
    content = {"vocab": sorted(tokenizer.get_vocab().items()),
               "chat_template": getattr(tokenizer, "chat_template", None)}
    return hashlib.sha256(json.dumps(content, default=str).encode()).hexdigest()[:16]


def fingerprint(path: str, module: Any, tokenizer: Any) -> dict[str, Any]:
    """Architecture, parameter shapes (None when unknown) and tokenizer hash of a directory or a loaded module."""
    if module is not None:
        config = module.config.to_dict()
        shapes: dict[str, list[int]] | None = {k: list(v.shape) for k, v in module.state_dict().items()}
    else:
        config = json.loads((Path(path) / "config.json").read_text())
        shapes = _safetensors_shapes(Path(path))
    config = {**config.get("text_config", {}), **config}
    return {"architecture": {k: config.get(k) for k in ARCHITECTURE_KEYS if k in config}, "parameters": shapes,
            "tokenizer": tokenizer_hash(tokenizer), "from": "module" if module is not None else "files"}


def model_differences(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, one line each (empty: the same model)."""
    # Keys both name: a config.json written by save_pretrained leaves out what is at its class's default.
    old_arch, new_arch = saved["architecture"], new["architecture"]
    lines = [f"config.json {k}: {old_arch[k]!r} -> {new_arch[k]!r}" for k in old_arch
             if k in new_arch and old_arch[k] != new_arch[k]]
    a, b = saved.get("parameters"), new.get("parameters")
    if a and b:
        names = set(a) | set(b) if new["from"] == saved["from"] else set(a) & set(b)  # a module keeps tied names
        changed = sorted(k for k in names if a.get(k) != b.get(k))
        if changed:
            lines.append(f"parameters ({len(changed)}): " + ", ".join(
                f"{k} {a.get(k, 'missing')} -> {b.get(k, 'missing')}" for k in changed[:5]))
        if not set(a) & set(b):
            lines.append("parameters: no parameter name in common")
    if saved.get("tokenizer") and new.get("tokenizer") and saved["tokenizer"] != new["tokenizer"]:
        lines.append(f"tokenizer (vocabulary or chat template): hash {saved['tokenizer']} -> {new['tokenizer']}")
    return lines


def check_same_model(run_dir: Path, resume: str, *, path: str, module: Any, tokenizer: Any) -> None:
    """Refuse (:class:`ConfigError` on ``model.path``) to resume with a model other than the one the run recorded.

    Reads metadata only (``config.json``, safetensors headers, the tokenizer's vocabulary), so it runs
    before any weights load. The run's own copy, a run without a recorded copy, and ``resume`` "never"
    (starting over) or "force" pass.
    """
    saved = _record(run_dir, MODEL_COPY).get("fingerprint")
    own_copy = bool(path) and Path(path).expanduser().resolve() == (run_dir / MODEL_COPY).resolve()
    if not saved or resume in ("never", "force") or own_copy:
        return
    try:
        new = fingerprint(path, module, tokenizer)
    except (OSError, ValueError) as exc:
        logger.warning("cannot read the model's metadata to compare it with %s's (%s); not checked", run_dir, exc)
        return
    differences = model_differences(saved, new)
    if differences:
        listed = "".join(f"\n  {line}" for line in differences)
        raise ConfigError("model.path", f"{run_dir} was trained from another model than {path or 'the one given'}; "
                                        f"its checkpoints would not load into this one:{listed}\nResume it with "
                                        f"its own model (Trainer.from_checkpoint({str(run_dir)!r}) uses the copy in "
                                        f"{MODEL_COPY}/), or give this run a new --output-dir")
