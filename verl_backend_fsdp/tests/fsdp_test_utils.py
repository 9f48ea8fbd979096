"""What the FSDP tests that compare against plain PyTorch share: batches, the loss, the reference steps."""

from __future__ import annotations

import torch

from verl_core.testing import make_batch


def full_length_batch(step: int):
    """8 samples with no padding anywhere: every micro-batch (and every rank) holds the same number of
    tokens, so per-micro-batch token-means combine into the global token-mean."""
    b = make_batch(batch_size=8, prompt_length=5, response_length=6, vocab_size=16, group_size=4,
                   tool_tokens=False, advantages=True, seed=step)
    full = torch.ones_like(b.response_mask)
    return b.replace(response_mask=full, response_attention_mask=full, prompt_mask=torch.ones_like(b.prompt_mask))


def token_mean_loss(*, batch, log_probs, entropy=None, values=None):
    adv, mask = batch.advantages.to(log_probs.device), batch.response_mask.to(log_probs.device)
    loss = -(log_probs * adv * mask).sum() / mask.sum()
    return loss, {"loss": float(loss.detach())}


_POISON = 99.0


def poison_second_half(batch):
    """``batch`` with its second half marked (advantages set to a sentinel) for :func:`nan_where_poisoned`."""
    adv = batch.advantages.clone()
    adv[len(batch) // 2:] = _POISON
    return batch.replace(advantages=adv)


def nan_where_poisoned(loss_fn):
    """``loss_fn``, but NaN (still attached to the graph) on a micro-batch or shard that starts with a marked sample."""

    def loss(*, batch, log_probs, entropy=None, values=None):
        value, metrics = loss_fn(batch=batch, log_probs=log_probs)
        return (value * float("nan") if bool(batch.advantages[0, 0] == _POISON) else value), metrics

    return loss


def response_log_probs(model, batch, device: str = "cpu") -> torch.Tensor:
    """Log-probs of ``batch``'s response tokens under a plain Hugging Face model."""
    R = batch.response_ids.shape[1]
    logits = model(input_ids=batch.input_ids.to(device), use_cache=False, logits_to_keep=R + 1).logits[:, :-1]
    targets = batch.response_ids.to(device).unsqueeze(-1)
    return torch.log_softmax(logits.float(), -1).gather(-1, targets).squeeze(-1)


def plain_pytorch_steps(model_dir: str, *, steps: int, micro: int, lr: float, device: str = "cpu"):
    """The FSDP actor's update written directly: micro-batch losses scaled by their share, global-norm
    clipping at 1.0, one AdamW step per batch of :func:`full_length_batch`. Returns the model (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for step in range(steps):
        batch = full_length_batch(step)
        opt.zero_grad(set_to_none=True)
        for part in batch.split(micro):
            loss, _ = token_mean_loss(batch=part, log_probs=response_log_probs(model, part, device))
            (loss * (len(part) / len(batch))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


def leave_process_group(worker) -> None:
    """End a spawned rank: wait for every rank, free the worker (and its hold on the group), leave.

    A rank that left while a peer was still inside a collective, or whose FSDP module was only freed
    at interpreter exit, could abort (SIGABRT) on the way out.
    """
    import torch.distributed as dist

    dist.barrier()
    worker.close()
    dist.destroy_process_group()
