"""The charts' axes and legends read right (#34): what uPlot drew, read back from the page.

uPlot paints tick labels on a canvas; the page records the labels it drew, and its y range, on each chart
(``data-x-ticks``, ``data-y-ticks``, ``data-y-range``). The legend is HTML and is read as shown.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from test_browser import CHARTED, _open

# Four steps of two runs, with the values a real fine-tune logs: a constant and a warming-up learning rate
# around 1e-6, a KL of a few 1e-5, a reward stuck at one value, a clip fraction that stays 0, and a
# validation reward only one of the runs has.
STEPS = range(1, 5)
RUNS = {
    "lr-const": [{"step": s, "actor/lr": 1e-6, "ppo/kl_divergence": [1.2e-5, 3.4e-5, 2.1e-5, 5.0e-5][s - 1],
                  "reward/mean": 0.25, "response_length/clip_frac": 0.0,
                  **({"val/reward_mean": 0.3} if s % 2 == 0 else {})} for s in STEPS],
    "lr-warmup": [{"step": s, "actor/lr": 2.5e-7 * s, "ppo/kl_divergence": 1e-5 * s, "reward/mean": 0.25,
                   "response_length/clip_frac": 0.0} for s in STEPS],
}


@pytest.fixture
def written_runs(tmp_path) -> Path:
    for name, rows in RUNS.items():
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "status.json").write_text(json.dumps({"status": "completed", "step": 4, "max_steps": 4}))
    return tmp_path


def _chart(page, key: str) -> dict:
    # Charts draw one after another: wait until this one has (a loaded machine draws later than the first).
    page.wait_for_selector(f'.chart[data-key="{key}"][data-y-range]', state="attached", timeout=20_000)
    box = page.locator(f'.chart[data-key="{key}"]')
    lo, hi = (float(v) for v in box.get_attribute("data-y-range").split("|"))
    return {"x": box.get_attribute("data-x-ticks").split("|"), "y": box.get_attribute("data-y-ticks").split("|"),
            "range": (lo, hi)}


def _legend_rows(page, key: str) -> list[str]:
    """The legend's rows as shown: a row or cell that is not rendered is left out."""
    rows = page.locator(f'.chart[data-key="{key}"] .u-legend tr').evaluate_all(
        "rows => rows.filter((r) => r.getClientRects().length).map((r) => [...r.children]"
        ".filter((c) => c.getClientRects().length).map((c) => c.innerText).join(' '))")
    return [" ".join(r.split()) for r in rows if r.strip()]


def _numbers(labels: list[str]) -> list[float]:
    return [float(label) for label in labels]


def test_small_values_get_tick_labels_that_tell_them_apart(written_runs, dashboard, page, screenshot):
    _open(page, dashboard(written_runs).url)
    for key in ("actor/lr", "ppo/kl_divergence"):
        ticks = _chart(page, key)["y"]
        values = _numbers(ticks)  # scientific labels ("1e-6") parse; a bare "0" for 1e-6 would not be unique
        assert len(set(ticks)) == len(ticks) >= 2, (key, ticks)
        assert values == sorted(values) and max(values) > 0, (key, ticks)
        assert all(re.fullmatch(r"-?\d(\.\d+)?e-\d+|0", t) for t in ticks), (key, ticks)
    lo, hi = _chart(page, "actor/lr")["range"]
    assert 0 <= lo < 2.5e-7 and 1e-6 <= hi < 2e-6
    screenshot(page, "chart-axes")
    assert page.errors == []


def test_flat_series_get_a_padded_axis_around_their_value(written_runs, dashboard, page):
    _open(page, dashboard(written_runs).url)
    lo, hi = _chart(page, "reward/mean")["range"]
    assert lo < 0.25 < hi and hi - lo <= 0.25, (lo, hi)  # not 0-100
    lo, hi = _chart(page, "response_length/clip_frac")["range"]
    assert lo < 0 < hi <= 1, (lo, hi)
    ticks = _chart(page, "reward/mean")["y"]
    assert len(set(ticks)) == len(ticks) >= 2, ticks
    assert page.errors == []


def test_step_axes_have_integer_ticks(written_runs, dashboard, page):
    _open(page, dashboard(written_runs).url)
    for key in ("actor/lr", "reward/mean", "val/reward_mean", "ppo/kl_divergence"):
        ticks = _chart(page, key)["x"]
        assert ticks and all(re.fullmatch(r"\d+", t) for t in ticks), (key, ticks)
    assert page.errors == []


def test_legends_have_no_empty_rows(written_runs, dashboard, page):
    _open(page, dashboard(written_runs).url)
    # Not hovered: the legend is a key of the runs that have points on the chart, with no "--" values.
    assert _legend_rows(page, "actor/lr") == ["lr-const", "lr-warmup"]
    assert _legend_rows(page, "val/reward_mean") == ["lr-const"]  # lr-warmup has no validation
    label = page.locator('.chart[data-key="actor/lr"] .u-legend th').first
    assert label.evaluate("th => getComputedStyle(th, '::after').content") in ("none", '""')  # no "lr-const:"
    # Hovered: the step and each run's value at it, small values as they are.
    over = page.locator('.chart[data-key="actor/lr"] .u-over')
    box = over.bounding_box()
    over.hover(position={"x": box["width"] - 2, "y": box["height"] / 2})  # at the last step
    page.wait_for_selector('.chart[data-key="actor/lr"] .uplot:not(.idle)', timeout=5_000)
    rows = _legend_rows(page, "actor/lr")
    assert [r.split()[0] for r in rows] == ["step", "lr-const", "lr-warmup"], rows
    assert rows[0].split()[-1] == "4" and rows[1].split()[-1] == "1e-6" and rows[2].split()[-1] == "1e-6", rows
    assert not any("--" in r for r in rows)
    assert page.errors == []


@pytest.mark.slow
def test_real_runs_charts_have_integer_steps_and_readable_ticks(finished_runs, dashboard, page, screenshot):
    _open(page, dashboard(finished_runs).url)
    for key in CHARTED:
        chart = _chart(page, key)
        assert all(re.fullmatch(r"\d+", t) for t in chart["x"]), (key, chart["x"])
        assert len(set(chart["y"])) == len(chart["y"]) >= 2, (key, chart["y"])
        assert not any("--" in r for r in _legend_rows(page, key)), key
    screenshot(page, "charts-real-axes", full_page=True)
    assert page.errors == []
