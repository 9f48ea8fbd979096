"""Helpers every rollout engine plugin needs: stop ids, seeds, weight files, HTTP with retries.

Engine plugins (vLLM, SGLang, a server client) use these instead of writing or importing each
other's copies:

* :func:`stop_token_ids`: the tokenizer's end-of-sequence id(s) plus a request's own stop ids;
* :func:`sample_seed`: one distinct seed per sample of a seeded request;
* :func:`write_safetensors`: a weight stream written as safetensors shards of bounded size, with
  an index, each file appearing under its final name only once complete;
* :class:`RetryingClient`: JSON over HTTP (httpx, which the engines that use it depend on) with
  exponential back-off and jitter on transient failures, honouring ``Retry-After``, and a deadline; it
  raises :class:`~verl_core.contracts.ServerError`, re-exported here.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from verl_core.contracts import ServerError  # the core's CLI reports it, so the core defines it

if TYPE_CHECKING:
    import torch

__all__ = ["stop_token_ids", "sample_seed", "write_safetensors", "RetryingClient", "ServerError", "RETRY_STATUSES"]

logger = logging.getLogger(__name__)

# Statuses worth retrying: the request may succeed unchanged a moment later.
RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


def stop_token_ids(tokenizer: Any, extra: Iterable[int] = ()) -> list[int]:
    """The tokenizer's eos id(s) and ``extra``, sorted, without duplicates."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = eos if isinstance(eos, (list, tuple, set)) else [eos]
    return sorted({int(i) for i in ids if i is not None} | {int(i) for i in extra})


def sample_seed(seed: int | None, prompt: int, n: int, sample: int = 0) -> int | None:
    """The seed of sample ``sample`` of prompt ``prompt`` in a request seeded with ``seed``.

    Prompts are spaced by ``n``, so every sample of a batch gets its own seed, and a batch's
    samples do not depend on how an engine splits it into requests.
    """
    return None if seed is None else seed + prompt * n + sample


def write_safetensors(weights: Iterable[tuple[str, "torch.Tensor"]], directory: str | os.PathLike,
                      *, shard_bytes: int = 1 << 30) -> list[Path]:
    """Write a (name, tensor) stream as ``model-XXXXX.safetensors`` shards in ``directory``.

    At most about ``shard_bytes`` of tensors are held at once (one shard), never the whole model.
    Each shard is written under a temporary name and renamed when complete, and the index
    (``model.safetensors.index.json``, the layout ``from_pretrained`` and the engines read) is
    written last, so a reader never sees half a file. Returns the shard paths.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("model*.safetensors*"):
        stale.unlink()
    shards: list[Path] = []
    weight_map: dict[str, str] = {}
    bucket: dict[str, Any] = {}
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        path = directory / f"model-{len(shards) + 1:05d}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(bucket, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
        shards.append(path)
        weight_map.update({name: path.name for name in bucket})
        bucket, size = {}, 0

    for name, tensor in weights:
        t = tensor.detach().to("cpu").contiguous()
        if size and size + t.numel() * t.element_size() > shard_bytes:
            flush()
        bucket[name] = t
        size += t.numel() * t.element_size()
    flush()
    index = directory / "model.safetensors.index.json"
    tmp = index.with_suffix(".tmp")
    total = sum(p.stat().st_size for p in shards)
    tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    os.replace(tmp, index)
    return shards


@dataclass
class RetryingClient:
    """JSON requests to one server, retried on transient failures.

    A connection error, a timeout or a status in :data:`RETRY_STATUSES` is retried after
    ``backoff_s * 2**attempt`` seconds (capped at ``backoff_max_s``, with jitter so that many
    threads do not retry in step, or the server's ``Retry-After``), at most ``max_retries`` times
    and never past ``deadline_s`` from the first attempt. Any other error status fails at once.
    Thread-safe (one ``httpx.Client`` connection pool).

    Attributes:
        requests_sent: requests sent, retries included.
        retries: requests retried after a transient failure.
    """

    base_url: str
    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    max_retries: int = 4
    backoff_s: float = 0.5
    backoff_max_s: float = 16.0
    deadline_s: float | None = None
    max_connections: int = 8
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        import httpx

        self.base_url = self.base_url.rstrip("/")
        limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections)
        self._client = httpx.Client(base_url=self.base_url, headers=self.headers or {}, limits=limits,
                                    timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s))
        self._lock = threading.Lock()
        self.requests_sent = 0
        self.retries = 0

    def request(self, method: str, path: str, payload: Any = None, *, params: dict[str, Any] | None = None,
                retry: bool = True, timeout_s: float | None = None) -> Any:
        """Send one request; returns the decoded JSON body (``{}`` when empty, text when not JSON).

        Raises:
            ServerError: an error status that is not transient, or failures past the retries or
                the deadline; the message names the URL and the last error.
        """
        import httpx

        start = time.monotonic()
        attempt = 0
        while True:
            wait = None
            with self._lock:
                self.requests_sent += 1
            try:
                extra = {} if timeout_s is None else {"timeout": timeout_s}
                response = self._client.request(method, path, json=payload, params=params, **extra)
            except httpx.TransportError as exc:  # refused/reset connections, timeouts
                error = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 400:
                    if not response.content:
                        return {}
                    try:
                        return response.json()
                    except ValueError:
                        return response.text
                error = f"HTTP {response.status_code}: {response.text[:500]}"
                if response.status_code not in RETRY_STATUSES:
                    raise ServerError(f"{method} {self.base_url}{path} failed with {error}")
                wait = _retry_after(response.headers.get("retry-after"))
            if not retry or attempt >= self.max_retries:
                raise ServerError(f"{method} {self.base_url}{path} failed after {attempt + 1} attempts: {error}")
            if wait is None:
                wait = min(self.backoff_max_s, self.backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)
            if self.deadline_s is not None and time.monotonic() - start + wait > self.deadline_s:
                raise ServerError(f"{method} {self.base_url}{path} failed within its {self.deadline_s:g} s deadline "
                                  f"({attempt + 1} attempt(s)): {error}")
            attempt += 1
            with self._lock:
                self.retries += 1
            logger.warning("retrying %s %s in %.2fs after %s", method, path, wait, error)
            time.sleep(wait)

    def close(self) -> None:
        self._client.close()


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None

