"""The built-in default run (`verl run`, no flags): does it learn, and how long does it take?

Runs the real CLI with a fresh model cache (so the warm start is built and timed too) and records
greedy test accuracy (`val/reward_mean`) before training, at every validation and after the last
step, plus wall time. Writes bench/results/default_run.md (and default_run.png when matplotlib is
installed).

    python bench/default_run.py [extra verl run arguments...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    extra = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "VERL_CACHE_DIR": str(Path(tmp) / "cache")}
        out = Path(tmp) / "run"
        start = time.perf_counter()
        build = subprocess.run([sys.executable, "-c", "from verl_task_arithmetic.addition import ensure_builtin_model;"
                                "print(ensure_builtin_model())"], env=env, check=True, capture_output=True, text=True)
        build_s = time.perf_counter() - start
        model_dir = Path(build.stdout.strip().splitlines()[-1])
        warm = json.loads((model_dir / "warm_start.json").read_text())
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "verl_cli", "run", "--output-dir", str(out), *extra],
                              env=env, capture_output=True, text=True)
        run_s = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"verl run failed:\n{proc.stderr[-4000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        config = (out / "config.toml").read_text()
    val = [(r["step"], r["val/reward_mean"]) for r in rows if "val/reward_mean" in r]
    train = [r for r in rows if "reward/mean" in r]
    first, last = val[0][1], val[-1][1]
    step_times = sorted(r["timing/step"] for r in train)
    lines = [
        "# Default run: `verl run` with no flags",
        "",
        f"Command: `python bench/default_run.py {' '.join(extra)}`; date {time.strftime('%Y-%m-%d %H:%M')}; "
        f"{os.cpu_count()} CPU cores; torch threads per the run's default.",
        "",
        f"- Built-in model build + supervised warm start: {build_s:.0f} s (warm-start greedy test accuracy "
        f"{warm['greedy_test_accuracy']:.3f})",
        f"- RL run (`verl run`): {run_s:.0f} s wall for {len(train)} GRPO steps "
        f"(median {step_times[len(step_times) // 2]:.2f} s/step), validation included",
        f"- Greedy test accuracy (val/reward_mean): {first:.3f} before RL -> {last:.3f} after "
        f"({(last - first) * 100:+.1f} points)",
        "",
        "| step | val/reward_mean |",
        "|---|---|",
        *[f"| {s} | {v:.3f} |" for s, v in val],
        "",
        "| step | reward/mean (train samples) | s/step |",
        "|---|---|---|",
        *[f"| {r['step']} | {r['reward/mean']:.3f} | {r['timing/step']:.2f} |" for r in train],
        "",
        "Resolved config:",
        "",
        "```toml",
        config.strip(),
        "```",
    ]
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / "default_run.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:9]))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in val], [v for _, v in val], marker="o", label="greedy test accuracy")
    ax.plot([r["step"] for r in train], [r["reward/mean"] for r in train], alpha=0.6, label="train reward (sampled)")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("verl run (default): GRPO on two-digit addition")
    fig.tight_layout()
    fig.savefig(results / "default_run.png", dpi=120)


if __name__ == "__main__":
    main()
