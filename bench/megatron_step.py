"""One actor update: the Megatron backend against the FSDP backend and plain PyTorch, same ~32M model.

The model, batch, loss, timing and the plain-PyTorch / FSDP runs are :mod:`fsdp_step`'s (this script
reuses them); the Megatron rows run the same update through ``MegatronWorker.update_policy``
(Megatron's GPT model, schedule, DDP and optimizer on gloo, behind the CPU shims). Every
configuration runs in fresh processes and the configurations alternate round after round (paired
rounds), so machine noise hits all alike. Target (issue 15): at one process, within 10% of the
FSDP backend's step.

    python bench/megatron_step.py            # writes bench/results/megatron_step.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_step  # noqa: E402 - the shared model, batch, loss and timing
from machine import cpu_name  # noqa: E402 - the CPU's model name

CONFIGS = {
    "raw-pytorch ws1": {"kind": "raw", "ws": 1},
    "fsdp ws1": {"kind": "fsdp", "ws": 1, "backend": {}},
    "megatron ws1": {"kind": "megatron", "ws": 1, "backend": {}},
    "raw-pytorch ws2 (DDP)": {"kind": "raw", "ws": 2},
    "fsdp ws2": {"kind": "fsdp", "ws": 2, "backend": {}},
    "megatron dp2": {"kind": "megatron", "ws": 2, "backend": {}},
    "megatron tp2": {"kind": "megatron", "ws": 2, "backend": {"tensor_parallel_size": 2}},
}
# The row each one is compared with, in the same round.
PAIRS = {"megatron ws1": ["fsdp ws1", "raw-pytorch ws1"], "fsdp ws1": ["raw-pytorch ws1"],
         "megatron dp2": ["fsdp ws2", "raw-pytorch ws2 (DDP)"], "megatron tp2": ["fsdp ws2", "megatron dp2"]}


def run_megatron(rank: int, ws: int, model_dir: str, steps: int, settings: dict, port: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from verl_backend_megatron.backend import MegatronBackend, MegatronConfig
    from verl_core.contracts import ModelSpec, Role, WorldInfo

    backend = MegatronBackend(MegatronConfig(lr=1e-5, micro_batch_size=fsdp_step.BATCH, **settings))
    worker = backend.create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                   world=WorldInfo(rank=rank, world_size=ws, threads=1), seed=0)
    dp = worker.world.dp_size
    shard = fsdp_step.make_batch().chunk(dp)[worker.world.dp_rank]  # what a split dispatch hands this rank
    measured = fsdp_step.timed_steps(
        lambda: worker.update_policy(shard, loss_fn=fsdp_step.loss_fn, mini_batch_size=0, epochs=1), steps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    Path(out, f"rank{rank}.json").write_text(json.dumps({**measured, "rss_gb": rss}))
    import torch.distributed as dist

    dist.barrier()
    worker.close()
    dist.destroy_process_group()


def child(name: str, model_dir: str, steps: int, out: str) -> None:
    cfg = CONFIGS[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fn = {"raw": fsdp_step.run_raw, "fsdp": fsdp_step.run_fsdp, "megatron": run_megatron}[cfg["kind"]]
    settings = cfg if cfg["kind"] == "raw" else cfg["backend"]
    if cfg["ws"] == 1:
        fn(0, 1, model_dir, steps, settings, port, out)
        return
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=(cfg["ws"], model_dir, steps, settings, port, out), nprocs=cfg["ws"], join=True,
                       start_method="spawn")


def measure(name: str, model_dir: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--child", name, "--model-dir", model_dir, "--steps", str(steps), "--out", out]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    per_step = {k: [max(r[k][i] for r in ranks) for i in range(fsdp_step.WARMUP, steps)] for k in ("times", "cpu")}
    return {**per_step, "rss_gb": sum(r["rss_gb"] for r in ranks)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--model-dir")
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=5, help=f"steps per run, the first {fsdp_step.WARMUP} untimed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated configurations (default: all)")
    ap.add_argument("--results", default=str(Path(__file__).parent / "results" / "megatron_step.md"))
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CONFIGS)
    if args.child:
        child(args.child, args.model_dir, args.steps, args.out)
        return
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        fsdp_step.build_model_dir(Path(model_dir))
        for r in range(args.rounds):
            for name in names:
                m = measure(name, model_dir, args.steps)
                rounds[name].append({"times": statistics.median(m["times"]), "cpu": statistics.median(m["cpu"]),
                                     "rss_gb": m["rss_gb"]})
                print(f"round {r + 1} {name}: {rounds[name][-1]}", flush=True)
    Path(args.results).with_suffix(".json").write_text(json.dumps(rounds))
    med = {n: {k: statistics.median(x[k] for x in rs) for k in ("times", "cpu", "rss_gb")} for n, rs in rounds.items()}
    lines = [
        "# Megatron actor update vs the FSDP backend vs plain PyTorch",
        "",
        f"CPU: {cpu_name()}, {os.cpu_count()} cores; one torch thread per process; gloo. Model and batch of "
        f"`bench/fsdp_step.py`: Qwen2 architecture, ~32M parameters, fp32, {fsdp_step.BATCH} samples x "
        f"({fsdp_step.PROMPT} + {fsdp_step.RESPONSE}) tokens, PPO-clip loss, AdamW, grad clip 1.0, one micro-batch. "
        f"megatron-core 0.16.1 with the CPU shims (no TransformerEngine or Apex; the backend steps Megatron's "
        f"torch AdamW fallback with PyTorch's fused CPU kernel and runs the local spec's attention through SDPA).",
        f"Command: `python bench/megatron_step.py --rounds {args.rounds} --steps {args.steps}"
        f"{' --only ' + repr(args.only) if args.only else ''}`; date {time.strftime('%Y-%m-%d')}. "
        f"{args.rounds} rounds, configurations alternating in each; per run the median of {args.steps - fsdp_step.WARMUP} "
        f"timed steps after {fsdp_step.WARMUP} warm-up steps; the slowest rank's step.",
        "",
        "| configuration | processes | median step, wall (s) | median step, CPU (s) | peak RSS, all ranks (GiB) |",
        "|---|---|---|---|---|",
    ]
    for name, m in med.items():
        lines.append(f"| {name} | {CONFIGS[name]['ws']} | {m['times']:.3f} | {m['cpu']:.3f} | {m['rss_gb']:.2f} |")
    lines += ["", "Ratios within each round (paired), wall / CPU; then the median of the rounds:", ""]
    for name, bases in PAIRS.items():
        for base in bases:
            if name in rounds and base in rounds:
                pairs = [(a["times"] / b["times"], a["cpu"] / b["cpu"]) for a, b in zip(rounds[name], rounds[base])]
                text = ", ".join(f"{w:.3f} / {c:.3f}" for w, c in pairs)
                lines.append(f"- {name} / {base}: {text}; median {statistics.median(w for w, _ in pairs):.3f} / "
                             f"{statistics.median(c for _, c in pairs):.3f}")
    out = Path(args.results)
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
