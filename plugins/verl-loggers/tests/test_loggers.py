"""The sinks are registered from this package; the tensorboard and wandb sinks write what a run emits."""

import json
import time
from pathlib import Path

import pytest

from verl_core.registry import PluginRegistry


def test_every_sink_is_registered_from_this_package():
    registry = PluginRegistry()
    for name in ("console", "jsonl", "tensorboard", "wandb"):
        assert registry.info("logger", name).distribution == "verl-loggers"


def test_tensorboard_writes_the_scalars(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from verl_loggers import TensorBoardLogger

    sink = TensorBoardLogger()
    sink.verl_run_start(config=None, run_dir=tmp_path, start_step=0, max_steps=2)
    sink.verl_metrics(step=1, metrics={"reward/mean": 0.5, "note": "skipped", "flag": True})
    sink.verl_run_end(step=1, status="completed", error=None)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["reward/mean"]
    assert [e.value for e in events.Scalars("reward/mean")] == [0.5]


def test_wandb_without_the_package_says_what_to_install(tmp_path: Path, monkeypatch):
    import sys

    from verl_loggers import WandbLogger

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RuntimeError, match="pip install wandb"):
        WandbLogger().verl_run_start(config=None, run_dir=tmp_path, start_step=0, max_steps=1)


SAMPLES = [{"step": 3, "split": "val", "index": 0, "prompt": "2+2=", "response": "4", "ground_truth": "4", "reward": 1.0,
            "response_tokens": 2, "finish_reason": "stop"},
           {"step": 3, "split": "val", "index": 1, "prompt": "1+2=", "response": "a|b\nc", "ground_truth": "3",
            "reward": 0.0, "response_tokens": 4, "finish_reason": "length"}]


def _tensorboard_texts(folder: Path) -> dict[str, list[tuple[int, str]]]:
    """Every text summary in the event files of ``folder``: tag -> [(step, markdown)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    return {tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in events.Tensors(tag)]
            for tag in events.Tags()["tensors"]}


def test_tensorboard_writes_the_samples_as_a_text_table(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from verl_loggers import TensorBoardLogger

    sink = TensorBoardLogger()
    sink.verl_run_start(config=None, run_dir=tmp_path, start_step=0, max_steps=3)
    sink.verl_samples(step=3, split="val", samples=SAMPLES)
    sink.verl_run_end(step=3, status="completed", error=None)
    texts = _tensorboard_texts(tmp_path / "tensorboard")
    [(step, table)] = texts["samples/val/text_summary"]
    lines = table.splitlines()
    assert step == 3 and lines[0].startswith("| step | index | prompt | response |")
    assert lines[2] == "| 3 | 0 | 2+2= | 4 | 4 | 1.0 | 2 | stop |"
    assert "a\\|b<br>c" in lines[3]  # a pipe or newline in a response cannot break the table


def _wandb_records(path: Path):
    """The records of a ``.wandb`` file (W&B's leveldb-style log: 7-byte header, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
            pending = b""
            yield record
        elif kind in (2, 3):
            pending += chunk


def _wandb_history(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The offline run's history rows (values decoded) and its logged tables (their JSON files)."""
    [log] = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    history = [{(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item}
               for r in _wandb_records(log) if r.WhichOneof("record_type") == "history"]
    tables = [json.loads(p.read_text()) for p in sorted(log.parent.glob("files/media/table/**/*.table.json"))]
    return history, tables


def test_wandb_offline_run_holds_the_scalar_history_and_the_samples_table(tmp_path: Path, monkeypatch):
    pytest.importorskip("wandb")
    from verl_core.config import resolve_config
    from verl_loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbLogger()
    sink.verl_run_start(config=resolve_config({}, PluginRegistry()), run_dir=tmp_path, start_step=0, max_steps=3)
    sink.verl_metrics(step=1, metrics={"reward/mean": 0.25, "note": "not a scalar"})
    sink.verl_metrics(step=3, metrics={"reward/mean": 0.75})
    sink.verl_samples(step=3, split="val", samples=SAMPLES)
    sink.verl_run_end(step=3, status="completed", error=None)
    # finish() returns once wandb's service process has the records; on a busy machine its writer may not have
    # flushed the last block of the .wandb file yet, so wait for the file (not for a fixed time) before reading.
    deadline = time.monotonic() + 60
    history, tables = _wandb_history(tmp_path)
    while len([h for h in history if "reward/mean" in h]) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
        history, tables = _wandb_history(tmp_path)
    assert [(h["_step"], h["reward/mean"]) for h in history if "reward/mean" in h] == [(1, 0.25), (3, 0.75)]
    assert all("note" not in h for h in history)
    [table] = tables
    assert table["columns"][:4] == ["step", "index", "prompt", "response"]
    assert [row[3] for row in table["data"]] == ["4", "a|b\nc"]


@pytest.mark.slow
def test_a_real_run_logs_scalars_and_samples_to_tensorboard_and_wandb(tmp_path: Path, run_verl):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    res = run_verl("run", "--max-steps", "2", "--output-dir", str(out), "data.batch_size=8", "rollout.n=4",
                   "data.max_val_samples=12", "run.val_every=2", "run.threads=1", "run.train_samples=2",
                   'run.loggers=["console", "jsonl", "tensorboard", "wandb"]',
                   env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    assert [s for s, _ in rewards] == [1, 2]

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("reward/mean")] == rewards
    texts = _tensorboard_texts(out / "tensorboard")
    assert [step for step, _ in texts["samples/val/text_summary"]] == [0, 2]
    assert [step for step, _ in texts["samples/train/text_summary"]] == [1, 2]
    val_2 = [json.loads(line) for line in (out / "samples" / "val_step_2.jsonl").read_text().splitlines()]
    assert len(texts["samples/val/text_summary"][1][1].splitlines()) == 2 + len(val_2)

    history, tables = _wandb_history(out)
    assert [(h["_step"], pytest.approx(h["reward/mean"])) for h in history if "reward/mean" in h] == rewards
    val_tables = [t for t in tables if len(t["data"]) == len(val_2)]
    assert [row[3] for row in val_tables[-1]["data"]] == [s["response"] for s in val_2]
