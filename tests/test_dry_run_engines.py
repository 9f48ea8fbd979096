"""A rollout engine that cannot start stops ``verl run --dry-run`` as it stops ``verl run`` (issue 34).

SGLang without its environment (``verl sglang setup`` not run) and vLLM not installed: both engines' configs
check this when they are validated, so the dry run and the run stop with exit 2 and the same message, naming
the fix, before any model loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _args(tmp_path: Path) -> list[str]:
    from verl_core.testing import tiny_model_dir

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    return ["--model", tiny_model_dir(tmp_path / "model"), "--data", str(data), "reward.name=\"exact_match\"",
            "data.batch_size=2"]


def _dry_run_and_run(run_verl, tmp_path: Path, args: list[str], env: dict[str, str]):
    dry = run_verl("run", "--dry-run", "--output-dir", str(tmp_path / "dry"), *args, env=env, timeout=120)
    real = run_verl("run", "--max-steps", "1", "--output-dir", str(tmp_path / "real"), *args, env=env, timeout=300)
    return dry, real


def _error(stderr: str) -> str:
    return next((line for line in reversed(stderr.splitlines()) if line.startswith("error: ")), stderr[-500:])


@pytest.mark.slow
def test_sglang_without_its_environment(run_verl, tmp_path: Path) -> None:
    # No environment where `verl sglang setup` puts it, none named, and this interpreter has no sglang.
    env = {"VERL_SGLANG_VENV": str(tmp_path / "no-sglang-venv"), "VERL_SGLANG_PYTHON": ""}
    dry, real = _dry_run_and_run(run_verl, tmp_path, ["--rollout", "sglang", *_args(tmp_path)], env)
    assert (dry.returncode, _error(dry.stderr)) == (real.returncode, _error(real.stderr)) == (2, _error(dry.stderr))
    assert "run `verl sglang setup`" in _error(dry.stderr), dry.stderr[-2000:]
    assert "Loading weights" not in real.stderr and not (tmp_path / "dry").exists()


@pytest.mark.slow
def test_vllm_not_installed(run_verl, tmp_path: Path) -> None:
    # This environment without vLLM: sys.modules["vllm"] = None is how Python marks a module that cannot be
    # imported (find_spec answers None, `import vllm` raises ImportError), as on a machine without it.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    dry, real = _dry_run_and_run(run_verl, tmp_path, ["--rollout", "vllm", *_args(tmp_path)],
                                 {"PYTHONPATH": str(site)})
    assert (dry.returncode, _error(dry.stderr)) == (real.returncode, _error(real.stderr)) == (2, _error(dry.stderr))
    assert "needs vLLM, which is not installed" in _error(dry.stderr) and "pip install" in _error(dry.stderr)
    assert "Loading weights" not in real.stderr and not (tmp_path / "dry").exists()
