"""The dashboard's web server: the standard library's ``http.server``, on 127.0.0.1 by default.

It serves the page (``static/``) and a small JSON API the page polls; a report (:mod:`verl_dashboard.report`)
embeds the same JSON instead. Threads, because a poll must not wait behind a large samples file.
"""

from __future__ import annotations

import json
import mimetypes
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlparse

from verl_dashboard.runs import RunSet

__all__ = ["DashboardServer", "make_server", "static_file"]


def static_file(name: str) -> bytes:
    """A file of the page (``index.html``, ``app.js``, ``vendor/uPlot.iife.min.js``, ...)."""
    root = resources.files("verl_dashboard") / "static"
    target = root.joinpath(*[part for part in name.split("/") if part not in ("", ".", "..")])
    return target.read_bytes()


class _Handler(BaseHTTPRequestHandler):
    server: "DashboardServer"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # the page polls every second; a line per request would drown the terminal

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, value: Any, status: int = HTTPStatus.OK) -> None:
        self._send(status, json.dumps(value, default=str).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        runs = self.server.runs
        try:
            if url.path in ("/", "/index.html"):
                page = static_file("index.html").replace(b"/*VERL_BOOT*/", json.dumps(
                    {"live": True, "interval_ms": self.server.interval_ms}).encode())
                self._send(HTTPStatus.OK, page, "text/html; charset=utf-8")
            elif url.path == "/favicon.ico":
                self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
            elif url.path.startswith("/static/"):
                name = url.path[len("/static/"):]
                kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
                self._send(HTTPStatus.OK, static_file(name), kind)
            elif url.path == "/api/runs":
                self._json({"runs": [r.summary() for r in runs.runs()], "live": True})
            elif url.path == "/api/metrics":
                epoch = int(query["epoch"]) if query.get("epoch") else None
                self._json(runs.get(query["run"]).metrics_since(int(query.get("from", 0)), epoch))
            elif url.path == "/api/samples":
                self._json({"samples": runs.get(query["run"]).samples(query["file"])})
            else:
                self._json({"error": f"no such page: {url.path}"}, HTTPStatus.NOT_FOUND)
        except (KeyError, FileNotFoundError, IsADirectoryError, ValueError) as exc:
            self._json({"error": f"not found: {exc}"}, HTTPStatus.NOT_FOUND)


class DashboardServer(ThreadingHTTPServer):
    """``runs`` served at ``http://host:port/``; the page polls every ``interval_ms``."""

    daemon_threads = True

    def __init__(self, runs: RunSet, host: str = "127.0.0.1", port: int = 8765, interval_ms: int = 1000) -> None:
        self.runs = runs
        self.interval_ms = interval_ms
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"


def make_server(paths: list[str], *, host: str = "127.0.0.1", port: int = 8765,
                interval_ms: int = 1000) -> DashboardServer:
    """A server for the run directories ``paths`` (port 0: any free port)."""
    return DashboardServer(RunSet(paths), host=host, port=port, interval_ms=interval_ms)
