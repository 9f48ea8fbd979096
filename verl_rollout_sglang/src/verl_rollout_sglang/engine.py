"""The ``sglang`` rollout engine: a real SGLang server, in its own Python environment.

SGLang pins its own torch, so the server runs under a second interpreter
(:mod:`verl_rollout_sglang.environment`) and the trainer talks to it over HTTP:

* **Server.** Launched as a child process on 127.0.0.1 (a free port, a health wait with a
  deadline, its log in ``rollout.log_dir``), ended with its whole process group on
  :meth:`SGLangRollout.close`, at exit, and by a watchdog when the trainer dies. Or an already
  running server, by ``rollout.base_url``.
* **Generation.** ``POST /generate`` with token ids in and token ids plus the log-prob of each
  sampled token out. Every sample is its own request entry with its own seed
  (:func:`verl_kit.engine.sample_seed`), sent in chunks over a bounded thread pool.
* **Weight sync.** ``disk``: the weight stream is written once as safetensors shards
  (:func:`verl_kit.engine.write_safetensors`) and loaded with ``/update_weights_from_disk``;
  works whatever torch each side has. ``tensor``: bucketed tensors in SGLang's serialized form
  through ``/update_weights_from_tensor`` (between ``/begin_weight_update`` and
  ``/end_weight_update``), for a trainer with the server's torch on the same host. ``distributed``:
  a process group between trainer and server (``/init_weights_update_group``,
  ``/update_weights_from_distributed``), for GPUs on separate placements. After every update the
  radix cache is flushed, waiting for the server to be idle (the flush that comes with an update
  can be refused while a finished batch is still held, which served stale KV in SGLang's own
  tests of this), and each sync gets a weight version that every later sample reports.
* **Memory.** With ``enable_sleep_mode`` on a GPU, ``/release_memory_occupation`` and
  ``/resume_memory_occupation`` around training; on a CPU both are no-ops (SGLang's memory saver
  needs CUDA).

On a CPU the server gets ``SGLANG_USE_CPU_ENGINE=1``, ``--attention-backend torch_native``,
``--disable-overlap-schedule``, ``--sleep-on-idle``, one thread and our ``sgl_kernel`` stand-in
(see ``cpu_support/sgl_kernel``).

**Seeds on a CPU.** SGLang honours a request's ``sampling_seed`` only with
``--enable-deterministic-inference``, which it allows for GPU attention backends only (not
``torch_native``). On a CPU, sampling is therefore seeded once per server (``--random-seed``) and
not per request: the same seed does not repeat a sample, and a resumed run samples differently
from an uninterrupted one. :attr:`SGLangRollout.seeded_sampling` says which case applies.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import torch

from verl_core.contracts import ModelSpec, RolloutConfig, RolloutEngine, RolloutOutput, SamplingParams, WorldInfo
from verl_core.kit import WeightSyncError
from verl_kit.engine import RetryingClient, ServerError, sample_seed, stop_token_ids, write_safetensors

from verl_rollout_sglang.environment import SGLangEnvironmentError, server_python
from verl_rollout_sglang.server import CPU_SUPPORT_DIR, ServerProcess, ServerStartError, free_port

__all__ = ["SGLangRollout", "SGLangRolloutConfig", "SGLangWeightSyncError"]

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "disk", "tensor", "distributed")
#: Settings of the server verl launches, which a server given by ``base_url`` was started without.
LAUNCH_ONLY = ("server_python", "mem_fraction_static", "threads", "startup_timeout_s", "log_dir", "log_level",
               "server_args")


class SGLangWeightSyncError(WeightSyncError):
    """The server refused or failed a weight update; the engine's weights are then unknown."""


