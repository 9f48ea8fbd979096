"""Small measurements behind figures quoted in bench/README.md and the issue notes, one subcommand each.

    python bench/probes.py ray-call        # Ray actor call: empty vs carrying a 256-sample Batch shard
    python bench/probes.py vllm-seeds      # vLLM rollout of the built-in task: per-request seeds vs none vs HF
    python bench/probes.py accumulation    # FSDP update at one rank: unwrapped vs wrapped, with and without the shortcut
    python bench/probes.py vllm-settings   # the built-in rollout on vLLM with other scheduler settings vs HF
    python bench/probes.py vllm-lengths    # vLLM vs HF tokens/s on the built-in architecture as responses grow
    python bench/probes.py import-rss      # resident memory added by importing pyarrow and datasets
    python bench/probes.py hf-generate     # the TRL bench's generation: verl's HF rollout vs model.generate
    python bench/probes.py fsdp-revisions REV [REV ...] [--config "fsdp ws2"] [--rounds 3]
                                           # bench/fsdp_step.py's update at each git revision of verl_core + the FSDP backend
    python bench/probes.py memory-trace [--shard-single-rank [--no-accumulate]] [--trim]
                                           # peak/current RSS after every dataflow node of the TRL-bench ours-vllm run

Each prints its numbers; they are single runs on a shared 2-core machine, so read them as sizes, not
as benchmarks with error bars. One torch thread throughout.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import statistics
import sys
import tempfile
import time
from typing import Any
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def _status_kib(key: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM, ...) in KiB."""
    return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def ray_call() -> None:
    import ray

    from verl_core.testing import make_batch

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")

    @ray.remote(num_cpus=0.5)
    class Host:
        def empty(self):
            return None, 0.0

        def batch(self, b):
            return torch.zeros(len(b), 4), 0.0

        def plain(self, fields):
            return torch.zeros(len(fields["prompt_ids"]), 4), 0.0

    hosts = [Host.remote() for _ in range(2)]
    ray.get([h.empty.remote() for h in hosts])
    batch = make_batch(batch_size=512, prompt_length=14, response_length=4, vocab_size=16, group_size=8,
                       advantages=True, seed=0)
    halves = [batch.select(range(256)), batch.select(range(256, 512))]
    plain = len(pickle.dumps({k: v for k, v in halves[0].__dict__.items()}))
    print(f"256-sample shard: {len(pickle.dumps(halves[0]))} bytes pickled (plain int64 tensors: {plain})")

    def call(method, args):
        refs = [getattr(h, method).options(num_returns=2).remote(*a) for h, a in zip(hosts, args)]
        ray.wait([s for _, s in refs], num_returns=len(refs), timeout=10)
        ray.get([r for r, _ in refs])

    # The same shard as a Batch (integer tensors narrowed when pickled) and as a dict of its int64 tensors,
    # alternated so that machine noise hits both.
    plain_args = [({k: v for k, v in h.__dict__.items()},) for h in halves]
    results: dict[str, list[float]] = {}
    for _ in range(5):
        for name, method, args in (("empty call", "empty", [(), ()]), ("Batch shard", "batch", [(h,) for h in halves]),
                                   ("same tensors as int64", "plain", plain_args)):
            results.setdefault(name, []).append(_median_ms(lambda: call(method, args), 10))
    for name, values in results.items():
        print(f"{name}: {statistics.median(values):.2f} ms (median of 5 rounds x 10 calls)")
    ray.shutdown()


def _builtin_rollout_inputs() -> tuple[str, Any, list[list[int]]]:
    """The built-in model's directory, its tokenizer and the first 64 training prompts as token ids."""
    from transformers import AutoTokenizer

    from verl_task_arithmetic.addition import ensure_builtin_model, make_dataset

    builtin = str(ensure_builtin_model())
    tok = AutoTokenizer.from_pretrained(builtin)
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
               for r in make_dataset()[0][:64]]
    return builtin, tok, prompts


