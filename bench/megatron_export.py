"""Peak RSS and wall time of `verl export` on a Megatron checkpoint: the weights alone
(``load_saved_weights``, what export calls) vs the whole saved state with the optimizer's
(``load_state``, what it called before), each in a fresh process, alternating over rounds.

    python bench/megatron_export.py [--rounds 2]

Writes bench/results/megatron_export.md.
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import cpu_name  # noqa: E402


def prepare(root: Path) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, AutoTokenizer
    from verl_core.testing import build_byte_tokenizer, make_batch
    from verl_core.testing._backend import simple_policy_loss
    from verl_core.contracts import ModelSpec, Role, WorldInfo
    from verl_run_store import CheckpointManager
    from verl_core.config import config_to_dict, dump_toml, resolve_config
    from verl_core.registry import PluginRegistry
    from verl_backend_megatron.backend import MegatronBackend, MegatronConfig
    import shutil
    tok = build_byte_tokenizer()
    # bench/fsdp_step.py's ~30M shape (vocab 8192 there; the byte tokenizer's vocabulary here, so the embedding is smaller)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model_dir = root / "model"
    Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    settings = dict(lr=1e-4, micro_batch_size=4, log_prob_micro_batch_size=4)
    w = MegatronBackend(MegatronConfig(**settings)).create_worker(role=Role.ACTOR, model=ModelSpec(path=str(model_dir)),
                                                                  world=WorldInfo(), seed=0)
    batch = make_batch(batch_size=4, prompt_length=7, response_length=6, vocab_size=len(tok), group_size=2,
                       advantages=True)
    w.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
    w.save_state(str(root / "state"))
    rc = resolve_config({"model": {"path": str(model_dir)}, "backend": {"name": "megatron", **settings}}, PluginRegistry())

    def write(tmp):
        shutil.copytree(root / "state", tmp / "actor")
        (tmp / "config.toml").write_text(dump_toml(config_to_dict(rc)))
    CheckpointManager(root / "run").save(1, write, info={})
    n = sum(p.numel() for p in Qwen2ForCausalLM(cfg).parameters())
    size = sum(f.stat().st_size for f in (root / "state").rglob("*") if f.is_file())
    return f"{n / 1e6:.1f}M parameters ({n * 4 / 2**20:.0f} MiB fp32), checkpoint {size / 2**20:.0f} MiB"


def export(root: Path, mode: str) -> None:
    from verl_core.contracts import TrainingWorker
    from verl_cli.export import export_checkpoint
    from verl_backend_megatron.backend import MegatronWorker  # imported before the clock starts in both modes
    if mode == "load_state":  # what verl export did before: the whole state, optimizer included
        MegatronWorker.load_saved_weights = MegatronWorker.load_state
    t = time.perf_counter()
    export_checkpoint(root / "run", root / f"hf_{mode}")
    print(json.dumps({"mode": mode, "export_s": round(time.perf_counter() - t, 2),
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        export(Path(args.child[0]), args.child[1])
        return
    runs: dict[str, list[dict]] = {"load_saved_weights": [], "load_state": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shape = prepare(root)
        for r in range(args.rounds):
            for mode in (runs if r % 2 == 0 else reversed(list(runs))):
                out = subprocess.run([sys.executable, __file__, "--child", str(root), mode], check=True,
                                     capture_output=True, text=True).stdout
                runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    lines = ["# `verl export` of a Megatron checkpoint: the weights alone vs the whole state", "",
             f"CPU: {cpu_name()}, 2 cores. Qwen2, {shape}, saved after one update at one process "
             f"(model, Adam moments, RNG). Command: `python bench/megatron_export.py --rounds {args.rounds}`; "
             f"date {time.strftime('%Y-%m-%d')}. Each run a fresh process; peak RSS of that process.", "",
             "| load | runs | export s, median [all] | peak RSS MiB, median [all] |", "|---|---|---|---|"]
    for mode, rs in runs.items():
        secs, rss = [x["export_s"] for x in rs], [x["peak_rss_mib"] for x in rs]
        lines.append(f"| `{mode}` | {len(rs)} | {statistics.median(secs):.2f} {secs} | "
                     f"{statistics.median(rss):.0f} {rss} |")
    (HERE / "results" / "megatron_export.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
