"""FSDP backend features: dynamic (token-budget) micro-batches and padding removal."""

import pytest
import torch

from fsdp_test_utils import nan_where_poisoned, poison_second_half
from verl_kit.training import trim_padding
from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.testing import make_batch, tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("m")))


def _worker(model_dir, **cfg):
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    return FSDPBackend(FSDPConfig(**cfg)).create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                                         world=WorldInfo(threads=1), seed=0)


def test_token_budget_micro_batches_give_the_same_log_probs(model_dir):
    batch = make_batch(batch_size=12, prompt_length=7, response_length=9, vocab_size=16, seed=3)
    fixed = _worker(model_dir, log_prob_micro_batch_size=12)
    packed = _worker(model_dir, micro_batch_max_tokens=40)
    micro = packed._micro_batches(batch, 12)
    assert len(micro) > 1 and sum(len(m) for m in micro) == 12
    lengths = [int(m.prompt_mask.sum() + m.response_attention_mask.sum()) for m in micro]
    assert all(n <= 40 or len(m) == 1 for n, m in zip(lengths, micro))
    a = fixed.compute_log_probs(batch).log_probs
    b = packed.compute_log_probs(batch).log_probs
    mask = batch.response_attention_mask.bool()
    assert a.shape == b.shape == batch.response_ids.shape
    assert (a[mask] - b[mask]).abs().max() < 1e-5


def test_trim_padding_drops_only_padding():
    batch = make_batch(batch_size=4, prompt_length=6, response_length=8, seed=0)
    # Make every row shorter than the widths: one extra padded column on each side.
    wide = batch.replace(
        prompt_ids=torch.nn.functional.pad(batch.prompt_ids, (1, 0)),
        prompt_mask=torch.nn.functional.pad(batch.prompt_mask, (1, 0)),
        response_ids=torch.nn.functional.pad(batch.response_ids, (0, 2)),
        response_attention_mask=torch.nn.functional.pad(batch.response_attention_mask, (0, 2)),
        response_mask=torch.nn.functional.pad(batch.response_mask, (0, 2)),
        old_log_probs=torch.nn.functional.pad(batch.old_log_probs, (0, 2)),
        rollout_log_probs=None,
    )
    trimmed = trim_padding(wide)
    assert torch.equal(trimmed.prompt_ids, batch.prompt_ids)
    assert torch.equal(trimmed.response_ids, batch.response_ids)
    assert torch.equal(trimmed.old_log_probs, batch.old_log_probs)


def _loss(*, batch, log_probs, entropy=None, values=None):
    loss = -(log_probs * batch.advantages * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1)
    return loss, {}


def test_lora_trains_adapters_syncs_merged_weights_and_reference_is_the_base(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from verl_backend_fsdp.backend import AdapterOffReference, FSDPBackend, FSDPConfig

    backend = FSDPBackend(FSDPConfig(lr=5e-2, lora_rank=4, lora_alpha=8))
    actor = backend.create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir), world=WorldInfo(threads=1),
                                  seed=0)
    reference = backend.create_worker(role=Role.REFERENCE, model=ModelSpec(path=model_dir), world=WorldInfo(threads=1),
                                      seed=0)
    assert isinstance(reference, AdapterOffReference)  # no second copy of the model
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    merged = dict(actor.iter_weights())
    assert merged.keys() == base.keys()  # plain Hugging Face names, adapters folded in
    assert all(torch.equal(merged[k], base[k]) for k in base)  # LoRA B starts at zero

    batch = make_batch(batch_size=8, prompt_length=5, response_length=6, vocab_size=16, advantages=True, seed=4)
    ref_before = reference.compute_log_probs(batch).log_probs
    for _ in range(3):
        actor.update_policy(batch, loss_fn=_loss, mini_batch_size=0, epochs=1)
    merged = dict(actor.iter_weights())
    changed = [k for k in base if not torch.equal(merged[k], base[k])]
    assert changed and all("proj" in k for k in changed)  # only adapted projections moved
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    mask = batch.response_attention_mask.bool()
    assert torch.equal(reference.compute_log_probs(batch).log_probs[mask], ref_before[mask])
    assert (actor.compute_log_probs(batch).log_probs[mask] - ref_before[mask]).abs().max() > 1e-4

    actor.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad(), actor.generation_module() as live:
        ids = batch.input_ids[:2]
        assert (exported(input_ids=ids).logits - live(input_ids=ids).logits).abs().max() < 1e-5


def test_lora_actor_can_generate_before_any_forward(model_dir):
    # The first call on a fresh LoRA actor is a rollout: generate() must enter FSDP through the root.
    from transformers import AutoTokenizer

    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_core.contracts import SamplingParams
    from verl_rollout_hf import HFRollout

    actor = FSDPBackend(FSDPConfig(lora_rank=4)).create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                                                 world=WorldInfo(threads=1), seed=0)
    engine = HFRollout(config=HFRollout.Config(), model=ModelSpec(path=model_dir),
                       tokenizer=AutoTokenizer.from_pretrained(model_dir), actor=actor)
    out = engine.generate([[1, 5, 6, 14]], sampling=SamplingParams(n=2, max_new_tokens=3, seed=0))
    assert len(out.response_ids) == 2 and all(1 <= len(r) <= 3 for r in out.response_ids)


def test_bad_model_paths_are_clear_errors(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match="model.path: .* does not exist"):
        _worker(str(tmp_path / "missing"))
    from transformers import ViTConfig, ViTModel

    ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                       image_size=8, patch_size=4)).save_pretrained(tmp_path / "vit")
    with pytest.raises(ValueError, match="not a causal language model"):
        _worker(str(tmp_path / "vit"))


def test_sequence_longer_than_the_model_is_refused(model_dir):
    worker = _worker(model_dir)
    batch = make_batch(batch_size=2, prompt_length=40, response_length=40, group_size=2, seed=0)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        worker.compute_log_probs(batch)


def test_out_of_memory_names_the_knobs(model_dir):
    worker = _worker(model_dir, micro_batch_size=4)
    batch = make_batch(batch_size=4, prompt_length=4, response_length=4, vocab_size=16, advantages=True, seed=0)

    def oom_loss(*, batch, log_probs, entropy=None, values=None):
        # What the CUDA caching allocator raises when a micro-batch does not fit.
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError, match="lower backend.micro_batch_size \\(now 4\\)"):
        worker.update_policy(batch, loss_fn=oom_loss, mini_batch_size=0, epochs=1)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    # The no-grad passes have their own micro-batch size; the optimizer step its own remedies.
    forward, worker._forward = worker._forward, oom
    with pytest.raises(torch.OutOfMemoryError, match="log-prob pass .*log_prob_micro_batch_size \\(now 256\\)"):
        worker.compute_log_probs(batch)
    worker._forward = forward
    worker.optimizer.step = oom
    with pytest.raises(torch.OutOfMemoryError, match="actor optimizer step .*backend.cpu_offload"):
        worker.update_policy(batch, loss_fn=_loss, mini_batch_size=0, epochs=1)


def _updated(model_dir, batch, **cfg):
    worker = _worker(model_dir, lr=1e-2, **cfg)
    worker.update_policy(batch, loss_fn=_loss, mini_batch_size=0, epochs=1)
    return worker, dict(worker.iter_weights())


def _assert_updates_alike(model_dir, batch, untrained, reference: dict, other: dict) -> None:
    """One update with each setting moves the policy alike, and moves it (``untrained``: a worker not updated).

    Adam's first step is ~lr * sign(grad), so near-zero gradients may round either way: compare what
    the updated policies compute rather than single weights."""
    mask = batch.response_attention_mask.bool()
    w_reference, after = _updated(model_dir, batch, **reference)
    w_other, _ = _updated(model_dir, batch, **other)
    before = dict(untrained.iter_weights())
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-3
    a, b = w_reference.compute_log_probs(batch).log_probs, w_other.compute_log_probs(batch).log_probs
    assert (a[mask] - b[mask]).abs().max() < 1e-4
    assert (a[mask] - untrained.compute_log_probs(batch).log_probs[mask]).abs().max() > 1e-2  # the update mattered


def test_packed_sequences_score_and_train_like_padded_rows(model_dir):
    """remove_padding packs real tokens into one row; results match the padded computation."""
    batch = make_batch(batch_size=8, prompt_length=7, response_length=9, vocab_size=16, advantages=True, seed=5)
    assert (batch.prompt_mask == 0).any() and (batch.response_attention_mask == 0).any()  # real padding to remove
    padded = _worker(model_dir, remove_padding="false")
    packed = _worker(model_dir, remove_padding="true")
    assert packed.packed and not padded.packed
    mask = batch.response_attention_mask.bool()
    a, b = padded.compute_log_probs(batch, with_entropy=True), packed.compute_log_probs(batch, with_entropy=True)
    assert (a.log_probs[mask] - b.log_probs[mask]).abs().max() < 1e-5
    assert (a.entropy[mask] - b.entropy[mask]).abs().max() < 1e-5
    assert (b.log_probs[~mask] == 0).all()  # padding is not scored at all

    _assert_updates_alike(model_dir, batch, padded, dict(remove_padding="false"), dict(remove_padding="true"))


def test_auto_packs_only_with_a_variable_length_attention_kernel(model_dir):
    from verl_backend_fsdp.backend import _wants_packing

    class Config:
        _attn_implementation = "sdpa"

    module = torch.nn.Module()
    module.config = Config()
    assert not _wants_packing("auto", module)
    Config._attn_implementation = "flash_attention_2"
    assert _wants_packing("auto", module)
    assert not _wants_packing("false", module) and _wants_packing("true", module)
    with pytest.raises(ValueError, match="remove_padding"):
        from verl_backend_fsdp.backend import FSDPConfig

        FSDPConfig(remove_padding="yes").validate()


def test_chunked_lm_head_gives_the_same_log_probs_and_gradients(model_dir):
    """logits_chunk_size only changes how many positions meet the LM head at once."""
    batch = make_batch(batch_size=8, prompt_length=5, response_length=8, vocab_size=16, advantages=True, seed=2)
    whole, chunked = _worker(model_dir, logits_chunk_size=4096), _worker(model_dir, logits_chunk_size=3)
    mask = batch.response_attention_mask.bool()
    a, b = whole.compute_log_probs(batch).log_probs, chunked.compute_log_probs(batch).log_probs
    assert (a[mask] - b[mask]).abs().max() < 1e-6
    # The LM head never sees more than a chunk of positions, in forward or in backward's recompute.
    seen: list[int] = []
    head = chunked.module.get_output_embeddings()
    handle = head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    chunked.update_policy(batch, loss_fn=_loss, mini_batch_size=0, epochs=1)
    handle.remove()
    scored = int(mask.sum())
    # Every position in forward; all but the last chunk again in backward's recompute (backward
    # reaches the last chunk first, so keeping it costs no extra peak).
    last = scored % 3 or 3
    assert max(seen) <= 3 and sum(seen) == 2 * scored - last
    w, _ = _updated(model_dir, batch, logits_chunk_size=4096)
    c, _ = _updated(model_dir, batch, logits_chunk_size=3)
    assert (w.compute_log_probs(batch).log_probs[mask] - c.compute_log_probs(batch).log_probs[mask]).abs().max() < 1e-5


