"""``verl report``: the dashboard's views as one self-contained HTML file (no server, no network).

The page, the vendored chart library and every run's data (metrics, samples, config, checkpoints,
status) are inlined; the page's script reads the embedded data instead of polling the server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from verl_dashboard.runs import RunSet
from verl_dashboard.server import static_file

__all__ = ["render_report", "write_report"]


def _inline_safe(text: str) -> str:
    # Inside <script>, "</" could close the element early; JSON allows "<\/" for "</".
    return text.replace("</", "<\\/")


def render_report(paths: Sequence[str]) -> str:
    """The report of the run directories (or folders of runs) ``paths`` as HTML text."""
    data = RunSet(paths).snapshot()
    page = static_file("index.html").decode()
    boot = json.dumps({"live": False, "interval_ms": 0})
    inline = {
        '<link rel="stylesheet" href="/static/vendor/uPlot.min.css">':
            f"<style>{static_file('vendor/uPlot.min.css').decode()}</style>",
        '<link rel="stylesheet" href="/static/app.css">': f"<style>{static_file('app.css').decode()}</style>",
        '<script src="/static/vendor/uPlot.iife.min.js"></script>':
            f"<script>{_inline_safe(static_file('vendor/uPlot.iife.min.js').decode())}</script>",
        '<script src="/static/app.js"></script>':
            f'<script type="application/json" id="verl-data">{_inline_safe(json.dumps(data, default=str))}</script>\n'
            f"<script>{_inline_safe(static_file('app.js').decode())}</script>",
    }
    for tag, replacement in inline.items():
        if tag not in page:
            raise RuntimeError(f"index.html lost {tag!r}; the report cannot inline it")
        page = page.replace(tag, replacement)
    return page.replace("/*VERL_BOOT*/", boot)


def write_report(paths: Sequence[str], output: Path) -> int:
    """Write the report to ``output``; returns its size in bytes."""
    text = render_report(paths)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(output)
    return len(text.encode())