def vllm_seeds() -> None:
    from verl_core.contracts import ModelSpec, SamplingParams
    from verl_rollout_hf import HFRollout, HFRolloutConfig
    from verl_rollout_vllm.engine import VLLMRollout, VLLMRolloutConfig

    builtin, tok, prompts = _builtin_rollout_inputs()
    engine = VLLMRollout(config=VLLMRolloutConfig(kv_cache_gb=0.5, max_model_len=64), model=ModelSpec(path=builtin),
                         tokenizer=tok)
    hf = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=builtin), tokenizer=tok)
    times: dict[str, list[float]] = {}
    for rep in range(4):
        for name in ("vllm, per-request seeds", "vllm, no seeds", "hf"):
            sampling = SamplingParams(n=8, max_new_tokens=4, temperature=1.0, logprobs=True,
                                      seed=None if name == "vllm, no seeds" else 1000 + rep)
            if name.startswith("vllm"):
                engine._llm.reset_prefix_cache()  # as after every weight sync in a run
            start = time.perf_counter()
            (hf if name == "hf" else engine).generate(prompts, sampling=sampling)
            times.setdefault(name, []).append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{name}: {statistics.median(ts[1:]):.3f} s per rollout of 64 prompts x 8 (median of 3 after warm-up)")
    engine.close()


def vllm_settings() -> None:
    """The built-in rollout (64 prompts x 8, 4 new tokens) on vLLM engines with other scheduler
    settings, next to the HF rollout: does any vLLM setting beat HF on the 0.5M built-in model?"""
    from verl_core.contracts import ModelSpec, SamplingParams
    from verl_rollout_hf import HFRollout, HFRolloutConfig
    from verl_rollout_vllm.engine import VLLMRollout, VLLMRolloutConfig

    builtin, tok, prompts = _builtin_rollout_inputs()
    base = dict(kv_cache_gb=0.5, max_model_len=64)
    settings = {
        "vllm defaults (max_num_seqs 256, 4096 batched tokens)": VLLMRolloutConfig(**base),
        "vllm, all 512 sequences in one batch (max_num_seqs 512, 16384 batched tokens)": VLLMRolloutConfig(
            **base, max_num_seqs=512, engine_kwargs={"max_num_batched_tokens": 16384}),
        "vllm, engine core in a child process (multiprocessing)": VLLMRolloutConfig(**base, multiprocessing=True),
        # Prompts of ~15 tokens never fill a KV block, so the prefix cache cannot hit here anyway.
        "vllm, prefix caching off": VLLMRolloutConfig(**base, enable_prefix_caching=False),
        "vllm, async scheduling (all 512 in one batch)": VLLMRolloutConfig(
            **base, max_num_seqs=512, engine_kwargs={"max_num_batched_tokens": 16384, "async_scheduling": True}),
    }
    engines: dict[str, Any] = {name: VLLMRollout(config=cfg, model=ModelSpec(path=builtin), tokenizer=tok)
                               for name, cfg in settings.items()}
    steps: dict[str, int] = {}
    for name, engine in engines.items():
        core = engine._llm.llm_engine
        if hasattr(core, "step"):
            def counted(step=core.step, name=name):
                steps[name] = steps.get(name, 0) + 1
                return step()
            core.step = counted
    engines["hf"] = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=builtin), tokenizer=tok)
    times: dict[str, list[float]] = {}
    for rep in range(6):
        for name, engine in engines.items():
            if name != "hf":
                engine._llm.reset_prefix_cache()  # as after every weight sync in a run
            sampling = SamplingParams(n=8, max_new_tokens=4, temperature=1.0, logprobs=True, seed=1000 + rep)
            start = time.perf_counter()
            engine.generate(prompts, sampling=sampling)
            times.setdefault(name, []).append(time.perf_counter() - start)
    for name, ts in times.items():
        per = f", {steps[name] / len(ts):.0f} engine steps per rollout" if name in steps else ""
        print(f"{name}: median {statistics.median(ts[1:]):.3f} s per rollout (after a warm-up){per}")
    for name, engine in engines.items():
        if name != "hf":
            engine.close()


