"""How far a rollout engine's log-probs sit from the trainer's, with a good and a broken weight sync.

The measurement behind ``rollout.max_log_prob_gap``'s default. GRPO on the built-in task (the
default ``verl run`` settings), with the guard set to ``warn`` so every step's gap is recorded:

* ``hf``: the HF rollout on the actor's own module (no sync at all: the gap is the floor);
* ``vllm``: vLLM with the in-place weight sync every step;
* ``vllm, one tensor zeroed``: from the sync after step 2 on (step 3 samples from it), one tensor (``--tensor``) arrives as
  zeros, the silent corruption users report;
* ``vllm, one tensor scaled x1.1``: a milder corruption of the same tensor;
* ``vllm, stale``: the syncs after step 2 never reach the engine (it keeps sampling step 2's policy).

Each case runs ``--steps`` steps in a fresh run directory; the table gives the mean gap per token
(``rollout/log_prob_diff_mean``) before and after the fault. Run: ``python bench/weight_sync_guard.py``
(needs verl-rollout-vllm with vLLM installed; about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any, Callable

from machine import cpu_name  # bench/machine.py (bench/ is the script's directory)

FAULT_AFTER = 2  # the sync after this step is the first broken one; step FAULT_AFTER + 1 samples from it


def run_case(rollout: str, steps: int, fault: Callable[[Any], None] | None) -> list[float]:
    """Per-step mean gaps of one run; ``fault(trainer)`` breaks the sync after FAULT_AFTER steps."""
    from verl_core.trainer import Trainer

    out = Path(tempfile.mkdtemp(prefix="wsg-"))
    overrides = [f"rollout.name={json.dumps(rollout)}", f"run.max_steps={steps}", f"run.output_dir={json.dumps(str(out))}",
                 "run.val_before_train=false", "run.val_every=0", "run.save_every=0", "run.loggers=[\"jsonl\"]",
                 "rollout.log_prob_gap_action=\"warn\""]
    if rollout == "vllm":
        overrides += ["rollout.kv_cache_gb=0.25", "rollout.max_model_len=64"]
    trainer = Trainer.from_config(overrides=overrides)
    trainer.setup()
    trainer.val_rows = []
    if fault is not None:
        from verl_core.hooks import hookimpl

        class Breaker:
            @hookimpl
            def verl_step_start(self, step: int) -> None:
                if step == FAULT_AFTER:  # this step's closing sync is the first broken one
                    fault(trainer)

        trainer.hooks.register(Breaker())
    trainer.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["rollout/log_prob_diff_mean"] for r in rows if "rollout/log_prob_diff_mean" in r]


def corrupt(tensor_name: str, how: Callable[[Any], Any]) -> Callable[[Any], None]:
    def fault(trainer: Any) -> None:
        worker = trainer.actor.worker
        original = worker.iter_weights

        def iter_weights():
            for name, tensor in original():
                yield name, (how(tensor) if name == tensor_name else tensor)

        worker.iter_weights = iter_weights

    return fault


def stale(trainer: Any) -> None:
    trainer.rollout.load_weights = lambda weights: None  # the engine keeps what it has


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tensor", default="model.layers.0.mlp.down_proj.weight")
    parser.add_argument("--results", default=str(Path(__file__).parent / "results" / "weight_sync_guard.md"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    cases = {
        "hf (shares the actor's module)": ("hf", None),
        "vllm, in-place sync": ("vllm", None),
        f"vllm, {args.tensor} zeroed": ("vllm", corrupt(args.tensor, lambda t: torch.zeros_like(t))),
        f"vllm, {args.tensor} scaled x1.1": ("vllm", corrupt(args.tensor, lambda t: t * 1.1)),
        "vllm, stale (syncs dropped)": ("vllm", stale),
    }
    lines = [f"# Weight-sync guard: trainer vs engine log-prob gap ({cpu_name()})", "",
             f"`python bench/weight_sync_guard.py --steps {args.steps}`: GRPO on the built-in task, fp32, "
             f"mean |trainer - engine| log-prob per response token each step. Faults start with the sync "
             f"after step {FAULT_AFTER} (so step {FAULT_AFTER + 1} is the first step sampled from broken weights).",
             "", "| case | gap per step | max before fault | min after fault |",
             "|---|---|---|---|"]
    for label, (rollout, fault) in cases.items():
        gaps = run_case(rollout, args.steps, fault)
        before = gaps[:FAULT_AFTER] if fault else gaps
        after = gaps[FAULT_AFTER:] if fault else []
        cells = ", ".join(f"{g:.2e}" for g in gaps)
        lines.append(f"| {label} | {cells} | {max(before):.2e} | {min(after):.2e} |" if after else
                     f"| {label} | {cells} | {max(before):.2e} | - |")
        print(lines[-1], flush=True)
    Path(args.results).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
