"""What plugins that build ``builtin:`` models locally share.

* the cache, ``$VERL_CACHE_DIR`` or ``~/.cache/verl`` (:func:`cache_root`); :func:`build_once` builds
  an entry into a temporary sibling and moves it into place only when complete, under a file lock,
  so concurrent runs build it once and a crash never leaves half an entry behind;
* :func:`one_torch_thread`: built weights depend on the thread count, so builds run on one;
* :func:`byte_level_tokenizer`: a tokenizer with no merges (every byte a token) plus the special and
  merged tokens a tiny task needs, so no tokenizer has to be downloaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import tempfile
from typing import Any, Callable, Iterator, Sequence

__all__ = ["cache_root", "build_once", "one_torch_thread", "byte_level_tokenizer"]


def cache_root() -> pathlib.Path:
    env = os.environ.get("VERL_CACHE_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "verl"


def build_once(name: str, build: Callable[[pathlib.Path], None], *, done_file: str,
               cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """``<cache>/builtin/<name>``, built by ``build(tmp_dir)`` on first use; complete once ``done_file`` exists
    in it (``build`` writes that file last)."""
    root = pathlib.Path(cache_dir) if cache_dir is not None else cache_root()
    target = root.expanduser() / "builtin" / name
    if (target / done_file).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / done_file).is_file():
            return target
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            build(tmp)
            if not (tmp / done_file).is_file():
                raise RuntimeError(f"building {name} wrote no {done_file}")
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is read like any other directory
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block with one torch thread (then restore the count)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def byte_level_tokenizer(*, pad: str, eos: str, special: Sequence[str] = (), merged: Sequence[str] = (),
                         chat_template: str | None = None, max_length: int = 128) -> Any:
    """A byte-level tokenizer (no merges) with ``pad``/``eos`` and ``special`` as single special tokens,
    ``merged`` strings as single plain tokens (as BPE merges would make them), left padding."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left",
                                               model_max_length=max_length)
    tok.add_special_tokens({"pad_token": pad, "eos_token": eos, "additional_special_tokens": list(special)})
    tok.add_tokens(list(merged))
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok
