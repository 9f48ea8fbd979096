"""The sglang engine against a real SGLang server (CPU: SGLang's native-torch path)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_core.contracts import ModelSpec, SamplingParams
from verl_core.testing import RolloutConformance

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


class TestSGLangConformance(RolloutConformance):
    """The core's rollout contract, on one session-wide server."""

    # fp32 SGLang vs an fp32 HF forward: measured up to ~7e-5 (../shared/notes/sglang-cpu.md).
    logprob_atol = 1e-4

    @pytest.fixture
    def engine(self, sglang_engine: Any) -> Any:
        return sglang_engine

    @pytest.fixture
    def prompt_ids(self, prompts: list[list[int]]) -> list[list[int]]:
        return prompts

    @pytest.fixture(scope="class")
    def reference_model(self, model_dir: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def _greedy(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    return engine.generate(prompts, sampling=SamplingParams(n=1, greedy=True, max_new_tokens=8)).response_ids


def test_sync_bumps_the_weight_version_and_flushes_stale_prefixes(sglang_engine: Any, prompts: list[list[int]],
                                                                  model_dir: str) -> None:
    """After a sync, outputs come from the new weights even for prompts whose KV the radix cache
    held, every sample reports the new version, and restoring the weights restores the outputs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    original = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    before = _greedy(sglang_engine, prompts)  # fills the radix cache with these prompts
    version = sglang_engine.weight_version
    try:
        # Only the embeddings change: a stale prefix cache would keep serving the old prompt KV.
        sglang_engine.load_weights((n, t * 1.5 if "embed" in n else t) for n, t in original)
        out = sglang_engine.generate(prompts, sampling=SamplingParams(n=2, greedy=True, max_new_tokens=8))
        assert out.weight_version == version + 1
        assert out.response_ids[::2] != before
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(1.5)
        # The engine's log-probs are those of the new weights, not a mix with cached KV.
        ids, lps = out.response_ids[0], out.log_probs[0]
        logits = model(input_ids=torch.tensor([prompts[0] + ids])).logits[0, len(prompts[0]) - 1:-1]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert float((ref.detach() - torch.tensor(lps)).abs().max()) < 1e-4
    finally:
        sglang_engine.load_weights(iter(original))
    assert _greedy(sglang_engine, prompts) == before
    assert sglang_engine.weight_version == version + 2
    assert sglang_engine.last_sync_seconds > 0


def test_engine_on_cpu_says_it_cannot_seed_requests(sglang_engine: Any) -> None:
    # SGLang seeds single requests only with --enable-deterministic-inference, which it refuses for
    # the torch_native attention backend, the only one on a CPU.
    assert sglang_engine.device == "cpu" and sglang_engine.seeded_sampling is False
    assert sglang_engine.transport == "disk"  # torch 2.14.1 in SGLang's environment, not the trainer's


def _server_pids(group: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "-g", str(group)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_server_group_ends_with_close(model_dir: str, tokenizer: Any, tmp_path: Path) -> None:
    """close() leaves no process of the server's group (launcher, scheduler, detokenizer)."""
    from verl_rollout_sglang.engine import SGLangRollout, SGLangRolloutConfig

    engine = SGLangRollout(config=SGLangRolloutConfig(log_dir=str(tmp_path)),
                           model=ModelSpec(path=model_dir, dtype="float32"), tokenizer=tokenizer)
    group = engine.server.pid
    assert len(_server_pids(group)) >= 2, "expected the launcher and SGLang's scheduler in the group"
    engine.close()
    assert _server_pids(group) == []
    assert list(tmp_path.glob("sglang-server-*.log")), "the server's log must be kept in log_dir"


def test_no_server_process_outlives_a_killed_trainer(model_dir: str, tmp_path: Path) -> None:
    """kill -9 of the trainer: nothing in it can clean up, so the watchdog must end the group."""
    script = textwrap.dedent(f"""
        import sys, time
        from transformers import AutoTokenizer
        from verl_core.contracts import ModelSpec
        from verl_rollout_sglang.engine import SGLangRollout, SGLangRolloutConfig
        tok = AutoTokenizer.from_pretrained({model_dir!r})
        e = SGLangRollout(config=SGLangRolloutConfig(log_dir={str(tmp_path)!r}),
                          model=ModelSpec(path={model_dir!r}, dtype="float32"), tokenizer=tok)
        print(e.server.pid, flush=True)
        time.sleep(600)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        group = int(trainer.stdout.readline())
        assert _server_pids(group), "the server should be running"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 20
        while _server_pids(group) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _server_pids(group) == [], "server processes outlived the killed trainer"
    finally:
        trainer.kill()


def test_a_crashed_server_is_reported_with_its_log(model_dir: str, tokenizer: Any, tmp_path: Path) -> None:
    from verl_rollout_sglang.engine import SGLangRollout, SGLangRolloutConfig
    from verl_rollout_sglang.server import ServerStartError

    with pytest.raises(ServerStartError, match="exited with code") as info:
        SGLangRollout(config=SGLangRolloutConfig(log_dir=str(tmp_path), server_args={"context-length": "oops"}),
                      model=ModelSpec(path=model_dir, dtype="float32"), tokenizer=tokenizer)
    assert "context-length" in str(info.value)  # the log tail names what SGLang refused
