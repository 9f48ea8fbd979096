"""One RL step of the built-in visual task (``verl run --env vision``): time, peak memory, and how many
of the step's tokens are image tokens.

The step is the task's own (32 prompts x 8 samples, ``builtin:tiny-qwen2-vl`` after its warm start):
HF-rollout generation with the images, the trainer's log-prob pass and a policy update through the
whole VLM, on the FSDP backend. Two configurations side by side, each in its own process (its own
peak RSS), alternated over rounds so machine noise hits both alike: the whole VLM trained, and the
vision tower frozen (``backend.freeze_vision_tower``).

    python bench/vision_step.py            # writes bench/results/vision.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import cpu_name  # bench/machine.py (bench/ is the script's directory)

CONFIGS = {"whole VLM trained": {}, "vision tower frozen": {"freeze_vision_tower": True}}
PROMPTS, N, STEPS, WARMUP = 32, 8, 4, 1


def _child(settings: dict, steps: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_core.contracts import ModelSpec, Role, SamplingParams, WorldInfo
    from verl_core.rollout_utils import generate_batch
    from verl_data import load_processor, render_rows
    from verl_env_vision.task import ensure_model, make_dataset
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    path = str(ensure_model())
    tok = AutoTokenizer.from_pretrained(path)
    processor = load_processor(path, tok)
    train, _ = make_dataset()
    rows, _ = render_rows(train[: PROMPTS * (steps + WARMUP)], tok, processor=processor)
    worker = FSDPBackend(FSDPConfig(lr=3e-4, **settings)).create_worker(
        role=Role.ACTOR, model=ModelSpec(path=path), world=WorldInfo(threads=torch.get_num_threads()), seed=0)
    engine = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=path), tokenizer=tok, actor=worker)

    def loss_fn(*, batch, log_probs, entropy=None, values=None):
        loss = -(log_probs * batch.advantages * batch.response_mask).sum() / batch.response_mask.sum()
        return loss, {}

    out = {"generate": [], "log_probs": [], "update": [], "step": []}
    image_token = processor.image_token_id
    tokens = {"image": 0, "text_prompt": 0, "response": 0, "patches": 0}
    for i in range(steps + WARMUP):
        part = rows[i * PROMPTS:(i + 1) * PROMPTS]
        t0 = time.perf_counter()
        batch = generate_batch(engine, part, SamplingParams(n=N, max_new_tokens=4, seed=i))
        t1 = time.perf_counter()
        lp = worker.compute_log_probs(batch).log_probs
        t2 = time.perf_counter()
        adv = (torch.rand(len(batch), 1) - 0.5).expand_as(lp)
        worker.update_policy(batch.replace(advantages=adv, old_log_probs=lp), loss_fn=loss_fn, mini_batch_size=0,
                             epochs=1)
        t3 = time.perf_counter()
        if i < WARMUP:
            continue
        for key, value in (("generate", t1 - t0), ("log_probs", t2 - t1), ("update", t3 - t2), ("step", t3 - t0)):
            out[key].append(value)
        real = batch.prompt_mask.bool()
        images = int(((batch.prompt_ids == image_token) & real).sum())
        tokens["image"] += images
        tokens["text_prompt"] += int(real.sum()) - images
        tokens["response"] += int(batch.response_attention_mask.sum())
        tokens["patches"] += sum(int(m["pixel_values"].shape[0]) for m in batch.multi_modal_inputs if m)
    out["tokens_per_step"] = {k: v / steps for k, v in tokens.items()}
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    worker.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "vision.md"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child), args.steps)))
        return
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        for name, settings in (CONFIGS.items() if r % 2 == 0 else reversed(list(CONFIGS.items()))):
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(settings), "--steps",
                                   str(args.steps)], capture_output=True, text=True, check=True)
            results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: step {statistics.median(results[name][-1]['step']):.3f}s", flush=True)
    lines = ["# The built-in visual task: one RL step (bench/vision_step.py)\n",
             f"CPU: {cpu_name()}, {os.environ.get('OMP_NUM_THREADS', '2')} threads, {args.rounds} rounds x "
             f"{args.steps} steps per configuration (median over all steps); {PROMPTS} prompts x n={N}, "
             f"builtin:tiny-qwen2-vl (Qwen2-VL, 64x64 images, 16 image tokens each), FSDP backend at one rank; "
             f"load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after (other jobs on the cores "
             f"inflate the times; the rounds alternate so both configurations meet them).\n",
             "| configuration | step s | generate s | log-probs s | update s | peak RSS GiB |",
             "|---|---|---|---|---|---|"]
    for name, runs in results.items():
        med = {k: statistics.median([x for run in runs for x in run[k]]) for k in ("step", "generate", "log_probs",
                                                                                     "update")}
        rss = max(run["peak_rss_gib"] for run in runs)
        lines.append(f"| {name} | {med['step']:.3f} | {med['generate']:.3f} | {med['log_probs']:.3f} | "
                     f"{med['update']:.3f} | {rss:.2f} |")
    base, frozen = (statistics.median([x for run in results[n] for x in run["update"]]) for n in CONFIGS)
    lines.append(f"\nUpdate time, frozen / whole: {frozen / base:.2f}.\n")
    t = results["whole VLM trained"][0]["tokens_per_step"]
    total = t["image"] + t["text_prompt"] + t["response"]
    lines += ["Tokens per step (all samples, real tokens only):\n",
              "| image tokens | text prompt tokens | response tokens | image share | vision-tower patches |",
              "|---|---|---|---|---|",
              f"| {t['image']:.0f} | {t['text_prompt']:.0f} | {t['response']:.0f} | {t['image'] / total:.1%} | "
              f"{t['patches']:.0f} |"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    existing = Path(args.out).read_text() if Path(args.out).exists() else ""
    marker = "\n## Learning runs"
    keep = existing[existing.index(marker):] if marker in existing else ""
    Path(args.out).write_text("\n".join(lines) + "\n" + keep)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
