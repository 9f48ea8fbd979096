"""Controller overhead per RL step: dispatch, serialisation and gather against the compute they drive.

GRPO on the built-in task with its default batch (64 prompts x 8 samples, 4 new tokens), run
through the Python API at world size 1 in-process (the local executor) and world size 2 on a local
Ray instance (the Ray executor, colocated hybrid engine: the HF rollout runs inside the two FSDP
actor processes). Each step's wall time is split into

- worker compute: time inside worker and rollout-engine methods (per call, the slowest rank);
- executor overhead: the rest of each worker call: cutting the batch into shards, pickling and
  putting arguments into Ray's object store, scheduling, fetching and joining results. In-process
  a call is a plain method call, so this is 0 by construction;
- controller work: what the controller computes itself (rewards, advantages, building the batch).

Validation and checkpoints are left out. Writes bench/results/controller_overhead.md.

    python bench/controller_overhead.py [--steps 8] [--warmup 2]
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
from typing import Any

COMMON = ["run.val_before_train=false", "run.val_every=0", "run.loggers=[]", "run.save_every=0"]
CONFIGS = {
    "local": ["executor.name=\"local\""],
    "ray": ["executor.name=\"ray\"", "executor.world_size=2"],
    "ray-split": ["executor.name=\"ray\"", "executor.world_size=2", "executor.pools={gen=1}",
                  "executor.placement={rollout=\"gen\"}"],
}
RESULTS = Path(__file__).parent / "results" / "controller_overhead.md"


class _Timed:
    """Wraps an object so that time spent inside its methods is added up (in-process workers)."""

    def __init__(self, target: Any, clock: list[float]) -> None:
        self._target, self._clock = target, clock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self._clock[0] += time.perf_counter() - start

        return timed


def child(name: str, steps: int, warmup: int) -> None:
    from verl_core.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer.from_config(overrides=[*COMMON, *CONFIGS[name], f"run.output_dir={str(Path(tmp))!r}",
                                                 f"run.max_steps={steps + warmup}"])
        start = time.perf_counter()
        trainer.setup()
        setup_s = time.perf_counter() - start
        clock = [0.0]
        stats = getattr(trainer.executor, "stats", None)
        if stats is None:
            # In-process: time the worker's methods and the engine's generate where they are called.
            trainer.actor.worker = _Timed(trainer.actor.worker, clock)
            generate = trainer.rollout.generate

            def timed_generate(*args: Any, **kwargs: Any) -> Any:
                # generate enters the actor's generation_module() (timed above as a near-zero
                # call that only builds the context manager), so nothing is counted twice.
                t = time.perf_counter()
                try:
                    return generate(*args, **kwargs)
                finally:
                    clock[0] += time.perf_counter() - t

            trainer.rollout.generate = timed_generate
        rows = []
        try:
            for i in range(steps + warmup):
                trainer.step += 1
                before = (stats.wall_s, stats.worker_s, stats.dispatch_s, stats.gather_s, stats.calls) if stats else None
                clock[0] = 0.0
                metrics = trainer.run_step()
                step_s = metrics["timing/step"]
                if stats:
                    wall, worker, dispatch, gather, calls = (a - b for a, b in zip(
                        (stats.wall_s, stats.worker_s, stats.dispatch_s, stats.gather_s, stats.calls), before))
                    row = dict(step_s=step_s, compute_s=worker, overhead_s=wall - worker, dispatch_s=dispatch,
                               gather_s=gather, calls=calls)
                else:
                    row = dict(step_s=step_s, compute_s=clock[0], overhead_s=0.0, dispatch_s=0.0, gather_s=0.0,
                               calls=0)
                row["controller_s"] = step_s - row["compute_s"] - row["overhead_s"]
                row["reward"] = metrics.get("reward/mean", 0.0)
                if i >= warmup:
                    rows.append(row)
            by_method = {k: v for k, v in stats.by_method.items()} if stats else {}
        finally:
            trainer.executor.shutdown()
    print("RESULT " + json.dumps({"setup_s": setup_s, "steps": rows, "by_method": by_method,
                                  "threads": os.environ.get("OMP_NUM_THREADS", "")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--child", choices=sorted(CONFIGS))
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.warmup)
        return
    results = {}
    for name in CONFIGS:
        proc = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(args.steps), "--warmup",
                               str(args.warmup)], capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
        results[name] = json.loads(line[len("RESULT "):])
    write_report(results, args)


def write_report(results: dict[str, Any], args: argparse.Namespace) -> None:
    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    lines = [
        "# Controller overhead per RL step (Ray executor vs in-process)",
        "",
        f"Command: `python bench/controller_overhead.py --steps {args.steps} --warmup {args.warmup}`; "
        f"date {time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPU cores, no GPU.",
        "",
        "GRPO on the built-in task, default batch (64 prompts x 8 samples = 512 responses, 4 new tokens), FSDP "
        "backend, HF rollout; validation and checkpoints excluded. Medians over the measured steps (after "
        f"{args.warmup} warm-up steps).",
        "",
        "| configuration | step (s) | worker compute (s) | executor overhead (s) | of which dispatch / gather (s) "
        "| overhead / step | controller work (s) | executor calls / step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    labels = {"local": "world size 1, in-process (local executor)",
              "ray": "world size 2, Ray, colocated (2 actor processes host the rollout)",
              "ray-split": "world size 2, Ray, split (rollout on a 3rd process, weights sent every step)"}
    for name, res in results.items():
        rows = res["steps"]
        step, over = med(rows, "step_s"), med(rows, "overhead_s")
        lines.append(f"| {labels[name]} | {step:.3f} | {med(rows, 'compute_s'):.3f} | {over:.4f} | "
                     f"{med(rows, 'dispatch_s'):.4f} / {med(rows, 'gather_s'):.4f} | {100 * over / step:.2f}% | "
                     f"{med(rows, 'controller_s'):.3f} | {med(rows, 'calls'):.0f} |")
    for name, res in results.items():
        if not res["by_method"]:
            continue
        lines += ["", f"{labels[name]}: per worker call, over the warm-up and measured steps:", "",
                  "| call | count | wall (s) | in worker (s) | overhead per call (ms) |", "|---|---|---|---|---|"]
        for what, (count, wall, worker) in sorted(res["by_method"].items()):
            lines.append(f"| {what} | {count} | {wall:.3f} | {worker:.3f} | {1000 * (wall - worker) / count:.1f} |")
    lines += ["", "Set-up (process start, model load, Ray start) is not in the step times: "
              + ", ".join(f"{name} {res['setup_s']:.1f} s" for name, res in results.items()) + ".", ""]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