@pytest.mark.parametrize("setting", [{"param_dtype": "bfloat16"}, {"autocast": "bfloat16"}], ids=["param_dtype", "autocast"])
def test_bf16_compute_keeps_fp32_master_weights(model_dir, setting):
    """param_dtype=bfloat16 (FSDP's cast) or autocast=bfloat16: the matmuls run in bf16, the optimizer
    updates fp32 weights."""
    batch = make_batch(batch_size=8, prompt_length=5, response_length=6, vocab_size=16, advantages=True, seed=4)
    fp32_worker, fp32 = _updated(model_dir, batch)
    bf16_worker, bf16 = _updated(model_dir, batch, **setting)
    assert all(v.dtype == torch.float32 for v in bf16.values())
    assert all(p.dtype == torch.float32 for p in bf16_worker.optimizer.param_groups[0]["params"])
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in bf16_worker.module.parameters())
    projections = [m for name, m in bf16_worker.module.named_modules() if name.endswith("q_proj")]
    seen = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype)) for m in projections]
    mask = batch.response_attention_mask.bool()
    lp16 = bf16_worker.compute_log_probs(batch).log_probs
    for hook in hooks:
        hook.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the projections really ran in bf16
    lp32 = fp32_worker.compute_log_probs(batch).log_probs
    assert lp16.dtype == torch.float32  # log-softmax in fp32 even when the head ran in bf16
    gap = (lp16[mask] - lp32[mask]).abs().max().item()
    assert 0 < gap < 0.1  # bf16 rounding shows, but it is the same model
    # The bf16 step improves the objective it was taken on, as the fp32 step does.
    initial = _worker(model_dir).compute_log_probs(batch).log_probs

    def objective(lp):
        return float((lp * batch.advantages * batch.response_mask).sum())

    assert objective(lp16) > objective(initial) and objective(lp32) > objective(initial)


def test_autocast_settings_are_checked():
    from verl_backend_fsdp.backend import FSDPConfig

    with pytest.raises(ValueError, match="autocast: must be 'off', 'bfloat16' or 'float16'"):
        FSDPConfig(autocast="bf16").validate()
    with pytest.raises(ValueError, match="two ways to compute in lower precision; set param_dtype='float32'"):
        FSDPConfig(autocast="bfloat16", param_dtype="bfloat16").validate()


@pytest.mark.parametrize("release", [True, False])
def test_host_memory_is_handed_back_after_updates_only_when_turned_on(model_dir, monkeypatch, release):
    import verl_backend_fsdp.backend as fsdp

    calls: list[int] = []
    monkeypatch.setattr(fsdp, "_release_host_memory", lambda: calls.append(1))
    worker = _worker(model_dir, release_host_memory=release)
    batch = make_batch(batch_size=4, prompt_length=5, response_length=6, vocab_size=16, advantages=True, seed=4)
    worker.compute_log_probs(batch)
    assert calls == []  # only after updates, where the freed memory is large
    for _ in range(2):
        worker.update_policy(batch, loss_fn=_loss, mini_batch_size=0, epochs=1)
    assert len(calls) == (2 if release else 0)


@pytest.mark.parametrize("wrapped", [False, True])
def test_close_frees_the_module_at_once(model_dir, wrapped):
    # Freed later by the garbage collector (or at interpreter exit), a sharded module would still
    # hold the process group when the process leaves it.
    import gc
    import weakref

    worker = _worker(model_dir, shard_single_rank=wrapped)
    batch = make_batch(batch_size=4, prompt_length=5, response_length=6, vocab_size=16, advantages=True, seed=4)
    worker.update_policy(batch, loss_fn=_loss, mini_batch_size=0, epochs=1)
    module = weakref.ref(worker.module)
    gc.disable()  # nothing but close() may free it
    try:
        worker.close()
        assert module() is None
        worker.close()  # a second close is harmless
    finally:
        gc.enable()


