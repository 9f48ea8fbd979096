"""GRPO at the shape people train: a Qwen2.5-0.5B-architecture model, ours against TRL and the raw floor.

Issue 33, part 1. The workload is ``bench/trl_comparison.py --workload qwen2.5-0.5b``: Qwen2.5-0.5B's published
architecture (24 layers, hidden 896, 14 query / 2 KV heads, intermediate 4,864, vocabulary 151,936, tied
embeddings; 494M parameters), randomly initialised here (no downloads), a tokenizer of that vocabulary built
locally, 64-token prompts, responses of 64 tokens (``<eos>`` made unlikely, so every configuration does the
same work), GRPO with 4 prompts x 4 samples per step. Each configuration runs in a fresh process, one at a
time, alternated over rounds (paired by round); the comparison script does the measuring, this one adds what
the issue asks beyond it:

* per stage, the metric NeMo-RL and prime-rl publish: **tokens/s** of generation (response tokens), of the
  old-log-prob forward where a configuration runs one, and of the update (prompt + response tokens);
* peak RSS per configuration (the trainer's process and, for an async producer, its child);
* where the time goes: a ``torch.profiler`` table of one step of ``ours-hf-2t`` (``--profile``).

It writes ``bench/results/real_shape.{json,md,png}``::

    python bench/real_shape.py --rounds 2 --steps 3 --lock /tmp/verl-heavy.lock
    python bench/real_shape.py --report-only          # rewrite the report from the JSON

A step takes about a minute on two cores; the whole comparison about 40 minutes on an idle machine (nothing
else running: the figures are ratios of runs minutes apart). On a GPU, ``--device cuda`` runs every
configuration there, and ``--prompts``, ``--group-size``, ``--prompt-tokens``, ``--micro-batch`` and
``--max-new-tokens`` give the batch its GPU size (``scripts/gpu_check_real_shape.sh``); the report then sets
the update's tokens/s/GPU beside prime-rl's published Qwen3-0.6B trainer figure (:data:`PRIME_RL`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORKLOAD = "qwen2.5-0.5b"
MAX_NEW_TOKENS = 64
#: ours sync on one and two threads, ours colocate_async (1 producer + 2 trainer threads) and auto, TRL's
#: fastest CPU settings (2 threads fp32 and bf16), and the raw floor on 2 threads. vLLM/SGLang rollouts: ``--only``.
DEFAULT_ONLY = ("ours-hf-2t", "ours-hf-async", "ours-hf-2t-auto", "ours-hf-2t-bf16", "trl-hf-2t", "trl-hf-2t-bf16",
                "floor-hf-2t")
PROFILE_TOP = 15
#: prime-rl's published throughput at the nearest model size, for a GPU run's report. Source:
#: github.com/PrimeIntellect-ai/prime-rl, benchmarks/results/BENCHMARKS.md at commit 30bf494f (table "last
#: updated 2026-02-07"; the run's record is benchmarks/baselines/benchmark-1xh100-Qwen--Qwen3-0.6B-rl-full-1gpu-
#: Recompute-flash_attention_3-16384-cp1-ep1.json, 2026-01-15: mean 11,896 tokens/s, std 214). The row "Qwen3-0.6B,
#: RL Full, SeqLen 16384, AC Recompute, Attn FA3, 1xH100 HBM3: MFU 11.1%, TPS 11.90k, step time 1.38 s (per micro
#: batch), peak 12.5 GiB". It is the RL *trainer* alone (`--bench` on a fake data loader, docs/benchmarking.md),
#: not generation: that table publishes no generation figure for the model.
PRIME_RL = dict(tokens_per_s=11_900, model="Qwen3-0.6B", hardware="1x H100 80GB HBM3",
                conditions="the RL trainer alone on fake data (`--bench`), full fine-tuning, 16,384-token "
                           "sequences, activation recomputation, FlashAttention 3; MFU 11.1%, 12.5 GiB peak",
                source="github.com/PrimeIntellect-ai/prime-rl, benchmarks/results/BENCHMARKS.md "
                       "(commit 30bf494f, updated 2026-02-07)")


def stage_table(state: dict) -> list[str]:
    """Per-stage tokens/s (median over the timed steps of every round) for each configuration."""
    s = state["settings"]
    samples, prompt, warm = s["prompts_per_step"] * s["group_size"], s["prompt_tokens"], s["warmup"]
    lines = ["| configuration | step (s) | samples/s | generation tok/s | old-log-prob tok/s | update tok/s "
             "| peak RSS (GiB) |", "|---|---|---|---|---|---|---|"]
    names = sorted({r["config"] for r in state["runs"]}, key=lambda n: [r["config"] for r in state["runs"]].index(n))
    for name in names:
        timed = [st for r in state["runs"] if r["config"] == name and "steps" in r for st in r["steps"][warm:]]
        if not timed:
            errors = sorted({r.get("error", "") for r in state["runs"] if r["config"] == name})
            lines.append(f"| {name} | failed: {'; '.join(errors)[:120]} | | | | | |")
            continue
        med = lambda key: statistics.median([st.get(key, 0.0) for st in timed])  # noqa: E731
        length = statistics.fmean(st["response_length"] for st in timed)
        step, gen, olp, upd = med("seconds"), med("generate"), med("old_log_probs"), med("update")
        rss = max(r["peak_rss_gb"] for r in state["runs"] if r["config"] == name and "steps" in r)
        rate = lambda tokens, seconds: "n/a" if not seconds > 0 else f"{tokens / seconds:,.0f}"  # noqa: E731
        lines.append(f"| {name} | {step:.1f} | {samples / step:.3f} | {rate(samples * length, gen)} | "
                     f"{rate(samples * (prompt + length), olp) if olp > 1e-3 else 'skipped'} | "
                     f"{rate(samples * (prompt + length), upd)} | {rss:.1f} |")
    return lines


def ratio_lines(state: dict) -> list[str]:
    """Best against best, sync defaults against TRL, and our overhead over the raw floor, one ratio per round."""
    sys.path.insert(0, str(HERE))
    import trl_comparison as tc

    out = []
    best = tc.best_of_rounds(state)
    if best:
        out.append("* best ours / best TRL (target >= 1.5): " + ", ".join(f"{r:.2f} ({o} vs {t})" for r, o, t in best))
    for a, b, what in (("ours-hf-2t", "trl-hf-2t", "ours sync / TRL, both fp32 on 2 threads (target >= 1.2)"),
                       ("ours-hf-2t", "floor-hf-2t", "ours sync / the raw floor (target >= 0.91, i.e. <= 10% over)"),
                       ("ours-hf-2t-bf16", "floor-hf-2t-bf16", "ours sync / the raw floor, both bf16 autocast "
                                                               "(target >= 0.91)"),
                       ("ours-hf-2t-auto", "ours-hf-2t", "auto / sync (target: never below noise)"),
                       ("ours-hf-async", "ours-hf-2t", "colocate_async / sync")):
        pairs = tc.paired(state, a, b)
        if pairs:
            out.append(f"* {what}: " + ", ".join(f"{x:.2f}" for x in pairs))
    return out or ["No round has both sides of a ratio."]


def profile_child(work: Path, out: Path, threads: int) -> None:
    """One step of ours (sync, HF rollout) under ``torch.profiler``; the top operators by self CPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(HERE))
    import trl_comparison as tc

    tc.use_workload(WORKLOAD)
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp, profile(activities=[ProfilerActivity.CPU]) as prof:
        records = tc.run_ours("hf", work, 1, MAX_NEW_TOKENS, Path(tmp), threads=threads)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    out.write_text(json.dumps({"step": records[0], "threads": threads, "top": [
        {"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total, "calls": e.count}
        for e in events[:PROFILE_TOP]]}))


def run_profile(lock: str) -> dict:
    sys.path.insert(0, str(HERE))
    import trl_comparison as tc

    tc.use_workload(WORKLOAD)
    with tempfile.TemporaryDirectory() as tmp:
        work, out = Path(tmp), Path(tmp) / "profile.json"
        tc.build_workload(work, MAX_NEW_TOKENS)
        cmd = [sys.executable, __file__, "--profile-child", str(work), "--out", str(out)]
        if lock:
            cmd = ["flock", lock, *cmd]
        proc = subprocess.run(cmd, env=tc.child_env("ours-hf-2t"), capture_output=True, text=True)
        if not out.is_file():
            return {"error": proc.stderr[-3000:]}
        return json.loads(out.read_text())


def prime_rl_lines(state: dict) -> list[str]:
    """A GPU run's tokens/s/GPU per stage beside prime-rl's published figure (nothing for a CPU run)."""
    s = state["settings"]
    if s.get("device", "cpu") == "cpu":
        return []
    samples, prompt, warm = s["prompts_per_step"] * s["group_size"], s["prompt_tokens"], s["warmup"]
    gpu = state["versions"].get("gpu", "the GPU")
    lines = ["", f"## Beside prime-rl (one {gpu}: tokens/s/GPU = tokens/s)", "",
             f"prime-rl publishes {PRIME_RL['tokens_per_s']:,} tokens/s for {PRIME_RL['model']} on "
             f"{PRIME_RL['hardware']}: {PRIME_RL['conditions']} ({PRIME_RL['source']}). Its counterpart here is "
             f"the update column. Not like-for-like: {PRIME_RL['model']} has 0.6B parameters (28 layers) against "
             f"this 494M Qwen2.5-0.5B shape, its sequences are 16,384 tokens packed against {samples} rows of "
             f"{prompt} + {s['max_new_tokens']} tokens here, and it runs FlashAttention 3 with activation "
             "recomputation against SDPA, no recomputation and bf16 autocast over fp32 weights here.", "",
             "| configuration | step (s) | generation tok/s/GPU | update tok/s/GPU | update / prime-rl | "
             "step tok/s/GPU | peak GPU memory (GiB) |", "|---|---|---|---|---|---|---|"]
    for name in sorted({r["config"] for r in state["runs"]}):
        runs = [r for r in state["runs"] if r["config"] == name and "steps" in r]
        timed = [st for r in runs for st in r["steps"][warm:]]
        if not timed:
            continue
        med = lambda key: statistics.median([st.get(key, 0.0) for st in timed])  # noqa: E731
        length = statistics.fmean(st["response_length"] for st in timed)
        step, gen, upd = med("seconds"), med("generate"), med("update")
        update = samples * (prompt + length) / upd if upd > 0 else float("nan")
        gen_rate = f"{samples * length / gen:,.0f}" if gen > 0 else "n/a"
        peak = max((r.get("peak_gpu_gb", float("nan")) for r in runs), default=float("nan"))
        lines.append(f"| {name} | {step:.2f} | {gen_rate} | {update:,.0f} | "
                     f"{update / PRIME_RL['tokens_per_s']:.2f}x | {samples * (prompt + length) / step:,.0f} | "
                     f"{peak:.1f} |")
    lines += ["", "Step tok/s/GPU: prompt + response tokens of the batch over the whole step (generation, "
              "rewards, update). prime-rl publishes no generation figure for the model in that table."]
    return lines


def write_report(results: Path, prof: dict | None) -> None:
    state = json.loads(results.read_text())
    md = results.with_suffix(".md")
    text = md.read_text() if md.is_file() else ""
    text = text.split("\n## Per stage", 1)[0].rstrip() + "\n"
    text = text.replace("# GRPO on a rollout-heavy workload:", "# GRPO at a Qwen2.5-0.5B shape:", 1)
    lines = ["", "## Per stage (tokens/s, the unit NeMo-RL and prime-rl publish)", "",
             "Generation: response tokens per second of the generate stage; old-log-prob and update: prompt + "
             "response tokens per second of the stage (TRL and the floor skip the old-log-prob forward before a "
             "single update; ours is told to with `algorithm.use_rollout_log_probs=true`). Peak RSS: the "
             "configuration's process plus its largest child (an async producer).", "", *stage_table(state)]
    lines += ["", "## Ratios, paired by round (samples/s; > 1: the first is faster)", "", *ratio_lines(state)]
    lines += prime_rl_lines(state)
    if prof:
        lines += ["", "## Where the time goes: one step of `ours-hf` under `torch.profiler`", ""]
        if "error" in prof:
            lines.append(f"The profile failed: `{prof['error'][-300:]}`")
        else:
            st = prof["step"]
            lines += [f"{prof['threads']} threads; the step took {st['seconds']:.1f} s: generate {st['generate']:.1f} s, "
                      f"update {st['update']:.1f} s, weight sync {st['sync']:.2f} s (the first step of a process, "
                      "so allocation is in it). Top operators by self CPU time:", "",
                      "| operator | self CPU (s) | share | calls |", "|---|---|---|---|"]
            lines += [f"| `{t['op']}` | {t['self_s']:.2f} | {t['share']:.0%} | {t['calls']} |" for t in prof["top"]]
    md.write_text(text + "\n".join(lines) + "\n")
    if prof:
        results.with_suffix(".profile.json").write_text(json.dumps(prof, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="RL steps per run, the warm-up step included")
    ap.add_argument("--only", default=",".join(DEFAULT_ONLY))
    ap.add_argument("--lock", default="")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds one configuration may run")
    ap.add_argument("--results", default=str(RESULTS / "real_shape.json"))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where every configuration runs")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="response length")
    for flag in ("--prompts", "--group-size", "--prompt-tokens", "--micro-batch"):
        ap.add_argument(flag, type=int, help="the workload's batch shape, replaced (trl_comparison.py's option)")
    ap.add_argument("--profile-child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.profile_child:
        profile_child(Path(args.profile_child), Path(args.out), threads=2)
        return
    results = Path(args.results)
    prof_path = results.with_suffix(".profile.json")
    if not args.report_only:
        cmd = [sys.executable, str(HERE / "trl_comparison.py"), "--workload", WORKLOAD, "--max-new-tokens",
               str(args.max_new_tokens), "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", "1",
               "--only", args.only, "--timeout", str(args.timeout), "--results", str(results)]
        if args.device != "cpu":
            cmd += ["--device", args.device]
        for flag in ("prompts", "group_size", "prompt_tokens", "micro_batch"):
            if getattr(args, flag) is not None:
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        if args.lock:
            cmd += ["--lock", args.lock]
        subprocess.run(cmd, check=True)
    prof = None
    if not args.no_profile and not args.report_only and args.device == "cpu":  # the profile is of the CPU
        prof = run_profile(args.lock)
    elif prof_path.is_file():
        prof = json.loads(prof_path.read_text())
    write_report(results, prof)
    print((results.with_suffix(".md")).read_text())


if __name__ == "__main__":
    main()