def vllm_lengths() -> None:
    """vLLM vs HF on the built-in model's architecture (0.5M parameters, random weights so that
    responses run on) as the response budget grows: where does vLLM's per-request cost stop
    outweighing HF's batched forward? Also the first call on a fresh engine (lazy start-up work)."""
    from verl_core.contracts import ModelSpec, SamplingParams
    from verl_core.testing import tiny_model_dir
    from verl_rollout_hf import HFRollout, HFRolloutConfig
    from verl_rollout_vllm.engine import VLLMRollout, VLLMRolloutConfig

    _, tok, prompts = _builtin_rollout_inputs()
    random_dir = tiny_model_dir(tempfile.mkdtemp(prefix="probe-vllm-"), seed=1)
    start = time.perf_counter()
    engine = VLLMRollout(config=VLLMRolloutConfig(kv_cache_gb=0.5, max_model_len=64), model=ModelSpec(path=random_dir),
                         tokenizer=tok)
    started = time.perf_counter() - start
    hf = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=random_dir), tokenizer=tok)
    rollouts = {"vllm": engine, "hf": hf}
    first: dict[str, float] = {}
    for name, rollout in rollouts.items():
        begin = time.perf_counter()
        rollout.generate(prompts, sampling=SamplingParams(n=8, max_new_tokens=4, seed=0))
        first[name] = time.perf_counter() - begin
    print(f"vllm start-up {started:.1f} s; first rollout vllm {first['vllm']:.3f} s, hf {first['hf']:.3f} s")
    print("max new tokens | vllm tokens | vllm s | vllm tok/s | hf tokens | hf s | hf tok/s | vllm/hf tok/s")
    for max_new in (4, 8, 16, 32, 56):
        times: dict[str, list[float]] = {}
        tokens: dict[str, list[int]] = {}
        for rep in range(4):
            for name, rollout in rollouts.items():
                if name == "vllm":
                    engine._llm.reset_prefix_cache()  # as after every weight sync in a run
                sampling = SamplingParams(n=8, max_new_tokens=max_new, temperature=1.0, seed=1000 + rep)
                begin = time.perf_counter()
                out = rollout.generate(prompts, sampling=sampling)
                times.setdefault(name, []).append(time.perf_counter() - begin)
                tokens.setdefault(name, []).append(sum(len(r) for r in out.response_ids))
        rate = {name: statistics.median(t / s for t, s in zip(tokens[name][1:], times[name][1:])) for name in rollouts}
        cells = " | ".join(f"{statistics.median(tokens[n][1:]):.0f} | {statistics.median(times[n][1:]):.3f} | "
                           f"{rate[n]:.0f}" for n in rollouts)
        print(f"{max_new} | {cells} | {rate['vllm'] / rate['hf']:.2f}x")
    engine.close()


def import_rss() -> None:
    """Resident memory that importing pyarrow and datasets adds to a process that already holds
    torch, transformers and vLLM (what reading a jsonl file through datasets.load_dataset cost)."""
    import importlib

    for name in ("torch", "transformers", "vllm"):
        importlib.import_module(name)
    before = _status_kib("VmRSS") / 1024
    importlib.import_module("pyarrow.parquet")
    mid = _status_kib("VmRSS") / 1024
    importlib.import_module("datasets")
    print(f"after torch/transformers/vllm: {before:.0f} MB; + pyarrow {mid - before:+.0f} MB; "
          f"+ datasets {_status_kib('VmRSS') / 1024 - mid:+.0f} MB")


def _accumulation_worker(model_dir: str, shard_single_rank: bool):
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_core.contracts import ModelSpec, Role, WorldInfo

    return FSDPBackend(FSDPConfig(lr=1e-5, micro_batch_size=8, shard_single_rank=shard_single_rank)).create_worker(
        role=Role.ACTOR, model=ModelSpec(path=model_dir), world=WorldInfo(threads=1), seed=0)


