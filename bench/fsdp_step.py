"""Actor-update cost of the FSDP backend against the same step in plain PyTorch.

Each configuration runs in its own process (so peak RSS is its own), and the configurations are
alternated over several rounds so machine noise hits all of them alike. Reported: median step
time (wall clock, and the CPU time the process spent, which CPU time taken by the VM host does not
inflate), minor page faults per step, peak RSS, and framework overhead = (ours - raw) / raw at the
same thread count.

    python bench/fsdp_step.py            # writes bench/results/fsdp_step.md
"""

from __future__ import annotations

import argparse
import contextlib
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import bf16_flags, cpu_name  # noqa: E402 - bench/machine.py
# "backend" holds FSDPConfig fields. At one rank the backend trains the plain module by default
# (shard_single_rank=False); the wrapped row shows what FSDP itself costs there. Each FSDP row has a
# plain-PyTorch row doing the same work: activation checkpointing through the model's own
# gradient_checkpointing_enable, two ranks as fully_shard applied by hand (per decoder layer and
# the root, as the backend does). DistributedDataParallel at two ranks shows what sharding itself
# costs on gloo (all-gathers in forward and backward instead of one all-reduce).
CONFIGS = {
    "raw-pytorch ws1": {"kind": "raw", "ws": 1},
    "fsdp ws1": {"kind": "fsdp", "ws": 1, "backend": {}},
    "fsdp ws1 wrapped (shard_single_rank)": {"kind": "fsdp", "ws": 1, "backend": {"shard_single_rank": True}},
    "raw-pytorch ws1 +act-ckpt": {"kind": "raw", "ws": 1, "act_ckpt": True},
    "fsdp ws1 +act-ckpt": {"kind": "fsdp", "ws": 1, "backend": {"activation_checkpointing": True}},
    "raw-pytorch ws2 (DDP)": {"kind": "raw", "ws": 2},
    "raw-pytorch ws2 (fully_shard)": {"kind": "raw", "ws": 2, "shard": True},
    "fsdp ws2": {"kind": "fsdp", "ws": 2, "backend": {}},
    # Lower precision (issue 19): autocast as TRL/accelerate run it, the FSDP mixed-precision policy
    # (param_dtype), the backend's autocast, and the model's weights themselves in bf16.
    "raw-pytorch ws1 bf16 autocast": {"kind": "raw", "ws": 1, "autocast": "bfloat16"},
    "raw-pytorch ws1 bf16 weights": {"kind": "raw", "ws": 1, "dtype": "bfloat16"},
    "fsdp ws1 param_dtype=bfloat16": {"kind": "fsdp", "ws": 1, "backend": {"param_dtype": "bfloat16"}},
    "fsdp ws1 autocast=bfloat16": {"kind": "fsdp", "ws": 1, "backend": {"autocast": "bfloat16"}},
}
# Which raw row each FSDP row is measured against.
BASELINE = {"fsdp ws1": "raw-pytorch ws1", "fsdp ws1 wrapped (shard_single_rank)": "raw-pytorch ws1",
            "fsdp ws1 +act-ckpt": "raw-pytorch ws1 +act-ckpt", "fsdp ws2": "raw-pytorch ws2 (fully_shard)",
            "raw-pytorch ws2 (fully_shard)": "raw-pytorch ws2 (DDP)",
            "fsdp ws1 param_dtype=bfloat16": "raw-pytorch ws1 bf16 autocast",
            "fsdp ws1 autocast=bfloat16": "raw-pytorch ws1 bf16 autocast"}
# Lower precision against float32, the same path: speed-up = float32 step / lower-precision step.
SPEEDUP = {"raw-pytorch ws1 bf16 autocast": "raw-pytorch ws1", "raw-pytorch ws1 bf16 weights": "raw-pytorch ws1",
           "fsdp ws1 param_dtype=bfloat16": "fsdp ws1", "fsdp ws1 autocast=bfloat16": "fsdp ws1"}
BATCH, PROMPT, RESPONSE = 8, 32, 64
WARMUP = 2
MEASURES = ("times", "cpu", "faults")  # per step: wall seconds, CPU seconds, minor page faults


def build_model_dir(path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=False)
    import torch

    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def make_batch():
    import torch

    from verl_core.batch import Batch

    g = torch.Generator().manual_seed(0)
    ones_p = torch.ones(BATCH, PROMPT, dtype=torch.long)
    ones_r = torch.ones(BATCH, RESPONSE, dtype=torch.long)
    return Batch(prompt_ids=torch.randint(0, 8192, (BATCH, PROMPT), generator=g), prompt_mask=ones_p,
                 response_ids=torch.randint(0, 8192, (BATCH, RESPONSE), generator=g),
                 response_attention_mask=ones_r, response_mask=ones_r, group_ids=torch.arange(BATCH),
                 advantages=torch.randn(BATCH, RESPONSE, generator=g),
                 old_log_probs=-torch.rand(BATCH, RESPONSE, generator=g) * 9)


def loss_fn(*, batch, log_probs, entropy=None, values=None):
    from verl_algorithms import functional as F

    loss, _ = F.ppo_clip_loss(log_probs, batch.old_log_probs, batch.advantages, batch.response_mask,
                              clip_low=0.2, clip_high=0.2)
    return loss, {}


def timed_steps(step, steps: int) -> dict[str, list[float]]:
    """Run ``step()`` ``steps`` times; wall time, CPU time and minor page faults of each."""
    out: dict[str, list[float]] = {k: [] for k in MEASURES}
    for _ in range(steps):
        t, c, f = time.perf_counter(), time.process_time(), _minor_faults()
        step()
        out["times"].append(time.perf_counter() - t)
        out["cpu"].append(time.process_time() - c)
        out["faults"].append(_minor_faults() - f)
    return out


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_raw(rank: int, ws: int, model_dir: str, steps: int, settings: dict, port: int, out: str) -> None:
    """The floor: the same forward/backward/clip/AdamW step written directly against the model
    (at two ranks wrapped in DistributedDataParallel or fully_shard, each rank on its half of the batch)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, settings.get("dtype", "float32")))
    autocast = settings.get("autocast")
    if settings.get("act_ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    net = model
    if ws > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=ws)
        if settings.get("shard"):
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        else:
            net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = make_batch().chunk(ws)[rank]
    ids = batch.input_ids

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=getattr(torch, autocast)) if autocast else contextlib.nullcontext():
            logits = net(input_ids=ids, use_cache=False, logits_to_keep=RESPONSE + 1).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
            loss, _ = loss_fn(batch=batch, log_probs=lp)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a DTensor norm over all shards when sharded
        opt.step()

    measured = timed_steps(step, steps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    Path(out, f"rank{rank}.json").write_text(json.dumps({**measured, "rss_gb": rss}))
    if ws > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_fsdp(rank: int, ws: int, model_dir: str, steps: int, settings: dict, port: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_core.contracts import ModelSpec, Role, WorldInfo

    backend = FSDPBackend(FSDPConfig(lr=1e-5, micro_batch_size=BATCH, **settings))
    worker = backend.create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                   world=WorldInfo(rank=rank, world_size=ws, threads=1), seed=0)
    shard = make_batch().chunk(ws)[rank]
    measured = timed_steps(lambda: worker.update_policy(shard, loss_fn=loss_fn, mini_batch_size=0, epochs=1), steps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    Path(out, f"rank{rank}.json").write_text(json.dumps({**measured, "rss_gb": rss}))
    import torch.distributed as dist

    dist.barrier()  # leave together, the model freed first (as the Ray worker host does)
    worker.close()
    dist.destroy_process_group()


def measure(name: str, model_dir: str, steps: int, env: dict[str, str] | None = None) -> dict:
    """Run one configuration in fresh processes; returns step times and peak RSS (sum over ranks).

    ``env`` adds environment variables (``bench/probes.py fsdp-revisions`` points PYTHONPATH at an
    older checkout of the backend with it).
    """
    cfg = CONFIGS[name]
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--child", name, "--model-dir", model_dir, "--steps", str(steps),
               "--out", out]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    # Step time of the slowest rank; the warm-up steps (lazy init, optimizer state, allocator growth:
    # the second step of a wrapped one-rank run was still ~30% slow) are dropped.
    # CPU time and page faults: of the rank that spent the most in that step.
    per_step = {k: [max(r[k][i] for r in ranks) for i in range(WARMUP, steps)] for k in MEASURES}
    return {**per_step, "rss_gb": sum(r["rss_gb"] for r in ranks), "ranks": cfg["ws"]}


def child(name: str, model_dir: str, steps: int, out: str) -> None:
    cfg = CONFIGS[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if cfg["kind"] == "raw":
        fn, settings = run_raw, cfg
    else:
        fn, settings = run_fsdp, cfg["backend"]
    if cfg["ws"] == 1:
        fn(0, 1, model_dir, steps, settings, port, out)
        return
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=(cfg["ws"], model_dir, steps, settings, port, out), nprocs=cfg["ws"], join=True,
                       start_method="spawn")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--model-dir")
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=6, help=f"steps per run, the first {WARMUP} untimed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated configurations (default: all)")
    ap.add_argument("--results", default=str(Path(__file__).parent / "results" / "fsdp_step.md"))
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CONFIGS)
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    if args.child:
        child(args.child, args.model_dir, args.steps, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        build_model_dir(Path(model_dir))
        from transformers import AutoConfig

        results: dict[str, dict] = {n: {**{k: [] for k in MEASURES}, "rss_gb": []} for n in names}
        rounds: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names:  # alternate configurations every round
                m = measure(name, model_dir, args.steps)
                for key in MEASURES:
                    results[name][key] += m[key]
                results[name]["rss_gb"].append(m["rss_gb"])
                rounds[name].append({k: statistics.median(m[k]) for k in ("times", "cpu")})
                print(f"round {r + 1} {name}: median {statistics.median(m['times']):.3f}s wall, "
                      f"{statistics.median(m['cpu']):.3f}s CPU", flush=True)
        n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_dir)).parameters())
    # The measurements first, so that nothing is lost if the table below fails.
    Path(args.results).with_suffix(".json").write_text(json.dumps({"results": results, "rounds": rounds}))
    med = {name: {k: statistics.median(r[k]) for k in MEASURES} for name, r in results.items()}
    raw = med.get("raw-pytorch ws1") or next(iter(med.values()))
    lines = [
        "# FSDP actor update vs plain PyTorch",
        "",
        f"Model: Qwen2 architecture, {n_params / 1e6:.1f}M parameters (fp32). Batch: {BATCH} samples x "
        f"({PROMPT} prompt + {RESPONSE} response) tokens, PPO-clip loss, AdamW, grad clip. One torch thread per "
        f"process. {args.rounds} alternating rounds x {args.steps - WARMUP} timed steps each (after {WARMUP} warm-up "
        f"steps). CPU time: the process's user + system time in the step (the busiest rank's), which time the VM "
        f"host takes from this machine does not inflate.",
        f"Command: `python bench/fsdp_step.py --rounds {args.rounds} --steps {args.steps}"
        f"{' --only ' + repr(args.only) if args.only else ''}`; "
        f"date {time.strftime('%Y-%m-%d')}; {os.cpu_count()} CPU cores, {cpu_name()} ({bf16_flags()}).",
        "",
        "| configuration | processes | median step (s) | vs raw ws1 | median CPU (s) | vs raw ws1 | overhead vs its "
        "raw row (wall / CPU) | minor page faults / step | peak RSS, all ranks (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def over(m: dict, base: dict, key: str) -> str:
        return "" if m is base else f"{(m[key] - base[key]) / base[key] * 100:+.1f}%"

    for name, m in med.items():
        base = med.get(BASELINE.get(name, name), m)  # a row whose baseline was left out (--only) gets none
        lines.append(f"| {name} | {CONFIGS[name]['ws']} | {m['times']:.3f} | {m['times'] / raw['times']:.3f}x | "
                     f"{m['cpu']:.3f} | {m['cpu'] / raw['cpu']:.3f}x | "
                     f"{over(m, base, 'times')} / {over(m, base, 'cpu')} | {m['faults']:.0f} | "
                     f"{max(results[name]['rss_gb']):.2f} |")
    lines += ["", "Framework overhead: (ours - raw) / raw against the plain-PyTorch row doing the same work (wall / "
                  "CPU time); BASELINE in the script pairs them. The one-rank default trains the unwrapped module.",
              "", "The same ratio within each round (the two runs measured minutes apart, not across the whole run), "
                  "wall / CPU:", ""]
    for name, base_name in BASELINE.items():
        if name in rounds and base_name in rounds:
            pairs = [f"{a['times'] / b['times'] - 1:+.1%} / {a['cpu'] / b['cpu'] - 1:+.1%}"
                     for a, b in zip(rounds[name], rounds[base_name])]
            lines.append(f"- {name} vs {base_name}: {', '.join(pairs)}")
    speedups = [(n, b) for n, b in SPEEDUP.items() if n in rounds and b in rounds]
    if speedups:
        lines += ["", "Speed-up of lower precision over float32 on the same path (float32 step / this step), "
                      "median of the rounds' ratios [per round], wall / CPU:", ""]
    for name, base_name in speedups:
        wall = [b["times"] / a["times"] for a, b in zip(rounds[name], rounds[base_name])]
        cpu = [b["cpu"] / a["cpu"] for a, b in zip(rounds[name], rounds[base_name])]
        lines.append(f"- {name} vs {base_name}: {statistics.median(wall):.2f}x / {statistics.median(cpu):.2f}x "
                     f"[{', '.join(f'{w:.2f}' for w in wall)}]")
    out = Path(args.results)
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
