"""Learning check: every RL algorithm on the built-in addition task, same budget, same warm start.

Each algorithm runs the real ``verl run --algo NAME`` for the same number of steps with the same
prompts per step and samples per prompt (so the same number of sampled responses; DAPO's extra
resampling rounds and ReMax's greedy baselines are counted separately), from the same warm-started
model (one shared cache) and seed. Greedy test accuracy (``val/reward_mean``) is measured before
the first step and after the last, on the task's whole held-out test split.

With ``--offline``, DPO, KTO and ORPO also run, for the same number of steps and prompts per step,
on preference pairs derived from the task's training split (chosen = the right sum, rejected = a
near miss) - a different kind of signal, reported in its own table.

Writes ``bench/results/algorithms.md`` (and the raw numbers to ``algorithms.json``; ``--output``
changes the name)::

    python bench/algorithms.py [--steps 60] [--algorithms grpo dapo ...] [--offline] [key=value ...]

Each run holds ``/tmp/verl-heavy.lock`` (``--lock``) while it trains, so other heavy jobs on a
shared machine interleave between runs instead of slowing them down.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

RL_ALGORITHMS = ["grpo", "ppo", "dapo", "drgrpo", "gspo", "cispo", "clip_cov", "kl_cov", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                 "remax", "gpg", "opo", "spin"]
OFFLINE_ALGORITHMS = ["dpo", "kto", "orpo"]
RESULTS = Path(__file__).parent / "results"


@contextlib.contextmanager
def heavy_lock(path: str) -> Iterator[None]:
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_one(name: str, *, steps: int, workdir: Path, env: dict[str, str], overrides: list[str], lock: str,
            data: Path | None) -> dict[str, Any]:
    out = workdir / name
    cmd = [sys.executable, "-m", "verl_cli", "run", "--algo", name, "--output-dir", str(out),
           "--max-steps", str(steps), "--resume", "never", "run.val_every=0", "run.save_every=0",
           "run.loggers=[\"jsonl\"]"]
    if data is not None:
        cmd += ["--data", str(data), 'data.val="builtin:addition"']
    cmd += overrides
    with heavy_lock(lock):
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"name": name, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed",
                "wall_s": wall}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/reward_mean"] for r in rows if "val/reward_mean" in r]
    train = [r for r in rows if "ppo/actor_loss" in r]
    generated = sum(r.get("dynamic_sampling/generated_samples", 0.0) for r in train)
    return {
        "name": name,
        "val_before": val[0],
        "val_after": val[-1],
        "wall_s": wall,
        "train_s": sum(r["timing/step"] for r in train),
        "steps": len(train),
        "extra_generated": generated,
        "greedy_baselines": sum(1 for r in train if "baseline/greedy_reward_mean" in r),
        "reward_first": train[0].get("reward/mean"),
        "reward_last": train[-1].get("reward/mean"),
        "reward_last10": (sum(r.get("reward/mean", 0.0) for r in train[-10:]) / len(train[-10:]))
        if train and "reward/mean" in train[-1] else None,
    }


def markdown(results: list[dict[str, Any]], offline: list[dict[str, Any]], *, args: argparse.Namespace,
             prompts: int, n: int, warm: dict[str, Any]) -> str:
    def row(r: dict[str, Any]) -> str:
        if "error" in r:
            return f"| `{r['name']}` | failed: {r['error']} | | | | |"
        delta = (r["val_after"] - r["val_before"]) * 100
        extra = []
        if r["extra_generated"]:
            extra.append(f"{int(r['extra_generated']) - r['steps'] * prompts * n} extra resampled")
        if r["greedy_baselines"]:
            extra.append(f"+{r['greedy_baselines'] * prompts} greedy")
        reward = "" if r["reward_last10"] is None else f"{r['reward_first']:.3f} -> {r['reward_last10']:.3f}"
        return (f"| `{r['name']}` | {r['val_before']:.3f} | {r['val_after']:.3f} | {delta:+.1f} | {reward} | "
                f"{r['wall_s']:.0f} s ({r['train_s']:.0f} s training) | {', '.join(extra)} |")

    header = ["| algorithm | val before | val after | change (points) | train reward (step 1 -> mean of last 10) "
              "| wall time | extra generation |", "|---|---|---|---|---|---|---|"]
    lines = [
        "# Learning check: every RL algorithm on the built-in addition task",
        "",
        f"Command: `python bench/algorithms.py {' '.join(sys.argv[1:])}`; {time.strftime('%Y-%m-%d %H:%M')}; "
        f"{os.cpu_count()} CPU cores, 1 torch thread per run, runs one after another.",
        "",
        f"Same for every algorithm: the built-in tiny Qwen2 warm-started to {warm.get('greedy_test_accuracy', 0):.3f} "
        f"greedy test accuracy (one cache, seed {_seed(args.overrides)}), {args.steps} steps x {prompts} prompts x {n} samples = "
        f"{args.steps * prompts * n} sampled responses, the built-in preset (lr 1e-4, 4 new tokens), each "
        f"algorithm's own defaults otherwise. Val = greedy accuracy on the whole held-out test split "
        f"(`val/reward_mean`), before the first and after the last step. Wall time includes model loading "
        f"and both validations.",
        "",
        *header,
        *[row(r) for r in results],
    ]
    if offline:
        lines += [
            "",
            "## Offline preference algorithms",
            "",
            f"Trained on {args.pairs} preference pairs from the task's training split (chosen = the sum, rejected "
            f"= a near miss), {args.steps} steps x {prompts} pairs, validated like the RL runs.",
            "",
            *header,
            *[row(r) for r in offline],
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--algorithms", nargs="+", default=RL_ALGORITHMS)
    parser.add_argument("--offline", action="store_true", help="also run DPO, KTO and ORPO on addition pairs")
    parser.add_argument("--pairs", type=int, default=4000, help="preference pairs for --offline")
    parser.add_argument("--lock", default="/tmp/verl-heavy.lock", help="flock file held during each run ('' = none)")
    parser.add_argument("--cache", default="", help="verl cache dir (default: a fresh temporary one)")
    parser.add_argument("--output", default="algorithms", help="basename of the result files in bench/results")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        env = {**os.environ, "VERL_CACHE_DIR": args.cache or str(workdir / "cache"), "OMP_NUM_THREADS": "1"}
        overrides = ["run.threads=1", *args.overrides]
        with heavy_lock(args.lock):
            build = subprocess.run([sys.executable, "-c", "from verl_task_arithmetic.addition import "
                                    "ensure_builtin_model; print(ensure_builtin_model())"], env=env, check=True,
                                   capture_output=True, text=True)
        warm = json.loads((Path(build.stdout.strip().splitlines()[-1]) / "warm_start.json").read_text())
        shown = subprocess.run([sys.executable, "-m", "verl_cli", "config", "show", *overrides], env=env,
                               check=True, capture_output=True, text=True).stdout
        prompts = int(_value(shown, "data", "batch_size"))
        n = int(_value(shown, "rollout", "n"))

        results, offline = [], []
        for name in args.algorithms:
            results.append(run_one(name, steps=args.steps, workdir=workdir, env=env, overrides=overrides,
                                   lock=args.lock, data=None))
            print(json.dumps(results[-1]), flush=True)
        if args.offline:
            from verl_algo_contrib.data import write_addition_preferences

            pairs = write_addition_preferences(workdir / "pairs.jsonl", rows=args.pairs)
            for name in OFFLINE_ALGORITHMS:
                offline.append(run_one(name, steps=args.steps, workdir=workdir, env=env, overrides=overrides,
                                       lock=args.lock, data=pairs))
                print(json.dumps(offline[-1]), flush=True)

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.output}.json").write_text(json.dumps({"rl": results, "offline": offline, "warm_start": warm,
                                                         "args": vars(args)}, indent=1) + "\n")
    text = markdown(results, offline, args=args, prompts=prompts, n=n, warm=warm)
    (RESULTS / f"{args.output}.md").write_text(text)
    print(text)


def _seed(overrides: list[str]) -> str:
    seeds = [o.split("=", 1)[1] for o in overrides if o.startswith("run.seed=")]
    return seeds[-1] if seeds else "1"


def _value(toml_text: str, section: str, key: str) -> str:
    current = None
    for line in toml_text.splitlines():
        if line.startswith("["):
            current = line.strip("[] ")
        elif current == section and line.split("=")[0].strip() == key:
            return line.split("=", 1)[1].strip()
    raise KeyError(f"{section}.{key} not in the resolved config")


if __name__ == "__main__":
    main()