# Rates worked out by hand from BackendConfig's documented schedule (not from the implementation):
# warm-up step k of w uses lr * k / w; then the cosine
#   lr * (floor + (1 - floor) * (1 + cos(pi * j / (total - w))) / 2),  j = 0, 1, ... steps after warm-up,
# which reaches lr * floor at j = total - w and stays there. cos(pi/4) = 0.70710678118654...
LR_SCHEDULES = {
    # lr 1e-3, warm-up 2, total 6, floor 0.1: 0.5, 1 (warm-up); 1, 0.1 + 0.45 * 1.7071068,
    # 0.1 + 0.45, 0.1 + 0.45 * 0.2928932 (cosine); then the floor 0.1, past total_training_steps too.
    "warmup_cosine_floor": ({"warmup_steps": 2, "lr_schedule": "cosine", "total_training_steps": 6,
                             "min_lr_ratio": 0.1},
                            [5e-4, 1e-3, 1e-3, 8.6819805153e-4, 5.5e-4, 2.3180194847e-4, 1e-4, 1e-4]),
    # No warm-up, floor 0, total 4: 1, (1 + 0.7071068) / 2, 1/2, (1 - 0.7071068) / 2, then 0.
    "cosine_to_zero": ({"lr_schedule": "cosine", "total_training_steps": 4},
                       [1e-3, 8.5355339059e-4, 5e-4, 1.4644660941e-4, 0.0, 0.0]),
    # Warm-up 3 into a constant rate: 1/3, 2/3, 1, and 1 from then on.
    "warmup_constant": ({"warmup_steps": 3}, [3.3333333333e-4, 6.6666666667e-4, 1e-3, 1e-3, 1e-3]),
}


@pytest.mark.parametrize("case", sorted(LR_SCHEDULES))
def test_learning_rate_follows_the_documented_schedule_once_per_training_step(model_dir, case):
    settings, expected = LR_SCHEDULES[case]
    worker = _worker(model_dir, lr=1e-3, micro_batch_size=4, **settings)
    batch = make_batch(batch_size=8, prompt_length=5, response_length=6, vocab_size=16, seed=1, advantages=True)
    used = []
    for _ in expected:
        seen = []  # the rate each optimizer step really applied, read from the optimizer itself
        hook = worker.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, seen=seen: seen.append(opt.param_groups[0]["lr"]))
        reported = worker.update_policy(batch, loss_fn=_loss, mini_batch_size=4, epochs=1)["actor/lr"]
        hook.remove()
        assert len(seen) == 2 and seen[0] == seen[1] == reported  # two mini-batches, one rate for the step
        used.append(reported)
    assert used == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert worker.optimizer_steps == 2 * len(expected)


def test_activation_checkpointing_trains_like_without(model_dir):
    batch = make_batch(batch_size=8, prompt_length=5, response_length=7, vocab_size=16, seed=4, advantages=True)
    _, a = _updated(model_dir, batch, micro_batch_size=4)
    ckpt, b = _updated(model_dir, batch, micro_batch_size=4, activation_checkpointing=True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in ckpt.module.modules())
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    initial = dict(_worker(model_dir).iter_weights())
    assert max((a[k] - initial[k]).abs().max().item() for k in a) > 1e-3


def test_gradient_clipping_bounds_the_applied_update(model_dir):
    batch = make_batch(batch_size=8, prompt_length=5, response_length=7, vocab_size=16, seed=5, advantages=True)
    free = _worker(model_dir, lr=1e-2, grad_clip=0.0)
    clipped = _worker(model_dir, lr=1e-2, grad_clip=1e-3)
    # SGD-like check through AdamW is blurred by its normalisation; read the gradients instead.
    norms = {}
    for name, worker in (("free", free), ("clipped", clipped)):
        seen = []
        worker.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(
            torch.sqrt(sum((p.grad.float() ** 2).sum() for g in opt.param_groups for p in g["params"]
                           if p.grad is not None)).item()))
        reported = worker.update_policy(batch, loss_fn=_loss, mini_batch_size=0, epochs=1)["actor/grad_norm"]
        norms[name] = (reported, seen[0])
    assert norms["free"][0] == pytest.approx(norms["free"][1], rel=1e-5) and norms["free"][0] > 1e-2
    # The reported norm is the one before clipping; the optimizer saw gradients scaled to 1e-3.
    assert norms["clipped"][0] == pytest.approx(norms["free"][0], rel=1e-5)
    assert norms["clipped"][1] == pytest.approx(1e-3, rel=1e-3)


