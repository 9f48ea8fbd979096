"""The dashboard in a real headless Chromium: charts, live updates, samples filters, config diff, runs, report.

Each view's screenshot is saved under the test's output (and copied to docs/dashboard/ with
VERL_UPDATE_SCREENSHOTS=1).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

CHARTED = ("reward/mean", "val/reward_mean", "ppo/kl_divergence", "ppo/actor_loss", "ppo/entropy",
           "response_length/mean", "throughput/tokens_per_sec", "memory/actor_peak_gb", "timing/generate",
           "timing/old_log_probs", "timing/update_actor", "timing/sync_weights")


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _points(runs: list[Path], key: str) -> int:
    """What a chart of ``key`` must plot: one point per step that has the key, for each run."""
    return sum(len({r["step"] for r in _rows(run) if isinstance(r.get(key), (int, float))}) for run in runs)


def _open(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector('[data-key="reward/mean"] canvas', timeout=20_000)


def _chart_points(page, key: str) -> int:
    return int(page.get_attribute(f'.chart[data-key="{key}"]', "data-points"))


def test_charts_plot_every_point_of_every_run(finished_runs, dashboard, page, screenshot):
    server = dashboard(finished_runs)
    _open(page, server.url)
    runs = [finished_runs / "grpo-a", finished_runs / "grpo-b"]
    for key in CHARTED:
        assert _chart_points(page, key) == _points(runs, key), key
        assert page.get_attribute(f'.chart[data-key="{key}"]', "data-runs") == "2"
    assert page.locator('.chart[data-key^="data/"]').count() == 0  # counts at step 0 are no curve
    assert _points(runs, "reward/mean") == 12 and _points(runs, "val/reward_mean") == 6  # steps 1-6; 0, 3, 6
    # Two runs overlaid: each chart's legend names both.
    legend = page.inner_text('.chart[data-key="reward/mean"] .u-legend')
    assert "grpo-a" in legend and "grpo-b" in legend
    # Hiding a run takes its points off the charts.
    page.uncheck('#legend input[data-run="grpo-b"]')
    assert _chart_points(page, "reward/mean") == 6
    page.check('#legend input[data-run="grpo-b"]')
    assert page.errors == []
    screenshot(page, "charts")
    screenshot(page, "charts-all", full_page=True)


def test_a_metrics_line_written_while_the_page_is_open_appears_without_reload(finished_runs, tmp_path, dashboard,
                                                                              page, screenshot):
    run = tmp_path / "live"
    shutil.copytree(finished_runs / "grpo-a", run)
    (run / "status.json").write_text(json.dumps({"status": "running", "pid": os.getpid(), "host": socket.gethostname(),
                                                 "max_steps": 8}))
    server = dashboard(run)
    _open(page, server.url)
    assert _chart_points(page, "reward/mean") == 6
    page.evaluate("window.notReloaded = true")
    last = _rows(run)[-2]
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**last, "step": 7, "reward/mean": 0.9}) + "\n")
        f.write('{"step": 8, "reward/mean": 0.95, "ppo/kl_diverg')  # half a line: not shown yet
    page.wait_for_function("document.querySelector('.chart[data-key=\"reward/mean\"]').dataset.points === '7'",
                           timeout=10_000)
    assert page.evaluate("window.notReloaded") is True
    assert page.inner_text('#legend .badge') == "running"
    with open(run / "metrics.jsonl", "a") as f:
        f.write('ence": 0.0}\n')
    page.wait_for_function("document.querySelector('.chart[data-key=\"reward/mean\"]').dataset.points === '8'",
                           timeout=10_000)
    # A health warning written by the run shows at the top of the page.
    (run / "health.jsonl").write_text(json.dumps({"step": 8, "check": "all_truncated", "message": "every response "
                                                  "hit the length limit"}) + "\n")
    page.wait_for_selector('#health .warning[data-check="all_truncated"]', timeout=10_000)
    screenshot(page, "live")
    # The run is rewound to step 3 (its metrics file rewritten): the chart starts over from the new file.
    kept = [r for r in _rows(run) if r["step"] <= 3]
    tmp = run / "metrics.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(run / "metrics.jsonl")
    page.wait_for_function("document.querySelector('.chart[data-key=\"reward/mean\"]').dataset.points === '3'",
                           timeout=10_000)
    assert page.evaluate("window.notReloaded") is True and page.errors == []


def test_the_samples_table_filters(finished_runs, dashboard, page, screenshot):
    server = dashboard(finished_runs)
    _open(page, server.url)
    page.click('nav button[data-view="samples"]')
    page.wait_for_selector("#samples-table tbody tr")
    assert page.input_value("#samples-file") == "val_step_6.jsonl"  # the latest validation first
    samples = [json.loads(line) for line in (finished_runs / "grpo-a" / "samples" / "val_step_6.jsonl").open()]
    table = "#samples-table tbody tr"
    assert page.locator(table).count() == len(samples) == 32

    page.select_option("#samples-filter", "wrong")
    wrong = [s for s in samples if s["reward"] < 1]
    assert 0 < len(wrong) < len(samples)  # the fixture has both kinds; otherwise this test proves nothing
    assert page.locator(table).count() == len(wrong)
    assert set(page.locator(f"{table} td.reward").all_inner_texts()) == {"0"}
    assert page.inner_text("#samples-count") == f"{len(wrong)} of 32 samples"
    screenshot(page, "samples")

    page.select_option("#samples-filter", "longest")
    tokens = [int(t) for t in page.locator(f"{table} td:nth-child(7)").all_inner_texts()]
    assert tokens == sorted((s["response_tokens"] for s in samples), reverse=True)
    page.select_option("#samples-filter", "lowest")
    rewards = [float(t) for t in page.locator(f"{table} td.reward").all_inner_texts()]
    assert rewards == sorted(s["reward"] for s in samples)

    page.select_option("#samples-filter", "all")
    prompt = samples[5]["prompt"]
    page.fill("#samples-search", prompt)
    assert page.locator(f"{table} td:nth-child(3)").all_inner_texts() == [
        s["prompt"] for s in samples if prompt in s["prompt"] or prompt in s["response"]]
    page.fill("#samples-search", "")
    page.select_option("#samples-file", "train.jsonl")
    page.wait_for_function("document.querySelector('#samples-table').dataset.rows === '24'", timeout=10_000)
    assert page.errors == []


def test_config_diff_and_the_runs_view(finished_runs, tmp_path, dashboard, page, screenshot):
    import tomllib

    from verl_dashboard.runs import flatten

    failed = tmp_path / "crashed"
    failed.mkdir()
    (failed / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n')
    (failed / "status.json").write_text(json.dumps({"status": "failed", "step": 1, "max_steps": 6,
                                                    "error": "FloatingPointError: at RL step 2: loss is NaN"}))
    server = dashboard(finished_runs, failed)
    _open(page, server.url)
    page.click('nav button[data-view="config"]')
    a, b = (flatten(tomllib.loads((finished_runs / n / "config.toml").read_text())) for n in ("grpo-a", "grpo-b"))
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    assert {"backend.lr", "run.seed", "run.output_dir"} <= set(differ)
    keys = page.locator("#config-diff tbody tr td:first-child").all_inner_texts()
    assert keys == differ
    assert page.inner_text("#diff-summary").startswith(f"{len(differ)} of ")
    assert "[algorithm]" in page.inner_text("#config-text")
    screenshot(page, "config")

    page.click('nav button[data-view="runs"]')
    row = '#runs-table tr[data-run="grpo-a"]'
    assert page.inner_text(f"{row} .badge") == "completed"
    assert page.locator(f"{row} td [data-step]").evaluate_all("els => els.map(e => e.dataset.step)") == ["3", "6"]
    assert "(latest)" in page.inner_text(f'{row} [data-step="6"]')
    assert "val_prompts: 32" in page.inner_text(f"{row} td.data")  # data.max_val_samples
    crashed = '#runs-table tr[data-run="crashed"]'
    assert page.inner_text(f"{crashed} .badge") == "failed"
    assert "loss is NaN" in page.inner_text(f"{crashed} .error")
    screenshot(page, "runs")
    assert page.errors == []


def test_the_report_shows_the_same_views_offline(finished_runs, tmp_path, page, screenshot):
    out = tmp_path / "report.html"
    res = subprocess.run([sys.executable, "-m", "verl_cli", "report", str(finished_runs), "-o", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    fetched = []
    page.route("**/*", lambda route: (fetched.append(route.request.url), route.continue_()))
    _open(page, out.as_uri())
    assert [u for u in fetched if not u.startswith("file:")] == []  # nothing from a network
    runs = [finished_runs / "grpo-a", finished_runs / "grpo-b"]
    for key in CHARTED:
        assert _chart_points(page, key) == _points(runs, key), key
    page.click('nav button[data-view="samples"]')
    page.select_option("#samples-filter", "wrong")
    samples = [json.loads(line) for line in (runs[0] / "samples" / "val_step_6.jsonl").open()]
    assert page.locator("#samples-table tbody tr").count() == sum(s["reward"] < 1 for s in samples)
    page.click('nav button[data-view="charts"]')
    screenshot(page, "report")
    assert page.errors == []


@pytest.mark.heavy
def test_a_real_run_is_followed_live(tmp_path, verl_cache, dashboard, page, screenshot):
    """A real `verl run` writing while the page is open: its points arrive without a reload, then it completes."""
    root = tmp_path / "runs"
    root.mkdir()
    server = dashboard(root)
    page.goto(server.url)
    overrides = ["data.batch_size=8", "rollout.n=4", "data.max_val_samples=32", "run.threads=1", "run.save_every=4",
                 "run.max_steps=12", "run.val_every=4"]
    proc = subprocess.Popen([sys.executable, "-m", "verl_cli", "run", "--output-dir", str(root / "live-run"),
                             *overrides], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        page.wait_for_selector('#legend input[data-run="live-run"]', timeout=300_000)
        page.evaluate("window.notReloaded = true")
        page.wait_for_function("Number((document.querySelector('.chart[data-key=\"reward/mean\"]') || "
                               "{dataset: {}}).dataset.points || 0) >= 3", timeout=300_000)
        if proc.poll() is None:
            assert page.inner_text("#legend .badge") == "running"
        screenshot(page, "live-run")
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
        page.wait_for_function("document.querySelector('#legend .badge').textContent === 'completed'",
                               timeout=30_000)
        page.wait_for_function("document.querySelector('.chart[data-key=\"reward/mean\"]').dataset.points === '12'",
                               timeout=30_000)
        assert page.evaluate("window.notReloaded") is True and page.errors == []
        screenshot(page, "live-run-completed", full_page=True)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
