"""``verl run --rollout vllm`` through the real CLI: a short run, a resume, and a start-up failure.

Each run is its own process (it starts its own in-process engine), so these are ``slow`` as well.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FAST = ["data.batch_size=16", "rollout.n=4", "data.max_val_samples=40", "run.val_every=0", "run.threads=1",
        "rollout.kv_cache_gb=0.25"]


def _run(*args: str, cache: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VERL_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(os.environ.get("VERL_TEST_CACHE_DIR") or tmp_path_factory.mktemp("verl-cache"))


def test_run_syncs_every_step_and_resumes_onto_checkpoint_weights(tmp_path: Path, cache: Path) -> None:
    out = tmp_path / "run"
    # With the truncated importance-sampling correction on, which needs the rollout's log-probs.
    res = _run("-m", "verl_cli", "run", "--rollout", "vllm", "--max-steps", "2", "--output-dir", str(out),
               *FAST, "algorithm.rollout_is_cap=2.0", cache=cache)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "ppo/actor_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["timing/sync_weights"] > 0 for r in train)
    # float32 vLLM and the FSDP trainer agree, so the importance weights are ~1.
    assert all(r["rollout/log_prob_diff_max"] < 1e-3 for r in train)
    assert all(abs(r["ppo/rollout_is_weight_mean"] - 1) < 1e-3 for r in train)
    assert [r["step"] for r in rows if "val/reward_mean" in r] == [0, 2]

    # Resuming must hand the checkpoint's weights to the engine before its first rollout.
    script = textwrap.dedent(f"""
        import torch
        from verl_core.trainer import Trainer
        from verl_task_arithmetic.addition import ensure_builtin_model
        from transformers import AutoModelForCausalLM
        t = Trainer.from_checkpoint({str(out)!r}, overrides=["run.max_steps=3"])
        t.setup()
        assert t.resumed_from.name == "step_000002"
        name = "model.embed_tokens.weight"
        actor = dict(t.actor.iter_weights())[name]
        engine = t.rollout._llm.collective_rpc(
            lambda worker: worker.model_runner.model.state_dict()[name].clone())[0]
        base = dict(AutoModelForCausalLM.from_pretrained(str(ensure_builtin_model())).named_parameters())[name]
        assert not torch.equal(actor, base.detach()), "two steps did not change the embedding"
        # vLLM pads the vocabulary rows of its embedding to a multiple of 64.
        assert torch.equal(engine[: actor.shape[0]], actor), "the engine did not get the checkpoint's weights"
        print("ok")
    """)
    res = _run("-c", script, cache=cache)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_engine_that_cannot_start_stops_the_run_with_the_fix(tmp_path: Path, cache: Path) -> None:
    res = _run("-m", "verl_cli", "run", "--rollout", "vllm", "--max-steps", "1", "--output-dir",
               str(tmp_path / "run"), *FAST[:-1], "rollout.kv_cache_gb=100000", cache=cache, timeout=300)
    text = res.stdout + res.stderr
    # A setting the machine cannot satisfy is a user error: exit 2, the key, the fix, no traceback.
    assert res.returncode == 2, text[-3000:]
    assert "error: rollout.kv_cache_gb: the vLLM engine could not start" in res.stderr, text[-3000:]
    assert "lower rollout.kv_cache_gb" in res.stderr and "Traceback" not in res.stderr


def test_lora_run_syncs_adapters_and_a_mismatch_is_a_config_error(tmp_path: Path, cache: Path) -> None:
    lora = ["backend.lora_rank=4", "backend.lora_sync=adapters"]
    out = tmp_path / "run"
    res = _run("-m", "verl_cli", "run", "--rollout", "vllm", "--max-steps", "2", "--output-dir", str(out),
               *FAST, *lora, "rollout.max_lora_rank=8", cache=cache)
    assert res.returncode == 0, res.stderr[-3000:]
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "ppo/actor_loss" in line]
    assert [r["step"] for r in train] == [1, 2]
    # The second step's rollout came from base + the adapter trained in step 1: same policy as the trainer.
    assert train[1]["rollout/log_prob_diff_max"] < 1e-3
    # An engine that serves no adapters is refused before the first step, naming the key.
    res = _run("-m", "verl_cli", "run", "--rollout", "vllm", "--max-steps", "1", "--output-dir",
               str(tmp_path / "bad"), *FAST, *lora, cache=cache)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "backend.lora_sync:" in res.stderr and "rollout.max_lora_rank" in res.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists() or "ppo/actor_loss" not in (
        tmp_path / "bad" / "metrics.jsonl").read_text()


def test_partial_rollouts_resume_carried_samples_on_vllm(tmp_path: Path, cache: Path) -> None:
    """trainer.mode='partial' (issue 33): samples cut at 1 token a round are resumed on the next weights from prompt +
    partial response (vLLM generates from token ids), carried across steps, and weighed against vLLM's log-probs."""
    out = tmp_path / "run"
    res = _run("-m", "verl_cli", "run", "--rollout", "vllm", "--max-steps", "3", "--output-dir", str(out),
               *FAST, "run.val_before_train=false", "trainer.mode='partial'", "trainer.token_budget=1", cache=cache)
    assert res.returncode == 0, res.stderr[-3000:]
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if "ppo/actor_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["partial/rounds"] >= 2 and r["timing/sync_weights"] > 0 for r in train)
    assert max(r["partial/staleness"] for r in train) >= 1 and max(r["partial/stale_token_frac"] for r in train) > 0
    # Stale tokens are weighed by min(pi_old / pi_vllm, 2): near 1 after one small update, and never the cap's mean.
    assert all(0.5 < r["ppo/rollout_is_weight_mean"] < 1.5 for r in train)
    state = json.loads((out / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert len(state["prompts"]) == 16
