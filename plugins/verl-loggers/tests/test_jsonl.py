"""The ``jsonl`` logger: the run directory's record (metrics, samples, health, status), one row per step."""

from __future__ import annotations

import json

from verl_loggers import JsonlLogger


def test_the_jsonl_logger_records_samples_health_and_status_and_forgets_rewound_steps(tmp_path):
    sink = JsonlLogger()
    sink.verl_run_start(config=None, run_dir=tmp_path, start_step=0, max_steps=4)
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "running"
    for step in range(1, 5):
        sink.verl_metrics(step=step, metrics={"reward/mean": step / 10})
        sink.verl_samples(step=step, split="train", samples=[{"step": step, "response": f"r{step}"}])
        if step % 2 == 0:
            sink.verl_samples(step=step, split="val", samples=[{"step": step, "response": "v"}] * 3)
        sink.verl_health(step=step, check="kl", message="high")
    assert len((tmp_path / "samples" / "val_step_4.jsonl").read_text().splitlines()) == 3
    sink.verl_run_rewound(step=2, reason="worker died")
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["train.jsonl", "val_step_2.jsonl"]
    for name in ("metrics.jsonl", "samples/train.jsonl", "health.jsonl"):
        assert [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()] == [1, 2], name
    sink.verl_run_end(step=3, status="failed", error=FloatingPointError("loss is NaN"))
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and status["error"] == "FloatingPointError: loss is NaN"
    assert status["step"] == 3 and status["pid"] > 0


def test_the_jsonl_logger_starts_by_cutting_every_file_back_to_the_step_it_resumes_from(tmp_path):
    """What a killed run left past its checkpoint (step 5): rows of steps 6-8 and a line cut short by the kill."""
    rows = "".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in range(9))
    for name in ("metrics.jsonl", "health.jsonl", "samples/train.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(rows + '{"step": 9, "x"')
    for s in (4, 5, 6):
        (tmp_path / "samples" / f"val_step_{s}.jsonl").write_text(json.dumps({"step": s}) + "\n")
    logger = JsonlLogger()
    logger.verl_run_start(config=None, run_dir=tmp_path, start_step=5, max_steps=10)
    logger.verl_metrics(step=6, metrics={"x": 2.0})
    logger.verl_run_end(step=6, status="completed", error=None)
    steps = {name: [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()]
             for name in ("metrics.jsonl", "health.jsonl", "samples/train.jsonl")}
    assert steps == {"metrics.jsonl": [0, 1, 2, 3, 4, 5, 6], "health.jsonl": [0, 1, 2, 3, 4, 5],
                     "samples/train.jsonl": [0, 1, 2, 3, 4, 5]}
    assert sorted(p.name for p in (tmp_path / "samples").glob("val_step_*")) == ["val_step_4.jsonl",
                                                                                   "val_step_5.jsonl"]
    # From step 0 (nothing to resume), nothing of the earlier attempt stays.
    JsonlLogger().verl_run_start(config=None, run_dir=tmp_path, start_step=0, max_steps=10)
    assert (tmp_path / "metrics.jsonl").read_text() == "" and not list((tmp_path / "samples").glob("val_*"))
