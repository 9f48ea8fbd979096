"""Multi-turn trajectories per second on the tool task, by how many run at once.

The built-in tool task's model (``builtin:tiny-qwen2-tools``) with the HF rollout, sampling at
temperature 1, 2 turns. Its calculator calls are answered by running the expression in the Python
sandbox (one short-lived, limited process per call, ~40 ms: a realistic tool latency) instead of the
in-process calculator, so that tool execution costs something. For 1, 8 and 32 trajectories per
batch, the loop runs with its environment steps on a thread pool (``environment.concurrency``: the
tool calls of a round overlap) and, as the floor it is compared against, one at a time
(``concurrency = 1``). Rounds are interleaved; medians are reported.

The learning curves of ``verl run --env tools`` with and without the calculator come from
``--curves RUN_WITH RUN_WITHOUT`` (two run directories), plotted to
``bench/results/agent_loop_curves.png``.

Run: ``python bench/agent_loop.py`` (about 2 minutes) -> bench/results/agent_loop.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from machine import cpu_name  # bench/machine.py (bench/ is the script's directory)

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _sandboxed_env():
    from verl_env_tools.env import ToolsEnvironment
    from verl_env_tools.sandbox import SandboxLimits, run_python
    from verl_env_tools.tools import Tool, ToolError

    def calculate_in_sandbox(arguments, config):
        result = run_python(f"print({arguments.get('expression', '')!s})", SandboxLimits(wall_s=5.0))
        if not result.ok:
            raise ToolError(result.error)
        return result.output.strip()

    class SandboxedCalculator(ToolsEnvironment):
        def __init__(self, config=None):
            super().__init__(config)
            base = self._tools["calculator"]
            self._tools["calculator"] = Tool(base.name, base.description, base.parameters, calculate_in_sandbox)

    return SandboxedCalculator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--curves", nargs=2, metavar=("WITH_TOOLS", "WITHOUT_TOOLS"))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "agent_loop.md"))
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    from verl_core.contracts import ModelSpec, SamplingParams
    from verl_env_tools.env import ToolsConfig
    from verl_env_tools.task import ensure_model, make_dataset
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    torch.set_num_threads(1)
    path = str(ensure_model())
    tok = AutoTokenizer.from_pretrained(path)
    engine = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=path), tokenizer=tok)
    env_cls = _sandboxed_env()
    _, test = make_dataset()
    rows = [{**r, "prompt_messages": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in test]
    sampling = SamplingParams(n=1, max_new_tokens=24, seed=0)  # the task preset's rollout.max_new_tokens
    results: dict[tuple[int, int], list[float]] = {}
    calls: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for size in (1, 8, 32):
            for concurrency in (size, 1):
                config = ToolsConfig(concurrency=concurrency)
                metrics: dict[str, float] = {}
                start = time.perf_counter()
                env_cls.run_episodes(engine, rows[:size], sampling, lambda: env_cls(config), config,
                                     pad_id=tok.pad_token_id, metrics=metrics)
                seconds = time.perf_counter() - start
                results.setdefault((size, concurrency), []).append(size / seconds)
                calls.setdefault((size, concurrency), []).append(metrics["env/turns_mean"])
    lines = ["# Agent loop: trajectories per second on the tool task", "",
             f"`python bench/agent_loop.py` on {cpu_name()} ({os.cpu_count()} cores), 1 torch thread, HF rollout, "
             f"{time.strftime('%Y-%m-%d')}. Calculator calls run in the Python sandbox (one process per call). "
             f"Median of {args.rounds} interleaved rounds.", "",
             "| trajectories at once | env steps in parallel | trajectories/s | vs one step at a time | turns/trajectory |",
             "|---|---|---|---|---|"]
    for size in (1, 8, 32):
        floor = statistics.median(results[(size, 1)])
        for concurrency in sorted({size, 1}, reverse=True):
            tps = statistics.median(results[(size, concurrency)])
            lines.append(f"| {size} | {concurrency} | {tps:.2f} | {tps / floor:.2f}x | "
                         f"{statistics.median(calls[(size, concurrency)]):.2f} |")
    if args.curves:
        lines += ["", _curves(*args.curves, Path(args.out).with_name("agent_loop_curves.png"))]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _curves(with_tools: str, without_tools: str, png: Path) -> str:
    try:
        import matplotlib
    except ImportError:  # the table still gets written; the plot needs the bench extra
        matplotlib = None

    out = ["Greedy validation accuracy (`val/reward_mean`) by step:", "", "| run | ", "|---|"]
    table = {}
    for label, run in (("with the calculator", with_tools), ("without tools", without_tools)):
        rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
        points = [(r["step"], r["val/reward_mean"]) for r in rows if "val/reward_mean" in r]
        table[label] = points
    if matplotlib is not None:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, points in table.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("greedy accuracy")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=120)
    steps = sorted({s for points in table.values() for s, _ in points})
    out[2] = "| run | " + " | ".join(str(s) for s in steps) + " |"
    out[3] = "|---|" + "---|" * len(steps)
    for label, points in table.items():
        values = dict(points)
        out.append(f"| {label} | " + " | ".join(f"{values[s]:.3f}" if s in values else "" for s in steps) + " |")
    if matplotlib is not None:
        out += ["", f"![curves]({png.name})"]
    return "\n".join(out)


if __name__ == "__main__":
    main()