def accumulation() -> None:
    """One-rank update: the unwrapped module (default) vs FSDP-wrapped with and without the
    accumulation shortcut (keep layers gathered and gradients local between micro-batches)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_backend_fsdp.backend import FSDPWorker
    from verl_core.testing import make_batch

    model_dir = tempfile.mkdtemp(prefix="probe-model-")
    Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=512, intermediate_size=1792, num_hidden_layers=6,
                                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                 tie_word_embeddings=True)).save_pretrained(model_dir)
    batch = make_batch(batch_size=64, prompt_length=32, response_length=32, vocab_size=16, advantages=True, seed=0)

    def loss(*, batch, log_probs, entropy=None, values=None):
        return -(log_probs * batch.advantages * batch.response_mask).sum() / batch.response_mask.sum(), {}

    unwrapped = _accumulation_worker(model_dir, False)
    wrapped = _accumulation_worker(model_dir, True)
    shortcut = FSDPWorker._accumulating
    times: dict[str, list[float]] = {}
    for _ in range(3):
        for name in ("unwrapped (default)", "FSDP-wrapped, with the shortcut", "FSDP-wrapped, without"):
            worker = unwrapped if name.startswith("unwrapped") else wrapped
            wrapped._accumulating = (lambda more: shortcut(wrapped, more)) if name.endswith("shortcut") else (
                lambda more: None)
            start = time.perf_counter()
            worker.update_policy(batch, loss_fn=loss, mini_batch_size=0, epochs=1)
            times.setdefault(name, []).append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"update of 64 x 64 tokens, 21M params, micro-batches of 8, {name}: median {statistics.median(ts):.2f} s "
              f"({', '.join(f'{t:.2f}' for t in ts)})")


def fsdp_revisions(revisions: list[str], config: str, rounds: int) -> None:
    """One configuration of bench/fsdp_step.py at several git revisions, to find the commit behind a
    change in update time. Each revision is checked out into a temporary worktree and imported from
    there (PYTHONPATH: its verl_core and verl_backend_fsdp sources; the bench script is today's), in
    fresh processes, the revisions alternated over rounds. Prints median wall and CPU time per step."""
    import subprocess

    sys.path.insert(0, str(Path(__file__).parent))
    import fsdp_step

    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        fsdp_step.build_model_dir(Path(model_dir))
        trees = {}
        for rev in revisions:
            tree = Path(tmp) / f"tree-{len(trees)}"
            subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
            trees[rev] = tree
        try:
            results: dict[str, dict[str, list[float]]] = {rev: {"times": [], "cpu": []} for rev in revisions}
            for r in range(rounds):
                for rev, tree in trees.items():
                    env = {"PYTHONPATH": os.pathsep.join(str(tree / d / "src") for d in ("verl_core", "verl_backend_fsdp"))}
                    m = fsdp_step.measure(config, model_dir, 6, env=env)
                    for key in results[rev]:
                        results[rev][key] += m[key]
                    print(f"round {r + 1} {rev}: median {statistics.median(m['times']):.3f} s wall, "
                          f"{statistics.median(m['cpu']):.3f} s CPU", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)
    for rev, m in results.items():
        print(f"{config} at {rev}: median {statistics.median(m['times']):.3f} s wall, "
              f"{statistics.median(m['cpu']):.3f} s CPU per update ({len(m['times'])} steps)")


def memory_trace(shard_single_rank: bool, no_accumulate: bool, trim: bool) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import trl_comparison

    import verl_backend_fsdp.backend as fsdp
    import verl_core.dataflow as dataflow
    import verl_core.trainer as trainer

    def rss() -> str:
        return f"peak {_status_kib('VmHWM') / 2**20:.3f} GiB, now {_status_kib('VmRSS') / 2**20:.3f} GiB"

    if no_accumulate:
        fsdp.FSDPWorker._accumulating = lambda self, more: None
    timed = dataflow._timed

    def traced(node, ctx):
        task = timed(node, ctx)

        def run():
            result = task()
            print(f"  after {node.name}: {rss()}", flush=True)
            return result
        return run

    dataflow._timed = traced
    setup = trainer.Trainer.setup

    def traced_setup(self):
        setup(self)
        print(f"after setup: {rss()}", flush=True)

    trainer.Trainer.setup = traced_setup
    with tempfile.TemporaryDirectory() as work:
        trl_comparison.build_workload(Path(work), 32)
        overrides = (("backend.shard_single_rank=true",) if shard_single_rank else ()) + (
            ("backend.release_host_memory=true",) if trim else ())
        trl_comparison.run_ours("vllm", Path(work), 4, 32, Path(work) / "out", overrides)
    print(f"end: {rss()}")


def hf_generate() -> None:
    """The TRL bench's generation (16 prompts x 8, 32 tokens, 21M model): verl's HF rollout on an
    FSDP actor's module vs ``model.generate`` called directly as the raw floor does, alternated."""
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    import trl_comparison as T
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_core.contracts import ModelSpec, Role, SamplingParams, WorldInfo
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        T.build_workload(work, 32)
        tok = AutoTokenizer.from_pretrained(work / "model")
        rows = T.load_rows(work)[:T.PROMPTS_PER_STEP]
        prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
                   for r in rows]
        actor = FSDPBackend(FSDPConfig()).create_worker(role=Role.ACTOR, model=ModelSpec(path=str(work / "model")),
                                                        world=WorldInfo(threads=1), seed=0)
        engine = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=str(work / "model")), tokenizer=tok,
                           actor=actor)
        plain = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32).eval()
        eos, pad = tok.eos_token_id, tok.pad_token_id
        ids = torch.tensor(prompts)

        def floor(seed: int) -> None:
            torch.manual_seed(seed)
            with torch.no_grad():
                plain.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                               top_p=1.0, top_k=0, max_new_tokens=32, num_return_sequences=T.GROUP_SIZE,
                               eos_token_id=[eos], pad_token_id=pad)

        def ours(seed: int, logprobs: bool) -> None:
            engine.generate(prompts, sampling=SamplingParams(n=T.GROUP_SIZE, max_new_tokens=32, temperature=1.0,
                                                             logprobs=logprobs, seed=seed))

        runs = {"model.generate (floor)": floor, "verl HF rollout, log-probs": lambda s: ours(s, True),
                "verl HF rollout, no log-probs": lambda s: ours(s, False)}
        times: dict[str, list[float]] = {}
        for rep in range(4):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn(100 + rep)
                times.setdefault(name, []).append(time.perf_counter() - start)
        for name, ts in times.items():
            print(f"{name}: median {statistics.median(ts[1:]):.3f} s ({', '.join(f'{t:.3f}' for t in ts)}; first is "
                  f"warm-up)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="probe", required=True)
    probes = {"ray-call": ray_call, "vllm-seeds": vllm_seeds, "accumulation": accumulation,
              "hf-generate": hf_generate, "vllm-settings": vllm_settings, "vllm-lengths": vllm_lengths,
              "import-rss": import_rss}
    for name in probes:
        sub.add_parser(name)
    trace = sub.add_parser("memory-trace")
    trace.add_argument("--shard-single-rank", action="store_true", help="wrap the one-rank actor with FSDP")
    trace.add_argument("--no-accumulate", action="store_true",
                       help="with --shard-single-rank: disable the one-rank accumulation shortcut")
    trace.add_argument("--trim", action="store_true",
                       help="backend.release_host_memory=true: malloc_trim(0) after every update")
    revs = sub.add_parser("fsdp-revisions")
    revs.add_argument("revisions", nargs="+", help="git revisions (commits, tags, HEAD)")
    revs.add_argument("--config", default="fsdp ws2",
                      help="a bench/fsdp_step.py configuration whose settings exist at every revision")
    revs.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.probe == "memory-trace":
        memory_trace(args.shard_single_rank, args.no_accumulate, args.trim)
    elif args.probe == "fsdp-revisions":
        fsdp_revisions(args.revisions, args.config, args.rounds)
    else:
        probes[args.probe]()

if __name__ == "__main__":
    main()
