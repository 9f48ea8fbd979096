"""``algorithm.old_log_probs``: the old-log-prob forward goes only where it equals the update's own log-probs.

On an on-policy batch that gets one optimizer step, the recomputed old log-probs are the current
ones; the update then uses its own, detached (ratio 1), and must train exactly as the recompute path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_core.config import ConfigError, resolve_config
from verl_core.contracts import AlgorithmLoss
from verl_core.dataflow import DataflowBuilder, StepContext, old_log_probs_reusable
from verl_core.registry import PluginRegistry
from verl_core.testing import make_batch, tiny_model_dir

from verl_algorithms.grpo import GRPO
from verl_algorithms.ppo import PPO


def _response_log_probs(model: Any, batch: Any) -> torch.Tensor:
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_attention_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    P, R = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1:P + R - 1], dim=-1)
    return lp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)


def _loss_and_grads(model: Any, algorithm: Any, batch: Any, *, skip: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """One optimizer step's loss and gradients, two micro-batches accumulated (as a backend does)."""
    if not skip:
        with torch.no_grad():
            batch = batch.replace(old_log_probs=_response_log_probs(model, batch))
    loss_fn = AlgorithmLoss(algorithm, detach_old_log_probs=skip)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for micro in batch.split(4):
        loss, _ = loss_fn(batch=micro, log_probs=_response_log_probs(model, micro))
        (loss / 2).backward()
        total += float(loss.detach()) / 2
    return total, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("algo", [GRPO, PPO])
def test_the_skip_trains_as_the_recompute(tmp_path: Path, algo: Any) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path), dtype=torch.float32)
    model.eval()  # no dropout: the two forwards agree, as the run's own check asks
    batch = make_batch(batch_size=8, vocab_size=200, old_log_probs=False, advantages=True, seed=3)
    algorithm = algo(algo.Config(entropy_coef=0.01, kl_coef=0.0))
    skip_loss, skip_grads = _loss_and_grads(model, algorithm, batch, skip=True)
    loss, grads = _loss_and_grads(model, algorithm, batch, skip=False)
    assert skip_loss == pytest.approx(loss, rel=1e-6, abs=1e-7)
    assert skip_grads.keys() == grads.keys() and len(grads) > 10
    for name in grads:
        torch.testing.assert_close(skip_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


def _flow(**config: Any) -> Any:
    builder = DataflowBuilder()
    GRPO(GRPO.Config(**config)).build_dataflow(builder)
    return builder.build()


def test_only_auto_lets_the_update_reuse_its_log_probs() -> None:
    assert _flow().old_log_probs_only_for_update
    assert _flow(old_log_probs="auto").old_log_probs_only_for_update
    assert not _flow(old_log_probs="recompute").old_log_probs_only_for_update
    assert not _flow(old_log_probs="rollout").old_log_probs_only_for_update
    assert not _flow(use_rollout_log_probs=True).old_log_probs_only_for_update
    assert GRPO.Config(use_rollout_log_probs=True).old_log_prob_source == "rollout"


def _ctx(staleness: int = 0, **config: Any) -> StepContext:
    algorithm = GRPO(GRPO.Config(**config))
    return StepContext(step=1, prompts=[], algorithm=algorithm, actor=None, rollout=None, reward=None,
                       sampling=None, batch=make_batch(batch_size=8), staleness=staleness,
                       reuse_update_log_probs=True)


def test_more_than_one_optimizer_step_or_a_stale_batch_keeps_the_forward() -> None:
    assert old_log_probs_reusable(_ctx())
    assert old_log_probs_reusable(_ctx(mini_batch_size=8))  # the whole batch: still one step
    assert not old_log_probs_reusable(_ctx(epochs=2))
    assert not old_log_probs_reusable(_ctx(mini_batch_size=4))
    assert not old_log_probs_reusable(_ctx(staleness=1))  # an async source's older weights


def test_contradictory_settings_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="algorithm.old_log_probs"):
        resolve_config({"algorithm": {"old_log_probs": "recompute", "use_rollout_log_probs": True}}, PluginRegistry())
    with pytest.raises(ConfigError, match="algorithm.old_log_probs"):
        resolve_config({"algorithm": {"old_log_probs": "sometimes"}}, PluginRegistry())
    with pytest.raises(ConfigError, match="rollout_is_cap"):
        resolve_config({"algorithm": {"old_log_probs": "rollout", "rollout_is_cap": 2.0}}, PluginRegistry())


def test_a_default_run_skips_the_forward_and_says_so(tmp_path: Path, run_verl: Any) -> None:
    out = tmp_path / "run"
    proc = run_verl("run", "data.batch_size=8", "rollout.n=4", "run.val_every=0", "run.val_before_train=false",
                    "run.threads=1", 'reward.isolation="none"', "run.max_steps=2",
                    f"run.output_dir='{out}'")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "ppo/actor_loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["actor/old_log_probs_reused"] == 1.0
        assert r.get("timing/old_log_probs", 0.0) < 1e-3  # no forward: the node only says it skipped
