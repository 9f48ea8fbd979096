"""``verl run --dry-run`` refuses what ``verl run`` refuses, with the same exit code and message (issue 34).

Each bad input of the catalogue goes through the real CLI twice, as a dry run and as a run (``--max-steps 1``,
so that a dry run that missed an error costs one step, not a training run). A tiny model directory keeps the
built-in model out of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    return lines[-1] if lines else f"<no error line; last lines: {stderr.splitlines()[-3:]}>"


def _catalogue(tmp: Path, model: str) -> dict[str, list[str]]:
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    (tmp / "empty.jsonl").write_text("")
    (tmp / "a_file").write_text("")
    (tmp / "bad.jsonl").write_text('{"prompt": "ok", "answer": "1"}\nnot json\n')
    held = tmp / "held"
    held.mkdir()
    (held / "config.toml").write_text(f'[model]\npath = "{model}"\n[algorithm]\nname = "ppo"\n')
    # A checkpoint: a directory that holds only the config of a run that never saved one starts over.
    (held / "checkpoints" / "step_000001").mkdir(parents=True)
    (held / "checkpoints" / "step_000001" / "manifest.json").write_text("{}")
    (held / "checkpoints" / "latest").write_text("step_000001")
    base = ["--model", model, "--data", str(data), "reward.name=\"exact_match\"", "data.batch_size=2"]
    return {
        "algorithm typo": [*base, "--algo", "gpro"],
        "unknown key": [*base, "algorithm.clip_rati=0.3"],
        "negative lr": [*base, "backend.lr=-1"],
        "missing data file": [*base, "--data", str(tmp / "nope.jsonl")],
        "empty data file": [*base, "--data", str(tmp / "empty.jsonl")],
        "a bad data row": [*base, "--data", str(tmp / "bad.jsonl")],
        "model path missing": [*base, "--model", str(tmp / "no-model")],
        "batch larger than the data": [*base, "data.batch_size=100"],
        "no reward for the data_source": ["--model", model, "--data", str(data), "data.batch_size=2"],
        "unknown logger": [*base, "run.loggers=[\"console\", \"nope\"]"],
        "output dir is a file": [*base, "--output-dir", str(tmp / "a_file")],
        "resume of other settings": [*base, "--output-dir", str(held)],
        "megatron layout vs the model": [*base, "--backend", "megatron", "backend.tensor_parallel_size=3"],
        "async mode the local executor cannot run": [*base, "trainer.mode=\"separate_async\""],
    }


@pytest.mark.slow
def test_the_dry_run_refuses_what_the_run_refuses_with_the_same_message(run_verl, tmp_path: Path) -> None:
    from verl_core.testing import tiny_model_dir

    from concurrent.futures import ThreadPoolExecutor

    model = tiny_model_dir(tmp_path / "model")
    cases = _catalogue(tmp_path, model)

    def both(name: str) -> str | None:
        # The dry run first: a run that got past its checks may write what the dry run then reads.
        args = cases[name]
        out = ["--output-dir", str(tmp_path / "runs" / name.replace(" ", "_"))] if "--output-dir" not in args else []
        dry = run_verl("run", "--dry-run", *out, *args, timeout=120)
        real = run_verl("run", "--max-steps", "1", *out, *args, timeout=300)
        got = (dry.returncode, _error(dry.stderr)), (real.returncode, _error(real.stderr))
        return f"{name}: dry run {got[0]} / run {got[1]}" if got[0] != got[1] or got[0][0] != 2 else None

    # Two cases at a time (each its own directories): most of a case is the CLI's start-up, one core each.
    with ThreadPoolExecutor(max_workers=2) as pool:
        mismatches = [m for m in pool.map(both, cases) if m]
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.slow
def test_the_dry_run_answers_in_seconds(tmp_path: Path) -> None:
    """It checks everything without loading weights or engines: no Megatron, SGLang, vLLM or Ray import, no
    process started, nothing written. (What it takes on this machine is in its own report line; a timed
    assert would fail on a slower or busier machine, not on a slower dry run.)"""
    import subprocess
    import sys

    code = ("import sys; from typer.testing import CliRunner; from verl_cli.cli import app; "
            f"r = CliRunner().invoke(app, ['run', '--dry-run', '--backend', 'megatron', '--rollout', 'sglang', "
            f"'--algo', 'dapo', '--output-dir', {str(tmp_path / 'r')!r}]); print(r.exit_code); print(r.output); "
            "print(sorted(m for m in ('megatron.core', 'sglang', 'vllm', 'ray') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    exit_code, *output, engines = res.stdout.strip().splitlines()
    assert exit_code == "0", "\n".join(output)
    assert "dry run: the run would start" in "\n".join(output) and "no weights loaded" in "\n".join(output)
    assert engines == "[]", engines  # the engines' and backends' own packages are never imported
    assert not (tmp_path / "r").exists()