def test_nan_in_a_later_micro_batch_leaves_no_gradient_behind(model_dir):
    """A NaN on micro-batch 2 of 2 of a wrapped one-rank worker: the update is refused, and the next
    update is exactly a fresh worker's (no gradients of micro-batch 1 kept in FSDP's unsharded
    parameters, where zero_grad does not reach)."""
    from verl_backend_fsdp.backend import TrainingDivergedError

    batch = make_batch(batch_size=8, prompt_length=5, response_length=6, vocab_size=16, seed=7, advantages=True)

    hit = _worker(model_dir, lr=1e-2, micro_batch_size=4, shard_single_rank=True)
    with pytest.raises(TrainingDivergedError, match="loss is nan at optimizer step 1"):
        hit.update_policy(poison_second_half(batch), loss_fn=nan_where_poisoned(_loss), mini_batch_size=0, epochs=1)
    fresh = _worker(model_dir, lr=1e-2, micro_batch_size=4, shard_single_rank=True)
    norms = [w.update_policy(batch, loss_fn=_loss, mini_batch_size=0, epochs=1)["actor/grad_norm"]
             for w in (hit, fresh)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)
    a, b = dict(hit.iter_weights()), dict(fresh.iter_weights())
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-7


def test_the_actor_loss_gets_the_current_entropy_with_gradients_on_every_micro_batch(model_dir):
    """What docs/writing-plugins.md promises ``policy_loss``: entropy and log-probs of the current policy."""
    batch = make_batch(batch_size=8, prompt_length=5, response_length=6, vocab_size=16, advantages=True, seed=4)
    worker = _worker(model_dir, micro_batch_size=4)
    expected = worker.compute_log_probs(batch, with_entropy=True).entropy
    calls = []

    def loss_fn(*, batch, log_probs=None, entropy=None, values=None):
        calls.append((batch, log_probs, entropy, values))
        return -(log_probs * batch.response_mask).sum() - entropy.sum() * 0.0, {}

    worker.update_policy(batch, loss_fn=loss_fn, mini_batch_size=0, epochs=2)
    assert len(calls) == 4  # 2 micro-batches x 2 epochs
    for micro, log_probs, entropy, values in calls:
        assert values is None and entropy is not None and entropy.requires_grad
        assert entropy.shape == log_probs.shape == micro.response_mask.shape
    first = torch.cat([c[2].detach() for c in calls[:2]])  # epoch 1, before any optimizer step moved it
    mask = batch.response_mask.bool()
    assert first.shape == expected.shape and (first[mask] - expected[mask]).abs().max() < 1e-5


def _grouped(batch, group):
    """``batch`` with every ``group`` consecutive samples drawn from one prompt, as a rollout lays them out."""
    prompt_ids, prompt_mask = batch.prompt_ids.clone(), batch.prompt_mask.clone()
    for g in range(0, len(batch), group):
        prompt_ids[g:g + group], prompt_mask[g:g + group] = prompt_ids[g], prompt_mask[g]
    return batch.replace(prompt_ids=prompt_ids, prompt_mask=prompt_mask)


def _tokens_fed(worker):
    """A list that each forward of ``worker``'s model appends its number of input tokens to."""
    fed = []
    worker.module.get_input_embeddings().register_forward_hook(lambda mod, args, out: fed.append(args[0].numel()))
    return fed


