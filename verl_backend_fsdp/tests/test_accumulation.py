"""Gradient accumulation over micro-batches at world size 1 trains exactly like plain PyTorch.

At one rank the update keeps parameters gathered and gradients local between micro-batches (FSDP's
per-micro-batch gather and reduce are whole-model copies there). These tests pin what that must not
change: the weights after several steps, the log-probs the next forward computes (no stale gathered
copy survives an optimizer step), and the weights a rollout engine receives.
"""

import pytest
import torch

from verl_core.interfaces import ModelSpec, Role, WorldInfo
from verl_core.testing import make_batch, tiny_model_dir

STEPS = 3
MICRO = 2
LR = 1e-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("m")))


def _batch(step: int):
    b = make_batch(batch_size=8, prompt_length=5, response_length=6, vocab_size=16, group_size=4,
                   tool_tokens=False, advantages=True, seed=step)
    full = torch.ones_like(b.response_mask)
    return b.replace(response_mask=full, response_attention_mask=full, prompt_mask=torch.ones_like(b.prompt_mask))


def _loss(*, batch, log_probs, entropy=None, values=None):
    loss = -(log_probs * batch.advantages * batch.response_mask).sum() / batch.response_mask.sum()
    return loss, {"loss": float(loss.detach())}


def _log_probs(model, batch):
    R = batch.response_ids.shape[1]
    logits = model(input_ids=batch.input_ids, use_cache=False, logits_to_keep=R + 1).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)


def _plain_pytorch(model_dir):
    """The same steps written directly: micro-batch losses scaled by their share, one AdamW step."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for step in range(STEPS):
        batch = _batch(step)
        opt.zero_grad(set_to_none=True)
        for micro in batch.split(MICRO):
            loss, _ = _loss(batch=micro, log_probs=_log_probs(model, micro))
            (loss * (len(micro) / len(batch))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return model


def test_micro_batched_updates_match_plain_pytorch(model_dir):
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    torch.set_num_threads(1)
    worker = FSDPBackend(FSDPConfig(lr=LR, micro_batch_size=MICRO, grad_clip=1.0)).create_worker(
        role=Role.ACTOR, model=ModelSpec(path=model_dir), world=WorldInfo(threads=1), seed=0)
    for step in range(STEPS):
        worker.update_policy(_batch(step), loss_fn=_loss, mini_batch_size=0, epochs=1)
    reference = _plain_pytorch(model_dir)

    expected = reference.state_dict()
    synced = dict(worker.iter_weights())  # what a rollout engine receives
    assert set(synced) == set(expected)
    assert max((synced[k] - expected[k]).abs().max().item() for k in expected) < 1e-5

    # The forward after the last optimizer step must see the new weights, not a gathered copy of the old ones.
    probe = _batch(STEPS)
    ours = worker.compute_log_probs(probe).log_probs
    with torch.no_grad():
        theirs = _log_probs(reference, probe)
    assert (ours - theirs).abs().max() < 1e-4

    # And so must generation through the actor's own module (the HF rollout's path).
    with worker.gather_for_generation() as module, torch.no_grad():
        gathered = _log_probs(module, probe)
    assert (gathered - theirs).abs().max() < 1e-4
