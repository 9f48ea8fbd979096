"""Each prompt run once for its samples: FSDP ``backend.shared_prompt`` and the HF rollout's ``shared_prefill``.

On the model of ``bench/trl_comparison.py`` (21M Qwen2, 16 prompts x 8 samples, 32-token prompts and
responses), one thread, the same batch both ways: the old-log-prob forward and one update (micro-batches
of 16) with ``shared_prompt`` off and on, and generation with ``shared_prefill`` off and on. Off and on
alternate within each round; ratios are off / on per round, then the median.

    python bench/shared_prompt.py --rounds 3 [--results bench/results/shared_prompt.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu_name  # noqa: E402
from trl_comparison import MODEL_SHAPE  # noqa: E402

PROMPTS, GROUP, TOKENS = 16, 8, 32


def _batch():
    from verl_core.testing import make_batch

    b = make_batch(batch_size=PROMPTS * GROUP, prompt_length=TOKENS, response_length=TOKENS, group_size=GROUP,
                   advantages=True, tool_tokens=False, seed=0)
    full = torch.ones_like(b.response_attention_mask)
    prompt_ids = b.prompt_ids.clone()
    for g in range(0, len(b), GROUP):
        prompt_ids[g:g + GROUP] = prompt_ids[g]
    return b.replace(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(b.prompt_mask), response_attention_mask=full,
                     response_mask=full)


def _train(model_dir: str, batch, shared: str) -> tuple[float, float]:
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_core.contracts import ModelSpec, Role, WorldInfo
    from verl_core.testing._backend import simple_policy_loss

    worker = FSDPBackend(FSDPConfig(shared_prompt=shared, micro_batch_size=16)).create_worker(
        role=Role.ACTOR, model=ModelSpec(path=model_dir), world=WorldInfo(threads=1), seed=0)
    start = time.perf_counter()
    worker.compute_log_probs(batch)
    scored = time.perf_counter()
    worker.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
    return scored - start, time.perf_counter() - scored


def _generate(model_dir: str, prompts, shared: bool) -> float:
    from verl_core.contracts import ModelSpec, SamplingParams
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    class Tokens:  # what the engine reads of a tokenizer
        eos_token_id, pad_token_id = 15, 0

    engine = HFRollout(config=HFRolloutConfig(shared_prefill=shared), model=ModelSpec(path=model_dir),
                       tokenizer=Tokens())
    start = time.perf_counter()
    engine.generate(prompts, sampling=SamplingParams(n=GROUP, max_new_tokens=TOKENS, temperature=1.0, seed=3))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", default=str(Path(__file__).parent / "results" / "shared_prompt.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    import transformers

    directory = tempfile.mkdtemp(prefix="shared-prompt-")
    config = transformers.Qwen2Config(vocab_size=16, max_position_embeddings=256, tie_word_embeddings=False,
                                      **MODEL_SHAPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    batch = _batch()
    prompts = [row.tolist() for row in batch.prompt_ids[::GROUP]]
    rows: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for shared in ("false", "true"):
            lp, update = _train(directory, batch, shared)
            rows.setdefault(f"log-probs {shared}", []).append(lp)
            rows.setdefault(f"update {shared}", []).append(update)
            rows.setdefault(f"generate {shared}", []).append(_generate(directory, prompts, shared == "true"))
            print({k: round(v[-1], 2) for k, v in rows.items() if k.endswith(shared)}, flush=True)
    lines = [f"# Each prompt run once for its samples ({cpu_name()}, 1 thread)", "",
             f"Command: `python bench/shared_prompt.py --rounds {args.rounds}`. Model: 21M Qwen2 "
             f"(`bench/trl_comparison.py`'s shape), {PROMPTS} prompts x {GROUP} samples, {TOKENS}-token prompts "
             f"and responses, micro-batches of 16.", "",
             "| stage | off (s, median) | on (s, median) | off / on (median of rounds) | per round |", "|---|---|---|---|---|"]
    for stage in ("log-probs", "update", "generate"):
        off, on = rows[f"{stage} false"], rows[f"{stage} true"]
        ratios = [a / b for a, b in zip(off, on)]
        lines.append(f"| {stage} | {statistics.median(off):.2f} | {statistics.median(on):.2f} | "
                     f"{statistics.median(ratios):.2f}x | {', '.join(f'{r:.2f}' for r in ratios)} |")
    Path(args.results).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