def test_shared_prompt_scores_and_trains_like_separate_rows(model_dir):
    """One copy of each prompt with its samples' responses behind a block mask: the log-probs, the
    entropy and the update of separate padded rows, for fewer tokens."""
    batch = _grouped(make_batch(batch_size=12, prompt_length=7, response_length=9, vocab_size=16, group_size=4,
                                advantages=True, empty_rows=(6,), seed=5), 4)
    assert (batch.prompt_mask == 0).any() and (batch.response_attention_mask == 0).any()
    separate = _worker(model_dir, shared_prompt="false")
    shared = _worker(model_dir, shared_prompt="true")
    assert shared.shared_prompt and not separate.shared_prompt
    fed_separate, fed_shared = _tokens_fed(separate), _tokens_fed(shared)
    mask = batch.response_attention_mask.bool()
    a, b = separate.compute_log_probs(batch, with_entropy=True), shared.compute_log_probs(batch, with_entropy=True)
    assert (a.log_probs[mask] - b.log_probs[mask]).abs().max() < 1e-5
    assert (a.entropy[mask] - b.entropy[mask]).abs().max() < 1e-5
    assert (b.log_probs[~mask] == 0).all()
    # 3 prompts of up to 7 tokens once, instead of 12 times.
    assert fed_shared[-1] < fed_separate[-1] - 6 * int(batch.prompt_mask[0].sum())

    _assert_updates_alike(model_dir, batch, separate, dict(shared_prompt="false"), dict(shared_prompt="true"))


def test_shared_prompt_layout_rows_and_mask():
    from verl_backend_fsdp.backend import _block_mask, _responses_per_row, _shared_prompt_layout

    batch = _grouped(make_batch(batch_size=4, prompt_length=3, response_length=4, vocab_size=16, group_size=2,
                                tool_tokens=False, seed=1), 2)
    input_ids, position_ids, segments, rows, cols = _shared_prompt_layout(batch, object())  # no width: one row
    assert input_ids.shape[0] == 2
    for r, first in enumerate((0, 2)):
        p = int(batch.prompt_mask[first].sum())
        n = [int(batch.response_attention_mask[first + k].sum()) for k in range(2)]
        assert input_ids[r, :p].tolist() == batch.prompt_ids[first][batch.prompt_mask[first].bool()].tolist()
        # Each response continues from the prompt's positions, as it would in a row of its own.
        assert position_ids[r, :p].tolist() == list(range(p))
        assert position_ids[r, p:p + n[0]].tolist() == list(range(p, p + n[0]))
        assert position_ids[r, p + n[0]:p + n[0] + n[1]].tolist() == list(range(p, p + n[1]))
        assert segments[r, :p].eq(0).all() and segments[r, p:p + n[0]].eq(1).all()
        assert segments[r, p + n[0]:p + n[0] + n[1]].eq(2).all()
    mask = _block_mask(segments, torch.float32)[0, 0] == 0  # True where attending
    p, n0 = int(batch.prompt_mask[0].sum()), int(batch.response_attention_mask[0].sum())
    assert mask[p + n0, :p].all() and not mask[p + n0, p:p + n0].any()  # response 2 sees the prompt, not response 1
    for r in range(2):
        full = _block_mask(segments, torch.float32)[r, 0] == 0
        real, pad = segments[r] >= 0, segments[r] == -1
        assert not full[real][:, pad].any()  # no real token attends to padding
    assert len(rows) == len(cols) == int(batch.response_attention_mask.sum())
    assert cols[0] == p - 1  # the first response token is predicted at the prompt's last token
    # A wide model with long responses: the square of a shared row costs more than the prompt saved.
    assert _responses_per_row(prompt=8, response=4096, n=8, width=64, ffn=256) == 1
    assert _responses_per_row(prompt=32, response=32, n=8, width=512, ffn=1792) == 8
    # No shared prompt: the padded layout serves the batch.
    assert _shared_prompt_layout(make_batch(batch_size=4, seed=2), object()) is None


def test_shared_prompt_refuses_what_it_cannot_serve(model_dir):
    from verl_backend_fsdp.backend import FSDPConfig

    with pytest.raises(ValueError, match="shared_prompt=true: .*packed .*set backend.shared_prompt"):
        _worker(model_dir, shared_prompt="true", remove_padding="true")
    assert not _worker(model_dir, shared_prompt="auto", remove_padding="true").shared_prompt  # auto steps aside
    with pytest.raises(ValueError, match="shared_prompt: must be"):
        FSDPConfig(shared_prompt="yes").validate()