@dataclass
class SGLangRolloutConfig(RolloutConfig):
    """Settings of the SGLang rollout (``[rollout]`` with ``name = "sglang"``).

    Attributes:
        base_url: an SGLang server that is already running; empty launches one per engine. The
            running server keeps the settings it was started with, so the launch settings
            (:data:`LAUNCH_ONLY`) are refused beside it.
        server_python: the interpreter that runs the server; empty finds the environment that
            ``verl sglang setup`` built (see :mod:`verl_rollout_sglang.environment`).
        device: ``"cpu"`` or ``"cuda"``; empty takes CUDA when the trainer sees a GPU.
        dtype: the server's dtype; empty means the model's (always passed explicitly: SGLang's
            ``auto`` serves a float32 checkpoint in float16).
        mem_fraction_static: share of memory for weights and KV cache; 0 takes 0.05 on a CPU
            (about 1 GB of KV cache here) and SGLang's own default on a GPU.
        tensor_parallel_size: GPUs per server (``--tp``).
        threads: torch threads of the server (``OMP_NUM_THREADS``); more than one per core
            oversubscribes the CPU (measured: from 4.3k down to 0.2k tokens/s).
        weight_sync: ``"auto"`` (``tensor`` for a GPU server on this host with the trainer's torch
            version, else ``disk``), ``"disk"``, ``"tensor"`` or ``"distributed"`` (both GPU only).
        sync_dir: where ``disk`` syncs write the weights; empty uses a temporary directory. With
            ``base_url`` the server must be able to read it (same host or a shared filesystem).
        bucket_mb: largest bucket of a ``tensor`` sync, or shard of a ``disk`` sync, in MiB.
        max_concurrency: HTTP requests in flight at once.
        samples_per_request: samples sent in one ``/generate`` request.
        startup_timeout_s: how long the server may take to become healthy.
        request_timeout_s: read timeout of one request.
        max_retries: retries of a request after a transient failure.
        flush_timeout_s: how long a cache flush waits for the server to be idle.
        enable_sleep_mode: release the server's GPU memory while the trainer updates (GPU only).
        log_dir: where the server's log goes; empty uses a temporary directory (logged).
        log_level: SGLang's ``--log-level``.
        server_args: extra ``launch_server`` arguments (``{"chunked-prefill-size": 512}``;
            ``true`` adds a bare flag); they come last and win.
    """

    base_url: str = ""
    server_python: str = ""
    device: str = ""
    dtype: str = ""
    mem_fraction_static: float = 0.0
    tensor_parallel_size: int = 1
    threads: int = 1
    weight_sync: Literal["auto", "disk", "tensor", "distributed"] = "auto"
    sync_dir: str = ""
    bucket_mb: int = 512
    max_concurrency: int = 4
    samples_per_request: int = 64
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    max_retries: int = 3
    flush_timeout_s: float = 30.0
    enable_sleep_mode: bool = False
    log_dir: str = ""
    log_level: str = "error"
    server_args: dict[str, Any] = field(default_factory=dict)

    def compute_dtype(self, model_dtype: str) -> str:
        return self.dtype or model_dtype

    def validate(self) -> None:
        super().validate()
        if self.weight_sync not in TRANSPORTS:
            raise ValueError(f"weight_sync: must be one of {list(TRANSPORTS)}")
        if self.device not in ("", "cpu", "cuda"):
            raise ValueError("device: must be 'cpu', 'cuda' or empty (auto)")
        if self.base_url and not self.base_url.startswith(("http://", "https://")):
            raise ValueError("base_url: must start with http:// or https://, e.g. http://127.0.0.1:30000")
        if not 0 <= self.mem_fraction_static < 1:
            raise ValueError("mem_fraction_static: must be in [0, 1) (0 takes the device's default)")
        for name in ("tensor_parallel_size", "threads", "bucket_mb", "max_concurrency", "samples_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        if min(self.startup_timeout_s, self.request_timeout_s, self.flush_timeout_s) <= 0:
            raise ValueError("startup_timeout_s/request_timeout_s/flush_timeout_s: must be > 0 seconds")
        if self.max_retries < 0:
            raise ValueError("max_retries: must be >= 0")
        given = [f.name for f in fields(self) if self.base_url and f.name in LAUNCH_ONLY and getattr(self, f.name) != (
                 f.default if f.default_factory is MISSING else f.default_factory())]
        if given:
            raise ValueError(f"{given[0]}: with base_url verl connects to a running server, which keeps the settings "
                             f"it was started with; {', '.join(given)} only apply to a server verl launches (pass them "
                             f"to that server's launch command, or leave base_url empty)")
        # Selecting the engine is the moment to say SGLang is missing: before any model loads.
        if not self.base_url:
            try:
                server_python(self.server_python)
            except SGLangEnvironmentError as exc:
                raise ValueError(str(exc)) from None


class SGLangRollout(RolloutEngine):
    """Rollouts from an SGLang server, with weight sync over disk, tensors or a process group.

    Attributes:
        url: the server's root URL.
        device: where the server computes (``"cpu"`` or ``"cuda"``).
        transport: the weight-sync transport in use.
        weight_version: how many syncs the server has taken (0: the weights it started with).
        seeded_sampling: False on a CPU, where SGLang cannot seed single requests.
        last_sync_seconds: wall time of the last :meth:`load_weights`.
        server: the child process, or None for a server given by ``base_url``.
    """

    Config = SGLangRolloutConfig
    shares_actor_weights = False

    def __init__(self, *, config: SGLangRolloutConfig, model: ModelSpec, tokenizer: Any, actor: Any = None,
                 world: WorldInfo = WorldInfo()) -> None:
        super().__init__(config=config, model=model, tokenizer=tokenizer, actor=actor, world=world)
        self.device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.supports_memory_release = config.enable_sleep_mode and self.device == "cuda"
        self.seeded_sampling = self.device != "cpu"
        if config.weight_sync in ("tensor", "distributed") and self.device == "cpu":
            from verl_core.config import ConfigError

            raise ConfigError("rollout.weight_sync", f"{config.weight_sync!r} needs a GPU server (CUDA IPC "
                                                     f"handles / NCCL); on a CPU use 'disk' (or 'auto')")
        self.weight_version = 0
        self.last_sync_seconds = 0.0
        self.server: ServerProcess | None = None
        self._tmp_dirs: list[str] = []
        self._model_dir = self._resolve_model_dir()
        self._python = "" if config.base_url else server_python(config.server_python)
        self._server_torch = ""
        if config.base_url:
            self.url = config.base_url.rstrip("/")
        else:
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
        self.client = RetryingClient(self.url, timeout_s=config.request_timeout_s, max_retries=config.max_retries,
                                     max_connections=config.max_concurrency)
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrency, thread_name_prefix="verl-sglang")
        try:
            if not config.base_url:
                self._launch(port)
            self.transport = self._choose_transport()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start-up
    def _resolve_model_dir(self) -> str:
        """A directory the server can load: the in-memory module written out once, or the path."""
        spec = self.model
        if spec.module is None:
            if not spec.path or not Path(spec.path).is_dir():
                raise ServerStartError(f"model.path: the sglang rollout needs a local model directory, got "
                                       f"{spec.path!r}")
            return spec.path
        tmp = tempfile.mkdtemp(prefix="verl-sglang-model-")
        self._tmp_dirs.append(tmp)
        spec.module.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        return tmp

    def _launch(self, port: int) -> None:
        cfg = self.config
        dtype = cfg.compute_dtype(self.model.dtype)
        args = ["--model-path", self._model_dir, "--host", "127.0.0.1", "--port", str(port), "--device",
                self.device, "--dtype", dtype, "--tp-size", str(cfg.tensor_parallel_size), "--log-level",
                cfg.log_level, "--random-seed", "0", "--sleep-on-idle", "--skip-server-warmup"]
        if self.model.trust_remote_code:
            args.append("--trust-remote-code")
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "PYTHONUNBUFFERED": "1"}
        fraction = cfg.mem_fraction_static
        if self.device == "cpu":
            # SGLang's CPU path; the stand-in keeps every layer on native torch (no AMX kernels).
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SUPPORT_DIR), env.get("PYTHONPATH")) if p)
            args += ["--attention-backend", "torch_native", "--disable-overlap-schedule"]
            fraction = fraction or 0.05
        else:
            args += ["--enable-deterministic-inference"]
            if cfg.enable_sleep_mode:
                args.append("--enable-memory-saver")
        if fraction:
            args += ["--mem-fraction-static", str(fraction)]
        for key, value in cfg.server_args.items():
            flag = f"--{key.replace('_', '-')}"
            if value is True:
                args.append(flag)
            elif value is not False and value is not None:
                args += [flag, str(value)]
        log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="verl-sglang-log-"))
        log_path = log_dir / f"sglang-server-{port}.log"
        logger.info("SGLang server log: %s", log_path)
        self.server = ServerProcess(self._python, args, env=env, log_path=log_path, port=port)
        self.server.wait_healthy(self.client, cfg.startup_timeout_s)

    def _choose_transport(self) -> str:
        """``auto``: ``tensor`` for a GPU server with the trainer's torch, else ``disk``.

        Serialized tensors are unpickled by the server's torch, so only the same version reads
        them; and CPU tensors travel as shared-memory file descriptors that SGLang can receive only
        from its own process tree, so on a CPU only ``disk`` works.
        """
        mode = self.config.weight_sync
        if mode != "auto":
            return mode
        if self.device == "cpu":
            return "disk"
        if self._python:
            import subprocess

            done = subprocess.run([self._python, "-c", "import torch; print(torch.__version__)"],
                                  capture_output=True, text=True, timeout=120)
            self._server_torch = done.stdout.strip()
        return "tensor" if self._server_torch and self._server_torch == torch.__version__ else "disk"

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: Sequence[Sequence[int]], *, sampling: SamplingParams) -> RolloutOutput:
        stops = set(stop_token_ids(self.tokenizer, sampling.stop_token_ids))
        version = self.weight_version
        responses, log_probs, reasons = [], [], []
        for body in self._pool.map(self.send, self.requests(prompt_ids, sampling)):
            for item in body:
                ids, lps, reason = self._parse(item, sampling.logprobs, stops)
                responses.append(ids)
                log_probs.append(lps)
                reasons.append(reason)
        return RolloutOutput(responses, log_probs if sampling.logprobs else None, reasons, weight_version=version)

    def requests(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[dict[str, Any]]:
        """The ``/generate`` payloads for a batch: one entry per sample, ``samples_per_request`` a
        payload, prompt 0's samples first."""
        params = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": 0.0 if sampling.greedy else sampling.temperature,
            "top_p": 1.0 if sampling.greedy else sampling.top_p,
            "top_k": 1 if sampling.greedy else (sampling.top_k if sampling.top_k > 0 else -1),
            # SGLang also stops on the eos ids of the model's config (ignore_eos would turn off
            # stop_token_ids as well); for HF models those are the tokenizer's.
            "stop_token_ids": stop_token_ids(self.tokenizer, sampling.stop_token_ids),
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        entries = []
        for p, prompt in enumerate(prompt_ids):
            for j in range(sampling.n):
                seed = sample_seed(sampling.seed, p, sampling.n, j)
                extra = {"sampling_seed": seed} if seed is not None and self.seeded_sampling and not sampling.greedy \
                    else {}
                entries.append(([int(t) for t in prompt], {**params, **extra}))
        size = self.config.samples_per_request
        return [{"input_ids": [ids for ids, _ in chunk], "sampling_params": [sp for _, sp in chunk],
                 "return_logprob": sampling.logprobs, "logprob_start_len": -1}
                for chunk in (entries[s:s + size] for s in range(0, len(entries), size))]

    def send(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """POST one ``/generate`` payload; returns one output per input."""
        body = self.client.request("POST", "/generate", payload)
        if not isinstance(body, list) or len(body) != len(payload["input_ids"]):
            raise ServerError(f"{self.url}/generate returned {type(body).__name__} for "
                              f"{len(payload['input_ids'])} inputs")
        return body

    def _parse(self, item: dict[str, Any], want_logprobs: bool, stops: set[int]
               ) -> tuple[list[int], list[float], str]:
        meta = item.get("meta_info") or {}
        ids = [int(t) for t in item.get("output_ids") or []]
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind not in ("stop", "length"):
            raise ServerError(f"SGLang ended a sample with finish reason {finish!r}; expected 'stop' or 'length'")
        if not ids:
            raise ServerError("SGLang returned a sample without output_ids")
        lps: list[float] = []
        if want_logprobs:
            lps = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
            if len(lps) != len(ids):
                raise ServerError(f"SGLang returned {len(lps)} log-probs for {len(ids)} tokens")
        return ids, lps, kind

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send the trainer's weights (HF names) to the server, flush its cache, bump the version.

        Raises:
            SGLangWeightSyncError: the server refused the update; its message is quoted.
        """
        start = time.perf_counter()
        version = self.weight_version + 1
        try:
            if self.transport == "disk":
                self._sync_disk(weights, version)
            elif self.transport == "tensor":
                self._sync_tensor(weights, version)
            else:
                self._sync_distributed(weights, version)
            self._flush()
        except ServerError as exc:
            raise SGLangWeightSyncError(f"the SGLang server at {self.url} failed a {self.transport} weight sync: "
                                        f"{exc}{self._log_hint()}") from exc
        self.weight_version = version
        self.last_sync_seconds = time.perf_counter() - start

    def _post_ok(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        body = self.client.request("POST", path, payload, retry=False)
        if isinstance(body, dict) and body.get("success") is False:
            raise ServerError(f"{path}: {body.get('message')}")
        return body if isinstance(body, dict) else {}

    def _sync_disk(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        directory = self.config.sync_dir
        if not directory:
            directory = tempfile.mkdtemp(prefix="verl-sglang-sync-")
            self._tmp_dirs.append(directory)
            self.config.sync_dir = directory
        directory = Path(directory)
        write_safetensors(weights, directory, shard_bytes=self.config.bucket_mb << 20)
        # The loader reads the model's config next to the weights.
        for name in ("config.json", "generation_config.json"):
            source = Path(self._model_dir) / name
            if source.is_file() and not (directory / name).is_file():
                shutil.copy(source, directory / name)
        self._post_ok("/update_weights_from_disk", {"model_path": str(directory), "weight_version": str(version),
                                                    "flush_cache": False})

    def _sync_tensor(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        import base64
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers the reductions that share tensor storage

        self._post_ok("/begin_weight_update", {})
        try:
            limit = self.config.bucket_mb << 20
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0

            def send() -> None:
                nonlocal bucket, size
                if not bucket:
                    return
                buf = io.BytesIO()
                ForkingPickler(buf).dump(bucket)
                blob = base64.b64encode(buf.getvalue()).decode()
                self._post_ok("/update_weights_from_tensor", {
                    "serialized_named_tensors": [blob] * self.config.tensor_parallel_size,
                    "flush_cache": False, "weight_version": str(version)})
                bucket, size = [], 0

            for name, tensor in weights:
                t = tensor.detach().contiguous()
                if size and size + t.numel() * t.element_size() > limit:
                    send()
                bucket.append((name, t))
                size += t.numel() * t.element_size()
            send()
        finally:
            self._post_ok("/end_weight_update", {})

    def _sync_distributed(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        import torch.distributed as dist

        if self._group is None:
            self._group = self._init_update_group()
        for name, tensor in weights:
            t = tensor.detach().to(self.device).contiguous()
            request = self._pool.submit(self._post_ok, "/update_weights_from_distributed", {
                "names": [name], "dtypes": [str(t.dtype).removeprefix("torch.")], "shapes": [list(t.shape)],
                "group_name": "verl_weight_sync", "flush_cache": False, "weight_version": str(version)})
            dist.broadcast(t, src=0, group=self._group)
            request.result()

    _group: Any = None

    def _init_update_group(self) -> Any:
        """A process group of the trainer (rank 0) and the server's TP ranks, for broadcasts.

        The server builds its side with a ``tcp://`` rendezvous, a store prefixed with the group
        name, and ``_new_process_group_helper``; this side must build the same keys, so it does
        the same with rank 0 (which hosts the store).
        """
        from datetime import timedelta

        from torch.distributed import distributed_c10d as c10d

        port = free_port()
        world = 1 + self.config.tensor_parallel_size
        backend = "nccl" if self.device == "cuda" else "gloo"
        name = "verl_weight_sync"
        request = self._pool.submit(self._post_ok, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world,
            "group_name": name, "backend": backend})
        timeout = timedelta(seconds=self.config.request_timeout_s)
        store, rank, size = next(c10d.rendezvous(f"tcp://127.0.0.1:{port}", 0, world, timeout=timeout))
        store.set_timeout(timeout)
        group, _ = c10d._new_process_group_helper(size, rank, [], c10d.Backend(backend),
                                                  c10d.PrefixStore(name, store), group_name=name,
                                                  timeout=timeout)
        c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
        request.result()
        return group

    def _flush(self) -> None:
        """Flush the radix cache once the server is idle, retrying until ``flush_timeout_s``."""
        deadline = time.monotonic() + self.config.flush_timeout_s
        while True:
            try:
                self.client.request("POST", "/flush_cache", params={"timeout": self.config.flush_timeout_s},
                                    retry=False)
                return
            except ServerError as exc:
                if time.monotonic() > deadline:
                    raise ServerError(f"the cache flush after a weight update kept failing for "
                                      f"{self.config.flush_timeout_s:g} s (rollout.flush_timeout_s); KV computed "
                                      f"with the old weights could be served: {exc}") from exc
                time.sleep(0.2)

    def _log_hint(self) -> str:
        if self.server is None:
            return ""
        return f"\nThe end of the server's log ({self.server.log_path}):\n{self.server.log_tail(2000)}"

    # ------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """Free the server's weights and KV cache on a GPU (a no-op on a CPU, where SGLang's memory
        saver does not run)."""
        if self.supports_memory_release:
            self.client.request("POST", "/release_memory_occupation", {})

    def reacquire_memory(self) -> None:
        if self.supports_memory_release:
            self.client.request("POST", "/resume_memory_occupation", {})

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        if self.server is not None:
            self.server.close()
            self.server = None
        for tmp in self._tmp_dirs:
            shutil.rmtree(tmp, ignore_errors=True)
        self._tmp_dirs.clear()

