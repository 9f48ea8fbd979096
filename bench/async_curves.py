"""Do the overlapping modes learn as the synchronous one does? Reward curves over the same samples.

Runs the README's default run (`verl run`: the built-in arithmetic task, GRPO, 100 steps) in
``trainer.mode = "sync"`` and ``"colocate_async"`` (one-step off-policy, the producer in a process of its
own), with several seeds each, and compares greedy test accuracy (``val/reward_mean``) and the training
reward at the same step, i.e. after the same number of samples. "Within noise" is judged against the
spread between seeds of one mode. Writes ``bench/results/async_curves.{md,json,png}``.

    python bench/async_curves.py --seeds 1,2,3 --lock /tmp/verl-heavy.lock [extra verl run overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from machine import cpu_name  # noqa: E402

MODES = {"sync": ["trainer.mode='sync'"],
         # With its default, algorithm.rollout_is_cap=2.0: truncated importance weights for the stale samples.
         "colocate_async": ["trainer.mode='colocate_async'", "trainer.max_staleness=1"],
         "colocate_async, no IS": ["trainer.mode='colocate_async'", "trainer.max_staleness=1",
                                   "algorithm.rollout_is_cap=0"],
         # Issue 19's bf16 question: does the curve hold with the training forwards under bf16 autocast?
         "sync bf16-autocast": ["trainer.mode='sync'", "backend.autocast='bfloat16'", "rollout.autocast='bfloat16'"],
         "colocate_async bf16-autocast": ["trainer.mode='colocate_async'", "trainer.max_staleness=1",
                                          "backend.autocast='bfloat16'", "rollout.autocast='bfloat16'"]}


def run(mode: str, seed: int, steps: int, lock: str, extra: list[str], out: Path,
        overrides: list[str] | None = None) -> dict:
    """One ``verl run`` of ``mode`` (its overrides: ``MODES[mode]`` unless given) in a fresh process."""
    cmd = [sys.executable, "-m", "verl_cli", "run", "--output-dir", str(out),
           *(MODES[mode] if overrides is None else overrides), f"run.seed={seed}",
           f"run.max_steps={steps}", "run.resume='never'", *extra]
    if lock:
        cmd = ["flock", lock, *cmd]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"mode": mode, "seed": seed, "error": proc.stderr[-3000:]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = {int(r["step"]): r["val/reward_mean"] for r in rows if "val/reward_mean" in r}
    train = {int(r["step"]): r["reward/mean"] for r in rows if "reward/mean" in r}
    secs = [r["timing/step"] for r in rows if "timing/step" in r]
    return {"mode": mode, "seed": seed, "val": val, "train": train, "wall_s": wall,
            "median_step_s": statistics.median(secs) if secs else None}


def smooth(xs: list[float], k: int = 10) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def report(state: dict) -> None:
    runs = [r for r in state["runs"] if "val" in r]
    seeds = sorted({r["seed"] for r in runs})
    lines = ["# Reward curves: colocate_async vs sync over the same samples", "",
             f"The README's default run (built-in arithmetic task, GRPO, {state['steps']} steps, the same samples per "
             f"step in every mode), `trainer.mode='sync'` vs `trainer.mode='colocate_async'` with "
             f"`trainer.max_staleness=1` (the HF producer in a process of its own; its default "
             f"`algorithm.rollout_is_cap=2.0` weighs the stale samples), and the same without that correction "
             f"(`colocate_async, no IS`: `algorithm.rollout_is_cap=0`), seeds {seeds}. CPU: "
             f"{state['cpu']}, 2 cores (shared with other work). Command: `{state['command']}`; date {state['date']}.",
             *(["", "`bf16-autocast` rows: the same modes with `backend.autocast='bfloat16'` and "
                    "`rollout.autocast='bfloat16'` (training forwards and generation under bf16 autocast; weights, "
                    "gradients and optimizer state in float32)."]
               if any("bf16" in r["mode"] for r in runs) else []),
             "", "Greedy test accuracy (`val/reward_mean`) by step, per seed:", "",
             "| mode | seed | " + " | ".join(f"step {s}" for s in sorted(runs[0]["val"], key=int)) + " | median s/step |",
             "|---|---|" + "---|" * (len(runs[0]["val"]) + 1)]
    for r in sorted(runs, key=lambda r: (r["mode"], r["seed"])):
        vals = [r["val"][s] for s in sorted(r["val"], key=int)]
        lines.append(f"| {r['mode']} | {r['seed']} | " + " | ".join(f"{v:.3f}" for v in vals)
                     + f" | {r['median_step_s']:.2f} |")
    final = {m: [r["val"][max(r["val"], key=int)] for r in runs if r["mode"] == m] for m in MODES}
    gain = {m: [r["val"][max(r["val"], key=int)] - r["val"][min(r["val"], key=int)] for r in runs if r["mode"] == m]
            for m in MODES}
    lines += ["", "| mode | final accuracy, mean [min-max] over seeds | gain over the run, mean [min-max] |",
              "|---|---|---|"]
    for m in MODES:
        if final[m]:
            lines.append(f"| {m} | {statistics.fmean(final[m]):.3f} [{min(final[m]):.3f}-{max(final[m]):.3f}] | "
                         f"{statistics.fmean(gain[m]):+.3f} [{min(gain[m]):+.3f}-{max(gain[m]):+.3f}] |")
    for m in MODES:
        if m == "sync" or not final[m] or not final["sync"]:
            continue
        diff = statistics.fmean(final[m]) - statistics.fmean(final["sync"])
        overlap = min(final[m]) <= max(final["sync"]) and min(final["sync"]) <= max(final[m])
        lines += ["", f"{m} - sync, final accuracy: {diff:+.3f} (means over seeds); the two ranges over seeds "
                      f"{'overlap' if overlap else 'do not overlap'}: "
                      f"{'within noise' if overlap else 'not within noise'}."]
    if state.get("relabelled"):
        lines += ["", state["relabelled"]]
    lines += ["", "Raw data: `async_curves.json`; plot: `async_curves.png` (test accuracy, and the training reward "
                  "smoothed over 10 steps, against samples trained)."]
    stem = state.get("stem", "async_curves")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines).replace("async_curves.", f"{stem}.") + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"sync": "tab:blue", "colocate_async": "tab:green", "colocate_async, no IS": "tab:orange",
               "sync bf16-autocast": "tab:purple", "colocate_async bf16-autocast": "tab:red"}
    per_step = state.get("samples_per_step", 1)
    for r in runs:
        steps = sorted(r["val"], key=int)
        a.plot([int(s) * per_step for s in steps], [r["val"][s] for s in steps], color=colours[r["mode"]],
               alpha=0.8, label=f"{r['mode']} seed {r['seed']}")
        ts = sorted(r["train"], key=int)
        b.plot([int(s) * per_step for s in ts], smooth([r["train"][s] for s in ts]), color=colours[r["mode"]],
               alpha=0.8)
    a.set(xlabel="samples trained", ylabel="val/reward_mean (greedy)", title="test accuracy")
    b.set(xlabel="samples trained", ylabel="reward/mean (10-step mean)", title="training reward")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lock", default="")
    ap.add_argument("--modes", default=";".join(MODES), help="';'-separated modes (names have commas)")
    ap.add_argument("--resume", action="store_true", help="keep the runs already in the results JSON")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--results", default="async_curves", help="name of the results files under bench/results/")
    args, extra = ap.parse_known_args()
    path = RESULTS / f"{args.results}.json"
    if args.report_only:
        report(json.loads(path.read_text()))
        return
    state = {"steps": args.steps, "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"),
             "python": platform.python_version(), "command": "python bench/async_curves.py " + " ".join(sys.argv[1:]),
             "runs": [], "stem": args.results}
    if args.resume and path.is_file():
        old = json.loads(path.read_text())
        state["runs"], state["samples_per_step"] = old["runs"], old.get("samples_per_step", 1)
        state["command"] = old["command"] + "; then " + state["command"]
    done = {(r["mode"], r["seed"]) for r in state["runs"] if "val" in r}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for mode in args.modes.split(";"):  # alternated, so that machine drift hits all
                if (mode, seed) in done:
                    continue
                result = run(mode, seed, args.steps, args.lock, extra, Path(tmp) / f"{mode}-{seed}")
                print(mode, seed, {k: v for k, v in result.items() if k in ("val", "error", "median_step_s")},
                      flush=True)
                state["runs"].append(result)
                if "val" in result and "samples_per_step" not in state:
                    cfg = (Path(tmp) / f"{mode}-{seed}" / "config.toml").read_text()
                    state["samples_per_step"] = _samples_per_step(cfg)
                path.write_text(json.dumps(state, indent=1))
    report(state)


def _samples_per_step(config_toml: str) -> int:
    import tomllib

    cfg = tomllib.loads(config_toml)
    return int(cfg["data"]["batch_size"]) * int(cfg["rollout"]["n"])


if __name__ == "__main__":
    main()
