"""verl_kit.engine: the helpers engine plugins share."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
import torch

from verl_kit.engine import RetryingClient, ServerError, sample_seed, stop_token_ids, write_safetensors


class _Tok:
    eos_token_id = [5, 3]


def test_stop_ids_merge_eos_and_extra() -> None:
    assert stop_token_ids(_Tok(), (7, 3)) == [3, 5, 7]
    tok = _Tok()
    tok.eos_token_id = None
    assert stop_token_ids(tok) == []


def test_sample_seeds_are_distinct_and_independent_of_chunking() -> None:
    seeds = [sample_seed(10, p, 4, j) for p in range(3) for j in range(4)]
    assert len(set(seeds)) == 12 and seeds[0] == 10
    assert sample_seed(None, 2, 4) is None


def test_write_safetensors_shards_bounded_with_index(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    weights = [(f"w{i}", torch.full((256,), float(i))) for i in range(6)]  # 1 KiB each
    (tmp_path / "model.safetensors").write_bytes(b"stale")
    shards = write_safetensors(iter(weights), tmp_path, shard_bytes=2048)
    assert len(shards) == 3 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == [f"w{i}" for i in range(6)]
    loaded = {k: v for p in shards for k, v in load_file(str(p)).items()}
    assert all(torch.equal(loaded[n], t) for n, t in weights)
    assert not list(tmp_path.glob("*.tmp"))


class _Flaky(BaseHTTPRequestHandler):
    failures = 0
    calls = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        type(self).calls += 1
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if type(self).calls <= type(self).failures:
            self.send_response(503)
            self.send_header("retry-after", "0")
            self.end_headers()
            return
        body = json.dumps({"ok": type(self).calls}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def flaky() -> Iterator[type[_Flaky]]:
    handler = type("Handler", (_Flaky,), {"failures": 0, "calls": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield handler
    server.shutdown()


def test_client_retries_transient_statuses(flaky) -> None:
    flaky.failures = 2
    client = RetryingClient(flaky.url, max_retries=3, backoff_s=0.01)
    assert client.request("POST", "/x", {"a": 1}) == {"ok": 3}
    assert client.retries == 2 and client.requests_sent == 3


def test_client_gives_up_naming_the_url(flaky) -> None:
    flaky.failures = 10
    client = RetryingClient(flaky.url, max_retries=1, backoff_s=0.01)
    with pytest.raises(ServerError, match=r"POST http://127\.0\.0\.1:\d+/x failed after 2 attempts: HTTP 503"):
        client.request("POST", "/x", {})


def test_client_deadline_stops_retrying() -> None:
    client = RetryingClient("http://127.0.0.1:9", max_retries=50, backoff_s=0.2, deadline_s=0.5,
                            connect_timeout_s=0.2)
    with pytest.raises(ServerError, match="deadline"):
        client.request("GET", "/health")
