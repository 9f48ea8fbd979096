"""What the overlapping modes' engine check costs per step (``trainer.sync_check_every``, verl-trainer-async).

``verl run`` on the built-in task in ``trainer.mode = "colocate_async"``, the same seed and steps, with the check
off (``sync_check_every = 0``) and on (``1``), alternating within each round so that both see the same machine
state. Per run: the median ``timing/step`` after the first two steps, the gaps the check recorded, and the final
``val/reward_mean`` (the check is greedy and seeds nothing: the runs must learn the same). Reports the on/off step
time ratio per round. Writes ``bench/results/engine_check_cost.md``::

    python bench/engine_check_cost.py [--steps 20] [--rounds 2]
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

RESULTS = Path(__file__).parent / "results" / "engine_check_cost.md"
COMMON = ['run.loggers=["jsonl"]', "run.val_before_train=false", "run.val_every=0", 'trainer.mode="colocate_async"']


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").open() if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def run(steps: int, every: int, out: Path) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "verl_cli", "run", "--max-steps", str(steps), "--output-dir", str(out), *COMMON,
               f"trainer.sync_check_every={every}"]
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    steps_rows = [r for r in rows if "timing/step" in r]
    gaps = [r["rollout/log_prob_diff_mean"] for r in steps_rows if "rollout/log_prob_diff_mean" in r]
    return {"step_s": statistics.median(r["timing/step"] for r in steps_rows[2:]), "checked": float(len(gaps)),
            "max_gap": max(gaps, default=float("nan")),
            "val": [r["val/reward_mean"] for r in rows if "val/reward_mean" in r][-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    lines = ["| round | sync_check_every | median step (s) | steps with a recorded gap | max gap | final val |",
             "|---|---|---|---|---|---|"]
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, args.rounds + 1):
            pair = {}
            for every in (0, 1):
                pair[every] = r = run(args.steps, every, Path(tmp) / f"r{round_}_e{every}")
                lines.append(f"| {round_} | {every} | {r['step_s']:.3f} | {r['checked']:.0f} of {args.steps} | "
                             f"{r['max_gap']:.2e} | {r['val']:.3f} |")
                print(lines[-1], flush=True)
            ratios.append(pair[1]["step_s"] / pair[0]["step_s"])
    text = "\n".join([
        "# The engine check of the overlapping modes: its cost per step", "",
        f"Command: `python bench/engine_check_cost.py --steps {args.steps} --rounds {args.rounds}`; "
        f"{time.strftime('%Y-%m-%d %H:%M')}; {cpu_model()}, {os.cpu_count()} cores.", "",
        f"`verl run` on the built-in task, `trainer.mode=\"colocate_async\"`, {args.steps} steps, with the check off "
        "and on, alternating in each round. The check: after each update, 4 greedy samples of 16 tokens on the "
        "producer's engine and the actor's forward over them.", "", *lines, "",
        "On/off median step time per round: " + ", ".join(f"{x:.2f}" for x in ratios) + ". The step here is a "
        "fraction of a second (a tiny model, 4-token responses), so the check's fixed cost shows at its largest.", ""])
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
