"""What every contract shares: worker roles, model and rank descriptions, the config error, dispatch modes."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable


__all__ = ["Role", "ModelSpec", "WorldInfo", "ConfigError", "dispatch", "dispatch_mode"]


class Role(str, enum.Enum):
    """The jobs a training worker can do."""

    ACTOR = "actor"
    CRITIC = "critic"
    REFERENCE = "reference"
    REWARD_MODEL = "reward_model"


@dataclass(frozen=True)
class ModelSpec:
    """Where a worker gets its model.

    Attributes:
        path: a local Hugging Face model directory (or hub id where a network exists).
        tokenizer_path: tokenizer directory; defaults to ``path``.
        dtype: parameter dtype name (``"float32"``, ``"bfloat16"``).
        trust_remote_code: passed to ``from_pretrained``.
        module: an already loaded ``torch.nn.Module`` to use instead of loading ``path``.
    """

    path: str
    tokenizer_path: str | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False
    module: Any = None


@dataclass(frozen=True)
class WorldInfo:
    """Where a worker sits in its worker group, and in the group's parallel mesh.

    Executors fill in the first five fields. A backend that splits its ranks into model-parallel
    groups (tensor ``tp``, pipeline ``pp``) keeps its own copy with the mesh filled in as the
    worker's ``world`` attribute; executors read it after building the worker. ``"split"`` calls
    are then cut into ``dp_size`` shards, every rank of data-parallel group ``d`` gets shard ``d``,
    and each group's result is read from its :attr:`is_output_rank` (not once per model-parallel
    rank). Unset, the mesh is pure data parallel: ``dp_rank = rank``, ``dp_size = world_size``.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    threads: int = 1
    dp_rank: int | None = None
    dp_size: int | None = None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.dp_rank is None:
            object.__setattr__(self, "dp_rank", self.rank)
        if self.dp_size is None:
            object.__setattr__(self, "dp_size", self.world_size)

    @property
    def is_output_rank(self) -> bool:
        """The rank whose results stand for its data-parallel group: tensor rank 0 of the last pipeline stage."""
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1


class ConfigError(ValueError):
    """A configuration the run cannot start with; ``path`` is the dotted key at fault (also
    ``verl_core.config.ConfigError``)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


_DISPATCH_ATTR = "__verl_dispatch__"


def dispatch(mode: str) -> Callable[[Callable], Callable]:
    """Declare how a worker-group call spreads over ranks.

    ``"split"``: the ``batch`` argument is cut into one shard per data-parallel rank and the
    results are gathered in order. ``"broadcast"``: every rank gets the same arguments and rank 0's
    result is returned. ``"all"``: every rank gets the same arguments and all results come back.
    Executors read this; the in-process executor calls the one worker directly.
    """
    if mode not in ("split", "broadcast", "all"):
        raise ValueError(f"unknown dispatch mode {mode!r}; use 'split', 'broadcast' or 'all'")

    def mark(fn: Callable) -> Callable:
        setattr(fn, _DISPATCH_ATTR, mode)
        return fn

    return mark


def dispatch_mode(fn: Callable | type | object, method: str | None = None) -> str:
    """The dispatch mode declared on a worker method (``"broadcast"`` if none).

    ``dispatch_mode(fn)`` reads the mark on one function. ``dispatch_mode(cls, "name")`` (a class
    or an instance) looks ``name`` up through the MRO and returns the first mark found, so an
    implementation that overrides a base method inherits the mode the base declared: the marks
    sit on :class:`TrainingWorker`'s abstract methods, not on every backend's overrides.
    """
    if method is None:
        return getattr(fn, _DISPATCH_ATTR, "broadcast")
    cls = fn if isinstance(fn, type) else type(fn)
    for klass in cls.__mro__:
        attr = klass.__dict__.get(method)
        if attr is None:
            continue
        mode = getattr(getattr(attr, "__func__", attr), _DISPATCH_ATTR, None)  # unwrap static/classmethods
        if mode is not None:
            return mode
    return "broadcast"
