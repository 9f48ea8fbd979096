"""Real packages: every distribution builds (wheel and sdist), and a fresh virtualenv installs from the wheelhouse.

The virtualenv is a clean one (no ``--system-site-packages``): ``verl`` and ``verl-rollout-vllm`` come from
the wheelhouse built here, their sibling distributions too (``--find-links``), everything else from the
registry, torch at this environment's version (a machine's local wheel where pip has one). It must list
its plugins and train 2 steps. ``verl`` is installed by its file: PyPI's ``verl`` is another project.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

ROOT = Path(__file__).resolve().parent.parent


def _build_script():
    spec = importlib.util.spec_from_file_location("build_wheels", ROOT / "scripts" / "build_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]


def test_every_distribution_builds_and_a_fresh_virtualenv_installs_and_trains(tmp_path, verl_cache):
    pytest.importorskip("build", reason="pip install build (requirements-dev.txt has it)")
    import torch

    wheelhouse = tmp_path / "wheelhouse"
    script = _build_script()
    # Every pyproject asks for the same build backend; this environment's copy saves a build env per package.
    flags = ["--no-isolation"] if importlib.util.find_spec("hatchling") else []
    built = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_wheels.py"), str(wheelhouse), *flags],
                           capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0, (built.stdout + built.stderr)[-4000:]

    ours = set(script.distributions())
    assert {"verl", "verl-core", "verl-cli", "verl-rollout-vllm", "verl-executor-torchrun", "verl-backend-megatron"} <= ours
    wheels = {}
    for name in ours:
        stem = name.replace("-", "_")
        found = list(wheelhouse.glob(f"{stem}-*-py3-none-any.whl"))
        assert len(found) == 1 and list(wheelhouse.glob(f"{stem}-*.tar.gz")), name
        wheels[name] = found[0]
        for req in _requirements(found[0]):
            assert " @ " not in req, f"{name} names {req!r} by location; a release needs a version range"
            dep = re.match(r"[A-Za-z0-9_.-]+", req).group(0).replace("_", "-").lower()
            if dep in ours:  # a sibling: a compatible range, never a pin
                assert re.search(r"<\S*>=|>=\S*<", req.split(";")[0].replace(",", "")), (name, req)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)  # clean: nothing from this environment's site-packages
    python, verl_cli = env_dir / "bin" / "python", env_dir / "bin" / "verl"
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    torch_version = torch.__version__.split("+")[0]
    install = subprocess.run([str(python), "-m", "pip", "install", "--find-links", str(wheelhouse),
                              str(wheels["verl"]), "verl-rollout-vllm>=0.1,<0.2", f"torch=={torch_version}"],
                             capture_output=True, text=True, env=clean_env, timeout=1800)
    assert install.returncode == 0, (install.stdout + install.stderr)[-4000:]

    where = subprocess.run([str(python), "-c", "import verl, verl_core, verl_rollout_vllm; "
                            "print(verl.__file__, verl_core.__file__, verl_rollout_vllm.__file__)"],
                           capture_output=True, text=True, env=clean_env, cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert all(str(env_dir) in path for path in where.stdout.split()), where.stdout  # installed, not this checkout

    listed = subprocess.run([str(verl_cli), "plugins", "list", "--json"], capture_output=True, text=True,
                            env=clean_env, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    plugins = {(p["kind"], p["name"]): p for p in json.loads(listed.stdout)}
    for key, dist in ((("rollout", "hf"), "verl-rollout-hf"), (("rollout", "vllm"), "verl-rollout-vllm"),
                      (("rollout", "openai"), "verl-rollout-vllm"), (("algorithm", "grpo"), "verl-algorithms"),
                      (("algorithm", "ppo"), "verl-algorithms"),
                      (("backend", "fsdp"), "verl-backend-fsdp"), (("executor", "torchrun"), "verl-executor-torchrun"),
                      (("scorer", "default"), "verl-rewards"), (("model", "tiny-qwen2-addition"), "verl-task-arithmetic"),
                      (("config_format", "verl-yaml"), "verl-config-import"),
                      (("data_reader", "standard"), "verl-data"), (("executor", "local"), "verl-executor-local"),
                      (("run_store", "local"), "verl-run-store")):
        assert plugins[key]["distribution"] == dist and plugins[key]["status"] == "available", plugins.get(key)

    out = tmp_path / "run"
    run = subprocess.run([str(verl_cli), "run", "--max-steps", "2", "--output-dir", str(out), "data.batch_size=8",
                          "rollout.n=4", "data.max_val_samples=16", "run.val_every=0", "run.threads=1"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=900,
                         env={**clean_env, "OMP_NUM_THREADS": "1", "VERL_CACHE_DIR": str(verl_cache)})
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "ppo/actor_loss" in r] == [1, 2]
