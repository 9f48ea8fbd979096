"""Generation from a vLLM (or other OpenAI-compatible) server you already run: ``ExternalInferenceClient``.

A thin layer over the ``openai`` rollout engine (:class:`~verl_rollout_vllm.external.OpenAIRollout`),
which does the work: concurrent requests over one connection pool, several prompts per request
(``prompts_per_request``), retries with back-off on transient failures, and a cache that answers a
repeated request (same prompt, sampling parameters and seed) from memory. Three ways to use it:

* on its own: ``client.generate(prompts, sampling_params={"temperature": 0.7, "max_tokens": 256})``
  with text, chat messages or token ids;
* as a run's rollout engine: ``GRPOTrainer(..., inference_client=client)`` (the ``[rollout]``
  section of :meth:`ExternalInferenceClient.rollout_settings`, ``rollout.name = "openai"``): the
  trainer syncs the server's weights after every step as ``weight_sync`` says;
* as a dataflow node in an algorithm's own step: :func:`external_generate` is the rollout stage
  (generate, reward, filter, greedy baseline) on the server, with this node's sampling parameters.

Sampling parameters use the names of the OpenAI / vLLM API: ``temperature`` (0: greedy), ``top_p``,
``top_k``, ``max_tokens``, ``n``, ``seed``, ``stop_token_ids``, ``logprobs``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from verl_core.contracts import ModelSpec, RolloutOutput, RolloutRequest, SamplingParams

__all__ = ["ExternalInferenceClient", "ExternalOutput", "external_generate", "SAMPLING_PARAMS"]

#: The sampling parameters a client takes, by their OpenAI / vLLM names, and the field each sets.
SAMPLING_PARAMS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_new_tokens",
                   "max_new_tokens": "max_new_tokens", "n": "n", "seed": "seed", "stop_token_ids": "stop_token_ids",
                   "logprobs": "logprobs"}
#: The ``[rollout]`` keys a run on the server takes from the client's sampling parameters.
_ROLLOUT_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "n")


@dataclasses.dataclass
class ExternalOutput(RolloutOutput):
    """What :meth:`ExternalInferenceClient.generate` returns: the samples, and their text.

    ``response_ids``, ``log_probs`` and ``finish_reasons`` hold ``len(prompts) * n`` samples,
    prompt 0's ``n`` first (:class:`~verl_core.contracts.RolloutOutput`); ``texts`` decodes them.
    """

    texts: list[str] = dataclasses.field(default_factory=list)


class ExternalInferenceClient:
    """A running OpenAI-compatible server (vLLM's), as a generator and as a run's rollout engine.

    Args:
        base_url: the server's root URL (``http://vllm-server:8000``; a trailing ``/v1`` is accepted).
        model_name: the served model's name; empty asks the server (``GET /v1/models``).
        tokenizer: the model's tokenizer, or its directory; needed for text prompts and decoding. A run
            (or :func:`external_generate`) uses the run's own tokenizer.
        sampling_params: defaults of every :meth:`generate` call and of a run on this client.
        cache: answer repeated identical requests from memory (a new seed is a new request).
        **settings: the ``openai`` engine's other settings (:class:`~verl_rollout_vllm.external.OpenAIRolloutConfig`):
            ``max_concurrency``, ``prompts_per_request``, ``max_retries``, ``timeout_s``, ``weight_sync``,
            ``sync_dir``, ``api_key_env``, ...

    The connection opens on first use; :meth:`close` (or ``with``) releases it.

    Example:
        >>> client = ExternalInferenceClient(base_url="http://vllm-server:8000", tokenizer="Qwen/Qwen2-7B")  # doctest: +SKIP
        >>> out = client.generate(["2+2="], sampling_params={"temperature": 0.7, "max_tokens": 256})  # doctest: +SKIP
        >>> out.texts  # doctest: +SKIP
    """

    def __init__(self, base_url: str, *, model_name: str = "", tokenizer: Any = None,
                 sampling_params: Mapping[str, Any] | None = None, cache: bool = True, **settings: Any) -> None:
        from verl_rollout_vllm.external import OpenAIRolloutConfig

        own = {f.name for f in dataclasses.fields(OpenAIRolloutConfig)} - _base_fields()
        unknown = sorted(set(settings) - own)
        if unknown:
            raise TypeError(f"ExternalInferenceClient got unknown setting(s) {unknown}; it takes {sorted(own - {'base_url', 'model_name', 'cache'})} "
                            f"(sampling goes in sampling_params=)")
        self.config = OpenAIRolloutConfig(base_url=base_url, model_name=model_name, cache=cache, **settings)
        self.config.validate()
        self.sampling_params = _checked(sampling_params)
        self.tokenizer = _load_tokenizer(tokenizer)
        self._engine: Any = None
        self._closed_counts = {"requests_sent": 0, "retries": 0, "cache_hits": 0}  # of engines already closed

    # ------------------------------------------------------------------ the engine underneath
    def engine(self, tokenizer: Any = None) -> Any:
        """The :class:`~verl_rollout_vllm.external.OpenAIRollout` behind this client (started on first use)."""
        if self._engine is None:
            from verl_rollout_vllm.external import OpenAIRollout

            tokenizer = tokenizer if tokenizer is not None else self.tokenizer
            if tokenizer is None:
                raise ValueError("ExternalInferenceClient needs the model's tokenizer (its stop and padding tokens, "
                                 "and for text prompts): pass tokenizer= (an object or a directory)")
            self.tokenizer = self.tokenizer if self.tokenizer is not None else tokenizer
            self._engine = OpenAIRollout(config=self.config, model=ModelSpec(path=self.config.model_name),
                                         tokenizer=tokenizer)
        return self._engine

    def _count(self, name: str) -> int:
        return self._closed_counts[name] + (getattr(self._engine, name) if self._engine is not None else 0)

    @property
    def requests_sent(self) -> int:
        """Completion requests sent to the server, retries included (cache hits excluded)."""
        return self._count("requests_sent")

    @property
    def retries(self) -> int:
        """Requests sent again after a transient failure."""
        return self._count("retries")

    @property
    def cache_hits(self) -> int:
        """Requests answered from the cache."""
        return self._count("cache_hits")

    # ------------------------------------------------------------------ generation
    def sampling(self, sampling_params: Mapping[str, Any] | None = None, *,
                 base: SamplingParams | None = None) -> SamplingParams:
        """The :class:`~verl_core.contracts.SamplingParams` of a call: ``base``, the client's defaults, then these."""
        values = {**self.sampling_params, **_checked(sampling_params)}
        fields = {SAMPLING_PARAMS[k]: v for k, v in values.items()}
        if "stop_token_ids" in fields:
            fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
        if fields.get("temperature") == 0:
            fields.update(greedy=True, temperature=1.0)
        elif "temperature" in fields:
            fields["greedy"] = False
        return dataclasses.replace(base or SamplingParams(), **fields)

    def generate(self, prompts: Sequence[str | Sequence[Mapping[str, str]] | Sequence[int]],
                 sampling_params: Mapping[str, Any] | None = None) -> ExternalOutput:
        """Sample from the server: ``n`` responses per prompt, requests batched, retried and cached.

        Args:
            prompts: texts (tokenised as they are), chat message lists (the tokenizer's chat template,
                with the generation prompt), or token id lists.
            sampling_params: this call's parameters over the client's (OpenAI / vLLM names).
        """
        engine = self.engine()
        ids = [self._token_ids(p) for p in prompts]
        out = engine.generate(ids, sampling=self.sampling(sampling_params))
        texts = engine.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        return ExternalOutput(out.response_ids, out.log_probs, out.finish_reasons, out.weight_version, texts=texts)

    def _token_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.engine().tokenizer(prompt, add_special_tokens=False)["input_ids"])
        items = list(prompt)
        if items and all(isinstance(m, Mapping) for m in items):
            return list(self.engine().tokenizer.apply_chat_template(items, add_generation_prompt=True, tokenize=True,
                                                                    return_dict=False))
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            return items
        raise TypeError(f"a prompt must be a text, a list of chat messages or a list of token ids, got "
                        f"{type(prompt).__name__}")

    # ------------------------------------------------------------------ a run on this server
    def rollout_settings(self) -> dict[str, Any]:
        """The ``[rollout]`` section of a run whose rollout engine is this server (``name = "openai"``).

        The engine's settings, and the client's default sampling parameters as the run's
        ``rollout.temperature`` / ``top_p`` / ``top_k`` / ``max_new_tokens`` / ``n``; the run seeds each
        step itself.
        """
        from verl_rollout_vllm.external import OpenAIRolloutConfig

        defaults = OpenAIRolloutConfig()
        settings: dict[str, Any] = {"name": "openai"}
        for f in dataclasses.fields(OpenAIRolloutConfig):
            if f.name not in _base_fields() and (f.name == "base_url" or getattr(self.config, f.name) != getattr(defaults, f.name)):
                settings[f.name] = getattr(self.config, f.name)
        sampling = self.sampling()
        for key in _ROLLOUT_KEYS:
            if any(SAMPLING_PARAMS[k] == key for k in self.sampling_params):
                settings[key] = getattr(sampling, key)
        if sampling.greedy:
            raise ValueError("sampling_params: temperature 0 (greedy) for a run's rollout would give every sample of "
                             "a group the same answer; use a temperature > 0")
        return settings

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the connection pool (a later call opens a new one, with an empty cache)."""
        if self._engine is not None:
            for name in self._closed_counts:
                self._closed_counts[name] += getattr(self._engine, name)
            self._engine.close()
            self._engine = None

    def __enter__(self) -> "ExternalInferenceClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ExternalInferenceClient(base_url={self.config.base_url!r})"


def external_generate(df: Any, *, client: ExternalInferenceClient, sampling_params: Mapping[str, Any] | None = None,
                      request: RolloutRequest | None = None, name: str = "rollout") -> str:
    """Add the rollout stage on an external server to the dataflow ``df``; returns the node's name.

    In an algorithm's ``build_dataflow(df)``, in place of ``df.rollout(request)``: the step's prompts
    are generated on ``client``'s server (``n`` samples each, with the run's sampling under the
    client's and these ``sampling_params``; seeded per step), then scored, filtered and given a greedy
    baseline as ``request`` asks, like the run's own rollout stage. Before generating, the node brings
    the server to the actor's current weights as the client's ``weight_sync`` says (``"checkpoint"``:
    written to ``sync_dir`` and reloaded; ``"ignore"``: the server keeps its own; ``"error"``, the
    default: the step stops and says so).
    """
    from verl_core.kit import BASELINE, BATCH, EXTRAS_PREFIX, run_rollout_stage, sync_rollout_weights

    request = request or RolloutRequest()
    overrides = _checked(sampling_params)  # a misspelt parameter fails when the dataflow is built

    def run(ctx: Any) -> Any:
        engine = client.engine(ctx.tokenizer)
        if client.config.weight_sync != "ignore" and ctx.actor is not None:
            sync_rollout_weights(engine, ctx.actor)  # the policy of this step: after the last update
        sampling = client.sampling(overrides, base=ctx.sampling)
        return run_rollout_stage(dataclasses.replace(ctx, rollout=engine, sampling=sampling,
                                                     rollout_name=f"external {client.config.base_url}"), request)

    writes = [BATCH, "scores", "token_rewards"]
    if request.greedy_baseline:
        writes.append(EXTRAS_PREFIX + BASELINE)
    return df.node(name, run, writes=writes, role="rollout")


def _base_fields() -> set[str]:
    from verl_core.contracts import RolloutConfig

    return {f.name for f in dataclasses.fields(RolloutConfig)}


def _checked(sampling_params: Mapping[str, Any] | None) -> dict[str, Any]:
    params = dict(sampling_params or {})
    unknown = sorted(set(params) - set(SAMPLING_PARAMS))
    if unknown:
        raise ValueError(f"sampling_params: unknown {unknown}; known: {sorted(SAMPLING_PARAMS)}")
    for key in ("n", "max_tokens", "max_new_tokens"):
        if key in params and (not isinstance(params[key], int) or params[key] < 1):
            raise ValueError(f"sampling_params: {key} must be a positive integer, got {params[key]!r}")
    if "temperature" in params and params["temperature"] < 0:
        raise ValueError(f"sampling_params: temperature must be >= 0, got {params['temperature']!r}")
    return params


def _load_tokenizer(tokenizer: Any) -> Any:
    if isinstance(tokenizer, (str, bytes)) or hasattr(tokenizer, "__fspath__"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer
