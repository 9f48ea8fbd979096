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

# "backend" holds FSDPConfig fields. At one rank the backend trains the plain module by default
# (shard_single_rank=False); the wrapped row shows what FSDP itself costs there, and the
# release_host_memory rows what handing freed memory back to the OS after each update costs.
CONFIGS = {
    "raw-pytorch ws1": {"kind": "raw", "ws": 1},
    "fsdp ws1": {"kind": "fsdp", "ws": 1, "backend": {}},
    "fsdp ws1 release_host_memory=true": {"kind": "fsdp", "ws": 1, "backend": {"release_host_memory": True}},
    "fsdp ws1 wrapped (shard_single_rank)": {"kind": "fsdp", "ws": 1, "backend": {"shard_single_rank": True}},
    "fsdp ws1 +act-ckpt": {"kind": "fsdp", "ws": 1, "backend": {"activation_checkpointing": True}},
    "fsdp ws2": {"kind": "fsdp", "ws": 2, "backend": {}},
    "fsdp ws2 release_host_memory=true": {"kind": "fsdp", "ws": 2, "backend": {"release_host_memory": True}},
}
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
    from verl_core.algorithms import functional as F

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


def run_raw(model_dir: str, steps: int) -> dict[str, list[float]]:
    """The floor: the same forward/backward/clip/AdamW step written directly against the model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = make_batch()
    ids = batch.input_ids

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=RESPONSE + 1).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
        loss, _ = loss_fn(batch=batch, log_probs=lp)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return timed_steps(step, steps)


def run_fsdp(rank: int, ws: int, model_dir: str, steps: int, settings: dict, port: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_core.interfaces import ModelSpec, Role, WorldInfo

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
    import torch

    torch.set_num_threads(1)
    cfg = CONFIGS[name]
    if cfg["kind"] == "raw":
        measured = run_raw(model_dir, steps)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        Path(out, "rank0.json").write_text(json.dumps({**measured, "rss_gb": rss}))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    mp.start_processes(run_fsdp, args=(cfg["ws"], model_dir, steps, cfg["backend"], port, out), nprocs=cfg["ws"],
                       join=True, start_method="spawn")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--model-dir")
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=6, help=f"steps per run, the first {WARMUP} untimed")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model_dir, args.steps, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        build_model_dir(Path(model_dir))
        from transformers import AutoConfig

        results: dict[str, dict] = {n: {**{k: [] for k in MEASURES}, "rss_gb": []} for n in CONFIGS}
        for r in range(args.rounds):
            for name in CONFIGS:  # alternate configurations every round
                m = measure(name, model_dir, args.steps)
                for key in MEASURES:
                    results[name][key] += m[key]
                results[name]["rss_gb"].append(m["rss_gb"])
                print(f"round {r + 1} {name}: median {statistics.median(m['times']):.3f}s wall, "
                      f"{statistics.median(m['cpu']):.3f}s CPU", flush=True)
        n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_dir)).parameters())
    med = {name: {k: statistics.median(r[k]) for k in MEASURES} for name, r in results.items()}
    raw = med["raw-pytorch ws1"]
    lines = [
        "# FSDP actor update vs plain PyTorch",
        "",
        f"Model: Qwen2 architecture, {n_params / 1e6:.1f}M parameters (fp32). Batch: {BATCH} samples x "
        f"({PROMPT} prompt + {RESPONSE} response) tokens, PPO-clip loss, AdamW, grad clip. One torch thread per "
        f"process. {args.rounds} alternating rounds x {args.steps - WARMUP} timed steps each (after {WARMUP} warm-up "
        f"steps). CPU time: the process's user + system time in the step (the busiest rank's), which time the VM "
        f"host takes from this machine does not inflate.",
        f"Command: `python bench/fsdp_step.py --rounds {args.rounds} --steps {args.steps}`; "
        f"date {time.strftime('%Y-%m-%d')}; {os.cpu_count()} CPU cores.",
        "",
        "| configuration | processes | median step (s) | vs raw | median CPU (s) | vs raw | minor page faults / step "
        "| peak RSS, all ranks (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in med.items():
        lines.append(f"| {name} | {CONFIGS[name]['ws']} | {m['times']:.3f} | {m['times'] / raw['times']:.3f}x | "
                     f"{m['cpu']:.3f} | {m['cpu'] / raw['cpu']:.3f}x | {m['faults']:.0f} | "
                     f"{max(results[name]['rss_gb']):.2f} |")

    def over(name: str, key: str = "times", base: dict = raw) -> str:
        return f"{(med[name][key] - base[key]) / base[key] * 100:+.1f}%"

    lines += ["", f"Framework overhead at world size 1 (the default: unwrapped module, no malloc_trim): (ours - raw) / "
                  f"raw = {over('fsdp ws1')} wall, {over('fsdp ws1', 'cpu')} CPU; handing memory back after each "
                  f"update (release_host_memory=true): {over('fsdp ws1 release_host_memory=true')} wall, "
                  f"{over('fsdp ws1 release_host_memory=true', 'cpu')} CPU; FSDP-wrapped at one rank: "
                  f"{over('fsdp ws1 wrapped (shard_single_rank)')} wall. At two ranks release_host_memory=true costs "
                  f"{over('fsdp ws2 release_host_memory=true', 'times', med['fsdp ws2'])} wall, "
                  f"{over('fsdp ws2 release_host_memory=true', 'cpu', med['fsdp ws2'])} CPU."]
    out = Path(__file__).parent / "results" / "fsdp_step.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
