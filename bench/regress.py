"""The pre-merge check for performance work: our per-step overhead over the raw floor, paired by round.

Runs ``bench/trl_comparison.py``'s small workload (0.5M-parameter Qwen2, 8 prompts x 8 samples,
8 new tokens, one thread) for two configurations only, alternated over rounds in fresh processes:
``ours-hf`` (the sync trainer, FSDP backend, HF rollout) and ``floor-hf`` (the same generate, score and
one forward/backward/AdamW step in plain PyTorch). The figure is the median over rounds of each round's
``ours / floor`` step-time ratio: machine speed cancels out, framework overhead does not.

It fails (exit 1) when that ratio grew by more than 25% over the recorded one in
``bench/results/regress.json`` (the ratio, not ``ratio - 1``: ours can be faster than this floor, whose
``model.generate`` prefills every sample's prompt, so the overhead can be negative); ``--record`` writes
the recorded value instead. About 1.5 minutes on 2 cores. It is not run in CI, whose machines and load
vary: run it before merging performance work, on a quiet machine::

    python bench/regress.py [--rounds 5] [--record]
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
sys.path.insert(0, str(HERE))
from machine import cpu_name  # noqa: E402 - bench/machine.py

RECORD = HERE / "results" / "regress.json"
#: How much the overhead over the floor may grow before the check fails.
TOLERANCE = 0.25


def measure(rounds: int, steps: int) -> list[float]:
    """Per round, ours / floor step time (``trl_comparison.paired``)."""
    import trl_comparison

    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "regress.json"
        subprocess.run([sys.executable, str(HERE / "trl_comparison.py"), "--workload", "small", "--max-new-tokens",
                        "8", "--only", "ours-hf,floor-hf", "--rounds", str(rounds), "--steps", str(steps),
                        "--results", str(results)], check=True, capture_output=True, text=True)
        state = json.loads(results.read_text())
    errors = [r for r in state["runs"] if "error" in r]
    if errors:
        raise SystemExit(f"a configuration failed: {errors[0]['config']}: {errors[0]['error']}\n"
                         f"{errors[0].get('traceback', '')[-2000:]}")
    return trl_comparison.paired(state, "floor-hf", "ours-hf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="RL steps per run (the first is left out)")
    ap.add_argument("--record", action="store_true", help="record this run's figure as the reference")
    args = ap.parse_args()
    ratios = measure(args.rounds, args.steps)
    ratio = statistics.median(ratios)
    line = f"ours / floor step time: {ratio:.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios)}) on {cpu_name()}"
    print(line)
    if args.record:
        RECORD.write_text(json.dumps({"ratio": ratio, "rounds": ratios, "cpu": cpu_name(),
                                      "tolerance": TOLERANCE}, indent=2) + "\n")
        print(f"recorded in {RECORD}")
        return
    recorded = json.loads(RECORD.read_text())["ratio"]
    limit = recorded * (1 + TOLERANCE)
    print(f"recorded {recorded:.3f}; the ratio may grow to {limit:.3f}")
    if ratio > limit:
        raise SystemExit(f"our step against the floor's grew: {ratio:.3f} > {limit:.3f} (recorded {recorded:.3f} "
                         f"+ 25%); profile a step (bench/probes.py) before merging")


if __name__ == "__main__":
    main()
