"""``ExternalInferenceClient`` and the ``external_generate`` dataflow node against the session's real vLLM server.

The server (``vllm_server`` in conftest.py) serves the tiny model of ``model_dir``; a test that changes its
weights puts the originals back, since the other tests of the session compare the server with that model.
Retries go through the fault-injecting proxy of ``test_openai_rollout.py`` (every answer still from vLLM).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

from verl_rollout_vllm.client import ExternalInferenceClient, external_generate

@pytest.fixture
def fresh_server(vllm_server: str, tokenizer: Any, model_dir: str) -> Iterator[str]:
    """The server on ``model_dir``'s weights, before and after the test."""
    def restore() -> None:
        with ExternalInferenceClient(vllm_server, tokenizer=tokenizer, weight_sync="checkpoint",
                                     sync_dir=model_dir) as client:
            client.engine().reload_from_checkpoint(model_dir)

    restore()
    yield vllm_server
    restore()


def _addition_rows(tokenizer: Any, count: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(count):
        a, b = 10 + i, 20 + 3 * i
        ids = tokenizer.apply_chat_template([{"role": "user", "content": f"{a}+{b}="}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        rows.append({"prompt_ids": ids, "ground_truth": str(a + b), "data_source": "arithmetic"})
    return rows


@pytest.mark.vllm
@pytest.mark.slow
def test_generate_takes_text_chat_and_token_prompts_batched_and_cached(fresh_server, tokenizer, prompts):
    greedy = {"temperature": 0, "max_tokens": 6}
    chat = [{"role": "user", "content": "12+30="}]
    inputs = ["12+30=", chat, prompts[0]]
    with ExternalInferenceClient(fresh_server, tokenizer=tokenizer, sampling_params=greedy) as one, \
            ExternalInferenceClient(fresh_server, tokenizer=tokenizer, sampling_params=greedy,
                                    prompts_per_request=3) as batched:
        out = one.generate(inputs)
        assert len(out.response_ids) == len(out.texts) == len(out.finish_reasons) == 3
        assert all(0 < len(ids) <= 6 and len(lp) == len(ids) for ids, lp in zip(out.response_ids, out.log_probs))
        assert out.texts == tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        assert one.requests_sent == 3 and one.cache_hits == 0
        # The same three prompts in one request: the same greedy answers.
        assert batched.generate(inputs).response_ids == out.response_ids
        assert batched.requests_sent == 1
        # Asked again: answered from the cache, nothing sent.
        again = one.generate(inputs)
        assert again.response_ids == out.response_ids and one.cache_hits == 3 and one.requests_sent == 3
        # n samples per prompt, grouped by prompt; a new seed is a new request.
        sampled = one.generate(inputs[:2], sampling_params={"temperature": 1.0, "n": 3, "seed": 1})
        assert len(sampled.response_ids) == 6 and one.requests_sent == 5


@pytest.mark.vllm
@pytest.mark.slow
def test_transient_failures_are_retried(fresh_server, tokenizer):
    import threading

    from test_openai_rollout import _FaultyProxy

    proxy = _FaultyProxy(fresh_server, fail_first=2)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        with ExternalInferenceClient(proxy.url, model_name="tiny", tokenizer=tokenizer, backoff_s=0.01,
                                     sampling_params={"temperature": 0, "max_tokens": 4}) as client:
            out = client.generate(["1+1="])
        assert len(out.response_ids) == 1 and client.retries == 2
    finally:
        proxy.shutdown()
        proxy.server_close()


@pytest.mark.vllm
@pytest.mark.slow
def test_the_dataflow_node_is_the_rollout_stage_on_the_server(fresh_server, tokenizer):
    from verl_core.dataflow import DataflowBuilder, StepContext
    from verl_core.contracts import SamplingParams
    from verl_rewards.config import RewardConfig
    from verl_rewards.manager import RewardManager

    client = ExternalInferenceClient(fresh_server, weight_sync="ignore")  # the run's tokenizer is used
    df = DataflowBuilder()
    assert external_generate(df, client=client, sampling_params={"n": 2, "max_tokens": 4}) == "rollout"
    flow = df.build()
    rows = _addition_rows(tokenizer, 3)
    reward = RewardManager(config=RewardConfig(name="arithmetic", isolation="none"), tokenizer=tokenizer,
                           data_sources={"arithmetic"})

    def step(seed: int) -> StepContext:
        ctx = StepContext(step=1, prompts=rows, algorithm=None, actor=None, rollout=None, reward=reward,
                          sampling=SamplingParams(n=4, max_new_tokens=16, seed=seed), tokenizer=tokenizer)
        return flow.run(ctx)

    try:
        ctx = step(seed=7)
        batch = ctx.batch
        assert len(batch) == 6 and batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2]  # the node's n, not the run's
        assert batch.response_attention_mask.sum(-1).max() <= 4  # its max_tokens
        assert batch.scores is not None and batch.token_rewards.shape == batch.response_mask.shape
        assert "reward/mean" in ctx.metrics and batch.rollout_log_probs is not None
        assert client.requests_sent == 3
        step(seed=7)  # the same step again: every request answered from the cache
        assert client.cache_hits == 3 and client.requests_sent == 3
        step(seed=8)
        assert client.requests_sent == 6
    finally:
        client.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_a_grpo_run_samples_from_the_server_and_keeps_it_in_step(fresh_server, model_dir, tmp_path):
    from verl import DataConfig, GRPOTrainer

    client = ExternalInferenceClient(fresh_server, weight_sync="checkpoint", sync_dir=str(tmp_path / "sync"),
                                     sampling_params={"temperature": 1.0, "max_tokens": 8})
    trainer = GRPOTrainer(model_dir, data_config=DataConfig(dataset_name="builtin:addition", max_prompt_length=48),
                          inference_client=client, batch_size=4, learning_rate=1e-3, output_dir=tmp_path / "run",
                          overrides=["rollout.n=2", "run.val_every=0", "run.val_before_train=false",
                                     "data.max_val_samples=4", "run.threads=1", 'run.loggers=["jsonl"]'])
    rollout = trainer.config.rollout
    assert rollout.name == "openai" and rollout.config.base_url == fresh_server
    assert rollout.config.max_new_tokens == 8 and rollout.config.cache is True
    trainer.train(max_steps=2)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "ppo/actor_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # Step 2 sampled from the weights step 1 trained (written to sync_dir, reloaded by the server):
    # the server's log-probs are the trainer's to float precision.
    assert steps[1]["rollout/log_prob_diff_mean"] < 1e-4
    assert list((tmp_path / "sync").glob("*.safetensors"))


def test_settings_and_sampling_parameters_are_checked_before_any_request():
    with pytest.raises(ValueError, match=r"unknown \['temprature'\]; known: .*'temperature'"):
        ExternalInferenceClient("http://127.0.0.1:1", sampling_params={"temprature": 0.7})
    with pytest.raises(TypeError, match="unknown setting"):
        ExternalInferenceClient("http://127.0.0.1:1", retries=3)
    with pytest.raises(ValueError, match="base_url"):
        ExternalInferenceClient("127.0.0.1:8000")
    client = ExternalInferenceClient("http://127.0.0.1:1", max_concurrency=4,
                                     sampling_params={"temperature": 0.7, "max_tokens": 256, "n": 4})
    sampling = client.sampling({"seed": 3})
    assert (sampling.temperature, sampling.max_new_tokens, sampling.n, sampling.seed) == (0.7, 256, 4, 3)
    assert client.sampling({"temperature": 0}).greedy
    assert client.rollout_settings() == {"name": "openai", "base_url": "http://127.0.0.1:1", "max_concurrency": 4,
                                         "cache": True, "temperature": 0.7, "max_new_tokens": 256, "n": 4}
    with pytest.raises(ValueError, match="greedy"):
        ExternalInferenceClient("http://127.0.0.1:1", sampling_params={"temperature": 0}).rollout_settings()
    with pytest.raises(ValueError, match="tokenizer"):
        client.generate(["1+1="])  # nothing was sent: no tokenizer to encode or stop with
    df_nodes = []

    class Builder:  # records what the node declares (the real builder is exercised against the server)
        def node(self, name, fn, **kw):
            df_nodes.append((name, kw["writes"]))
            return name

    with pytest.raises(ValueError, match="max_tokens"):
        external_generate(Builder(), client=client, sampling_params={"max_tokens": 0})
    external_generate(Builder(), client=client)
    assert df_nodes == [("rollout", ["batch", "scores", "token_rewards"])]
