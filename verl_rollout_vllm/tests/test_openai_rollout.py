"""The ``openai`` rollout against a real vLLM OpenAI server started on 127.0.0.1 by the session.

The rollout contract runs with ``weight_sync = "checkpoint"``, so the weight tests go through the
server's own reload endpoint. Retries are checked through a small fault-injecting proxy in front of
the real server (it fails the first requests with 503, then forwards); every answer still comes
from vLLM.
"""

from __future__ import annotations

import http.server
import threading
from typing import Any, Iterator

import pytest
import torch

from verl_core.contracts import ModelSpec, SamplingParams
from verl_core.testing import RolloutConformance
from verl_rollout_vllm.external import OpenAIRollout, OpenAIRolloutConfig, ServerError

pytestmark = pytest.mark.vllm


def _client(url: str, tokenizer: Any, model_dir: str, **changes: Any) -> OpenAIRollout:
    config = OpenAIRolloutConfig(base_url=url, **changes)
    config.validate()
    return OpenAIRollout(config=config, model=ModelSpec(path=model_dir), tokenizer=tokenizer)


class TestOpenAIRolloutConformance(RolloutConformance):
    @pytest.fixture(scope="class")
    def engine(self, vllm_server: str, tokenizer: Any, model_dir: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIRollout]:
        engine = _client(vllm_server, tokenizer, model_dir, weight_sync="checkpoint",
                         sync_dir=str(tmp_path_factory.mktemp("sync")))
        yield engine
        engine.close()

    @pytest.fixture
    def prompt_ids(self, prompts: list[list[int]]) -> list[list[int]]:
        return prompts

    @pytest.fixture(scope="class")
    def reference_model(self, model_dir: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class _FaultyProxy(http.server.ThreadingHTTPServer):
    """Forwards to the real server after failing the first ``fail_first`` POSTs with 503."""

    def __init__(self, upstream: str, fail_first: int) -> None:
        import httpx

        self.upstream = httpx.Client(base_url=upstream, timeout=60)
        self.fail_first = fail_first
        self.posts = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _ProxyHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: _FaultyProxy

    def log_message(self, *args: Any) -> None:  # keep the test output quiet
        pass

    def do_GET(self) -> None:
        self._reply(self.server.upstream.get(self.path))

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        with self.server.lock:
            self.server.posts += 1
            fail = self.server.posts <= self.server.fail_first
        if fail:
            self.send_response(503)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._reply(self.server.upstream.post(self.path, content=body,
                                              headers={"content-type": "application/json"}))

    def _reply(self, response: Any) -> None:
        self.send_response(response.status_code)
        self.send_header("Content-Type", response.headers.get("content-type", "application/json"))
        self.send_header("Content-Length", str(len(response.content)))
        self.end_headers()
        self.wfile.write(response.content)


@pytest.fixture
def faulty_proxy(vllm_server: str) -> Iterator[_FaultyProxy]:
    proxy = _FaultyProxy(vllm_server, fail_first=3)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield proxy
    proxy.shutdown()
    proxy.server_close()


def test_transient_failures_are_retried(faulty_proxy: _FaultyProxy, tokenizer: Any, model_dir: str,
                                        prompts: list[list[int]]) -> None:
    engine = _client(faulty_proxy.url, tokenizer, model_dir, max_retries=4, backoff_s=0.01, max_concurrency=1)
    try:
        out = engine.generate(prompts[:1], sampling=SamplingParams(n=2, max_new_tokens=4, seed=0))
    finally:
        engine.close()
    assert len(out.response_ids) == 2
    assert engine.retries == 3 and faulty_proxy.posts == 4


def test_retries_give_up_with_a_clear_error(faulty_proxy: _FaultyProxy, tokenizer: Any, model_dir: str,
                                            prompts: list[list[int]]) -> None:
    engine = _client(faulty_proxy.url, tokenizer, model_dir, max_retries=1, backoff_s=0.01)
    try:
        with pytest.raises(ServerError, match="after 2 attempts: HTTP 503"):
            engine.generate(prompts[:1], sampling=SamplingParams(n=1, max_new_tokens=4, seed=0))
    finally:
        engine.close()


def test_cache_answers_repeated_requests(vllm_server: str, tokenizer: Any, model_dir: str,
                                         prompts: list[list[int]]) -> None:
    engine = _client(vllm_server, tokenizer, model_dir, cache=True)
    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=6)
    try:
        first = engine.generate(prompts, sampling=greedy)
        sent = engine.requests_sent
        again = engine.generate(prompts, sampling=greedy)
    finally:
        engine.close()
    assert sent == len(prompts) and engine.requests_sent == sent, "repeated prompts must not reach the server"
    assert engine.cache_hits == len(prompts)
    assert again.response_ids == first.response_ids and again.log_probs == first.log_probs


def test_batched_requests_give_the_same_greedy_answers(vllm_server: str, tokenizer: Any, model_dir: str,
                                                       prompts: list[list[int]]) -> None:
    single = _client(vllm_server, tokenizer, model_dir)
    batched = _client(vllm_server, tokenizer, model_dir, prompts_per_request=3)
    greedy = SamplingParams(n=2, greedy=True, max_new_tokens=6)
    try:
        a = single.generate(prompts, sampling=greedy)
        b = batched.generate(prompts, sampling=greedy)
    finally:
        single.close()
        batched.close()
    assert batched.requests_sent == 2  # 4 prompts, 3 per request
    assert a.response_ids == b.response_ids and a.finish_reasons == b.finish_reasons


def test_weight_sync_is_the_users_job_by_default(vllm_server: str, tokenizer: Any, model_dir: str) -> None:
    engine = _client(vllm_server, tokenizer, model_dir)
    try:
        with pytest.raises(NotImplementedError, match="user's responsibility"):
            engine.load_weights(iter([]))
    finally:
        engine.close()
