"""Reading run directories while they are written, the JSON API, and the two commands, without a browser."""

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from verl_dashboard.runs import JsonLines, RunDirError, RunSet


def test_a_line_still_being_written_waits_for_its_newline(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    reader = JsonLines(path)
    assert [r["step"] for r in reader.refresh()] == [1]
    with open(path, "a") as f:
        f.write(': 2.0}\n')
    assert [r["step"] for r in reader.refresh()] == [1, 2]


def test_a_rewritten_file_is_read_again_from_the_start(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    reader = JsonLines(path)
    assert len(reader.refresh()) == 5 and reader.epoch == 1
    tmp = tmp_path / "new"
    tmp.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 3)))  # a rewound run: steps 1-2 kept
    tmp.replace(path)
    assert [r["step"] for r in reader.refresh()] == [1, 2] and reader.epoch == 2


def test_a_running_status_whose_process_is_gone_reads_as_failed(tmp_path: Path):
    import socket

    run = tmp_path / "r"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / "status.json").write_text(json.dumps({"status": "running", "pid": dead.pid, "host": socket.gethostname()}))
    status = RunSet([run]).get("r").status()
    assert status["status"] == "failed" and f"pid {dead.pid}" in status["error"]
    (run / "status.json").write_text(json.dumps({"status": "running", "pid": os.getpid(), "host": socket.gethostname()}))
    assert RunSet([run]).get("r").status()["status"] == "running"


def test_a_run_that_stopped_before_step_0_reads_as_failed_with_its_error(tmp_path: Path):
    import socket

    run = tmp_path / "r"
    run.mkdir()
    (run / "config.toml").write_text('[run]\nmax_steps = 5\n')  # all a run refused while starting leaves
    status = RunSet([run]).get("r").status()
    assert status["status"] == "failed" and "stopped before step 0" in status["error"], status
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = {"pid": dead.pid, "host": socket.gethostname(), "started": 0}
    (run / "run.lock").write_text(json.dumps(lock))  # killed while loading: its lock record stayed
    status = RunSet([run]).get("r").status()
    assert status["status"] == "failed" and f"pid {dead.pid}, was killed or crashed while starting" in status["error"]
    (run / "health.jsonl").write_text(json.dumps({"step": 0, "check": "start", "message": "data.train: no rows"}) + "\n")
    assert RunSet([run]).get("r").status()["error"] == "data.train: no rows"
    (run / "run.lock").write_text(json.dumps({**lock, "pid": os.getpid()}))  # still loading
    status = RunSet([run]).get("r").status()
    assert status["status"] == "running" and status["note"].startswith("starting")


def test_a_folder_of_runs_finds_runs_started_later(tmp_path: Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("")
    (tmp_path / "not-a-run").mkdir()
    runs = RunSet([tmp_path])
    assert [r.id for r in runs.runs()] == ["a"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.toml").write_text("[run]\nseed = 1\n")
    assert [r.id for r in runs.runs()] == ["a", "b"]
    assert runs.get("b").config()[1] == {"run.seed": 1}


def test_a_path_that_is_no_directory_is_refused_clearly(tmp_path: Path):
    with pytest.raises(RunDirError, match="is not a directory"):
        RunSet([tmp_path / "missing"])


def test_finished_runs_read_back(finished_runs: Path):
    runs = {r.id: r for r in RunSet([finished_runs]).runs()}
    assert sorted(runs) == ["grpo-a", "grpo-b"]
    a = runs["grpo-a"].summary()
    assert a["status"]["status"] == "completed" and a["status"]["step"] == 6
    assert [c["step"] for c in a["checkpoints"]] == [3, 6] and a["checkpoints"][-1]["latest"]
    assert [f["file"] for f in a["sample_files"]] == ["val_step_0.jsonl", "val_step_3.jsonl", "val_step_6.jsonl",
                                                      "train.jsonl"]
    assert len(runs["grpo-a"].samples("val_step_3.jsonl")) == 32
    assert a["config"]["run.max_steps"] == 6 and a["config"]["backend.lr"] != runs["grpo-b"].summary()["config"][
        "backend.lr"]
    with pytest.raises(KeyError):
        runs["grpo-a"].samples("../config.toml")  # only the listed samples files are served


def _wait_for_url(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:\d+/", line)
    assert match, line + proc.stderr.read()
    return match.group(0)


def test_verl_dashboard_serves_the_page_and_the_api(finished_runs: Path):
    proc = subprocess.Popen([sys.executable, "-m", "verl_cli", "dashboard", str(finished_runs), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = _wait_for_url(proc)
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        assert '"live": true' in page and "/static/vendor/uPlot.iife.min.js" in page
        assert urllib.request.urlopen(url + "static/vendor/uPlot.iife.min.js", timeout=10).read().startswith(
            b"/*! https://github.com/leeoniya/uPlot (v1.6.32)")
        runs = json.loads(urllib.request.urlopen(url + "api/runs", timeout=10).read())["runs"]
        assert [r["id"] for r in runs] == ["grpo-a", "grpo-b"]
        metrics = json.loads(urllib.request.urlopen(url + "api/metrics?run=grpo-a&from=2", timeout=10).read())
        lines = (finished_runs / "grpo-a" / "metrics.jsonl").read_text().splitlines()
        assert metrics["total"] == len(lines) and metrics["rows"] == [json.loads(x) for x in lines[2:]]
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url + "api/samples?run=grpo-a&file=..%2Fstatus.json", timeout=10)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_verl_dashboard_refuses_a_missing_directory(tmp_path: Path):
    res = subprocess.run([sys.executable, "-m", "verl_cli", "dashboard", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "is not a directory" in res.stderr


def test_verl_report_writes_one_self_contained_file(finished_runs: Path, tmp_path: Path):
    out = tmp_path / "report.html"
    res = subprocess.run([sys.executable, "-m", "verl_cli", "report", str(finished_runs), "-o", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"wrote {out}" in res.stdout
    html = out.read_text()
    assert not re.search(r"""(src|href)=["'](https?:|/static)""", html)  # nothing to fetch
    assert "leeoniya/uPlot" in html and '"live": false' in html
    data = json.loads(re.search(r'<script type="application/json" id="verl-data">(.*?)</script>', html,
                                re.S).group(1).replace("<\\/", "</"))
    assert [r["id"] for r in data["runs"]] == ["grpo-a", "grpo-b"]
    assert len(data["runs"][0]["samples"]["val_step_6.jsonl"]) == 32
