"""The ``openai`` rollout engine: samples from an already running OpenAI-compatible server.

Requests go to ``POST {base_url}/v1/completions`` with the prompt as token ids, ``n`` samples and
``logprobs: 0`` (the log-prob of each sampled token), and the token ids of the samples come back
through vLLM's ``return_token_ids`` (or, from other servers, ``return_tokens_as_token_ids``).
Prompts are sent as concurrent requests from a thread pool over one ``httpx.Client``: httpx is a
well-kept client (the one vLLM and the ``openai`` SDK use) with a thread-safe connection pool and
separate connect/read timeouts, and threads keep :meth:`OpenAIRollout.generate` a plain blocking
call even where an event loop is already running. Transient failures (connection errors,
timeouts, 408/429/5xx) are retried with exponential back-off and jitter, honouring
``Retry-After``. An optional in-memory cache answers repeated identical requests.

**The server owns its weights.** Keeping them in step with training is the user's job: by default
:meth:`OpenAIRollout.load_weights` raises and says so. ``weight_sync = "checkpoint"`` makes verl write
each update as a safetensors file into ``sync_dir`` (a directory the server can read) and ask a
vLLM server to reload it (``POST /collective_rpc`` with ``reload_weights``, then
``/reset_prefix_cache``; both need the server started with ``VLLM_SERVER_DEV_MODE=1``);
``weight_sync = "ignore"`` samples from the server's fixed weights (off-policy, e.g. evaluation).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from verl_core.contracts import ModelSpec, RolloutConfig, RolloutEngine, RolloutOutput, SamplingParams, WorldInfo
from verl_kit.engine import RetryingClient, ServerError, sample_seed, stop_token_ids, write_safetensors

__all__ = ["OpenAIRollout", "OpenAIRolloutConfig", "ServerError"]

logger = logging.getLogger(__name__)

WEIGHT_SYNC_MODES = ("error", "checkpoint", "ignore")


@dataclass
class OpenAIRolloutConfig(RolloutConfig):
    """Settings of the OpenAI-compatible server rollout (``[rollout]`` with ``name = "openai"``).

    Attributes:
        base_url: the server's root URL (``/v1/...`` is appended; a trailing ``/v1`` is accepted).
        model_name: the served model name; empty asks ``GET /v1/models`` for the first one.
        api_key_env: environment variable holding a bearer token (unset or empty: none is sent).
        max_concurrency: requests in flight at once.
        prompts_per_request: prompts batched into one request. 1 keeps each prompt's seed
            distinct; with more, a request's prompts share one seed.
        timeout_s: read timeout of one request in seconds.
        connect_timeout_s: connect timeout in seconds.
        max_retries: retries of a request after a transient failure (0: fail at once).
        backoff_s: first back-off delay in seconds; it doubles per retry, with jitter.
        backoff_max_s: longest back-off delay in seconds.
        deadline_s: longest time one request may take with its retries, in seconds (0: only
            ``max_retries`` limits them); past it the step fails naming the URL, and no step trains
            on the part of a batch that came back.
        cache: answer repeated identical requests (same prompt, sampling and seed) from memory.
            Sampled responses then repeat too: meant for evaluation and greedy decoding.
        cache_size: most cached requests (least recently used are dropped).
        weight_sync: what :meth:`OpenAIRollout.load_weights` does: ``"error"`` (weights are the
            user's job), ``"checkpoint"`` (write them to ``sync_dir`` and ask the server to reload)
            or ``"ignore"`` (keep sampling from the server's weights).
        sync_dir: directory shared with the server for ``weight_sync = "checkpoint"``.
    """

    base_url: str = "http://127.0.0.1:8000"
    model_name: str = ""
    api_key_env: str = "OPENAI_API_KEY"
    max_concurrency: int = 8
    prompts_per_request: int = 1
    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    max_retries: int = 4
    backoff_s: float = 0.5
    backoff_max_s: float = 16.0
    deadline_s: float = 600.0
    cache: bool = False
    cache_size: int = 10_000
    weight_sync: str = "error"
    sync_dir: str = ""

    def validate(self) -> None:
        super().validate()
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError("base_url: must start with http:// or https://, e.g. http://127.0.0.1:8000")
        if self.max_concurrency < 1 or self.prompts_per_request < 1:
            raise ValueError("max_concurrency/prompts_per_request: must be at least 1")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeout_s/connect_timeout_s: must be > 0 seconds")
        if self.max_retries < 0 or self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError("max_retries/backoff_s/backoff_max_s: must be >= 0")
        if self.deadline_s < 0:
            raise ValueError("deadline_s: must be >= 0 seconds (0: no deadline)")
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"weight_sync: must be one of {list(WEIGHT_SYNC_MODES)}")
        if self.weight_sync == "checkpoint" and not self.sync_dir:
            raise ValueError("sync_dir: weight_sync='checkpoint' needs a directory the server can read")


class OpenAIRollout(RolloutEngine):
    """Rollouts from an OpenAI-compatible completions server (vLLM's, for instance).

    Weight sync is the user's responsibility: the server keeps whatever weights it was started
    with unless ``weight_sync = "checkpoint"`` (vLLM servers in dev mode) or
    :meth:`reload_from_checkpoint` tells it otherwise.

    Attributes:
        model_name: the model name sent with every request.
        requests_sent: HTTP completion requests sent, retries included (cache hits excluded).
        retries: requests retried after a transient failure.
        cache_hits: requests answered from the cache.
    """

    Config = OpenAIRolloutConfig
    shares_actor_weights = False
    supports_memory_release = False

    def __init__(self, *, config: OpenAIRolloutConfig, model: ModelSpec, tokenizer: Any, actor: Any = None,
                 world: WorldInfo = WorldInfo()) -> None:
        super().__init__(config=config, model=model, tokenizer=tokenizer, actor=actor, world=world)
        # weight_sync="ignore" serves the server's fixed weights on purpose: the guard only records the gap.
        self.follows_actor_weights = config.weight_sync != "ignore"
        self._root = config.base_url.rstrip("/").removesuffix("/v1")
        headers = {}
        key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._http = RetryingClient(self._root, timeout_s=config.timeout_s, connect_timeout_s=config.connect_timeout_s,
                                    max_retries=config.max_retries, backoff_s=config.backoff_s,
                                    backoff_max_s=config.backoff_max_s, max_connections=config.max_concurrency,
                                    deadline_s=config.deadline_s or None, headers=headers)
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrency, thread_name_prefix="verl-openai")
        self._cache: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.requests_sent = 0
        self.cache_hits = 0
        self.model_name = config.model_name or self._served_model()

    # ------------------------------------------------------------------ HTTP
    def _served_model(self) -> str:
        try:
            body = self._request("GET", "/v1/models")
        except ServerError as exc:
            raise ServerError(f"no OpenAI-compatible server answered at {self._root} ({exc}); start one first, e.g. "
                              f"`python -m vllm.entrypoints.openai.api_server --model PATH --host 127.0.0.1`, "
                              f"or set rollout.base_url") from exc
        models = [m.get("id") for m in body.get("data", []) if m.get("id")]
        if not models:
            raise ServerError(f"{self._root}/v1/models lists no model; set rollout.model_name")
        return models[0]

    @property
    def retries(self) -> int:
        return self._http.retries

    def _request(self, method: str, path: str, payload: dict[str, Any] | None = None,
                 params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request with retries on transient failures (:class:`~verl_kit.engine.RetryingClient`)."""
        if path == "/v1/completions":
            with self._lock:
                self.requests_sent += 1
        body = self._http.request(method, path, payload, params=params)
        return body if isinstance(body, dict) else {}

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: Sequence[Sequence[int]], *, sampling: SamplingParams) -> RolloutOutput:
        size = self.config.prompts_per_request
        chunks = [list(range(s, min(s + size, len(prompt_ids)))) for s in range(0, len(prompt_ids), size)]
        stop_ids = stop_token_ids(self.tokenizer, sampling.stop_token_ids)
        # vLLM refuses n > 1 with greedy decoding; greedy samples are identical, so ask once and repeat.
        n = 1 if sampling.greedy else sampling.n

        def run(chunk: list[int]) -> list[dict[str, Any]]:
            prompts = [[int(t) for t in prompt_ids[i]] for i in chunk]
            payload = {
                "model": self.model_name,
                "prompt": prompts[0] if len(prompts) == 1 else prompts,
                "n": n,
                "max_tokens": sampling.max_new_tokens,
                "temperature": 0.0 if sampling.greedy else sampling.temperature,
                "top_p": 1.0 if sampling.greedy else sampling.top_p,
                "top_k": 0 if sampling.greedy or sampling.top_k <= 0 else sampling.top_k,
                # Spaced by n: vLLM seeds a request's k-th sample with seed + k.
                "seed": sample_seed(sampling.seed, chunk[0], n),
                "stop_token_ids": stop_ids,
                "ignore_eos": True,
                "skip_special_tokens": False,
                "logprobs": 0 if sampling.logprobs else None,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            }
            payload = {k: v for k, v in payload.items() if v is not None}
            choices = self._cached_completion(payload)
            samples = self._parse(choices, len(prompts), n, sampling.logprobs)
            # Copies, so that editing one sample never edits its siblings.
            return [(list(ids), list(lps), r) for ids, lps, r in samples for _ in range(sampling.n // n)]

        results = list(self._pool.map(run, chunks))
        responses, log_probs, reasons = [], [], []
        for samples in results:
            for ids, lps, reason in samples:
                responses.append(ids)
                log_probs.append(lps)
                reasons.append(reason)
        return RolloutOutput(responses, log_probs if sampling.logprobs else None, reasons)

    def _cached_completion(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        if not self.config.cache:
            return self._request("POST", "/v1/completions", payload).get("choices", [])
        key = json.dumps(payload, sort_keys=True)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return self._cache[key]
        choices = self._request("POST", "/v1/completions", payload).get("choices", [])
        with self._lock:
            self._cache[key] = choices
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return choices

    def _parse(self, choices: list[dict[str, Any]], n_prompts: int, n: int, want_logprobs: bool,
               ) -> list[tuple[list[int], list[float], str]]:
        expected = n_prompts * n
        if len(choices) != expected:
            raise ServerError(f"the server returned {len(choices)} choices for {n_prompts} prompt(s) x n={n}")
        out = []
        # Choice k*n + j is prompt k's j-th sample.
        for choice in sorted(choices, key=lambda c: c.get("index", 0)):
            ids = choice.get("token_ids")
            logprobs = choice.get("logprobs") or {}
            if ids is None:
                ids = [_token_id(t) for t in logprobs.get("tokens") or []]
                if not ids:
                    raise ServerError("the server returned no token ids; it must support vLLM's return_token_ids "
                                      "or return_tokens_as_token_ids with logprobs")
            lps: list[float] = []
            if want_logprobs:
                lps = [float(x) for x in logprobs.get("token_logprobs") or []]
                if len(lps) != len(ids):
                    raise ServerError(f"the server returned {len(lps)} log-probs for {len(ids)} tokens")
            reason = choice.get("finish_reason")
            if reason not in ("stop", "length"):
                raise ServerError(f"the server ended a sample with finish reason {reason!r}")
            out.append(([int(t) for t in ids], lps, reason))
        return out

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Act on new trainer weights as ``weight_sync`` says (by default: refuse, loudly).

        Raises:
            NotImplementedError: ``weight_sync = "error"``: the server's weights are the user's job.
            ServerError: the server could not reload the checkpoint.
        """
        mode = self.config.weight_sync
        if mode == "ignore":
            return
        if mode == "error":
            raise NotImplementedError(
                "the openai rollout samples from a server that keeps its own weights; syncing them after each "
                "update is the user's responsibility. Set rollout.weight_sync='checkpoint' with rollout.sync_dir "
                "(a directory the server reads; vLLM server started with VLLM_SERVER_DEV_MODE=1) to have verl "
                "write the weights and ask the server to reload them, or rollout.weight_sync='ignore' to keep "
                "sampling from the server's fixed weights (off-policy)")
        directory = Path(self.config.sync_dir)
        write_safetensors(weights, directory)  # shards appear complete or not at all
        self.reload_from_checkpoint(str(directory))

    def reload_from_checkpoint(self, path: str) -> None:
        """Ask the server to reload its weights from ``path`` (safetensors files in HF names).

        Uses vLLM's ``/collective_rpc`` (``reload_weights``) and ``/reset_prefix_cache``, which a
        vLLM server exposes when started with ``VLLM_SERVER_DEV_MODE=1``; clears the response cache.

        Raises:
            ServerError: the server has no reload endpoint or the reload failed.
        """
        try:
            self._request("POST", "/collective_rpc", {"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(path)}})
            self._request("POST", "/reset_prefix_cache")
        except ServerError as exc:
            hint = (" The server has no reload endpoint: start vLLM with VLLM_SERVER_DEV_MODE=1, or restart the "
                    "server on the new checkpoint yourself." if "HTTP 404" in str(exc) else "")
            raise ServerError(f"reloading weights from {path!r} failed: {exc}.{hint}") from exc
        with self._lock:
            self._cache.clear()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()


def _token_id(token: str) -> int:
    # vLLM's return_tokens_as_token_ids spells each token "token_id:<id>".
    prefix, _, number = token.rpartition(":")
    if prefix != "token_id" or not number.isdigit():
        raise ServerError(f"cannot read a token id from {token!r}; the server must return token ids")
    return int(number)
