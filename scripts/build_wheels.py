"""Build every distribution of the monorepo (wheel and sdist) into one wheelhouse.

    python scripts/build_wheels.py dist/                # all of them, each in an isolated build env
    python scripts/build_wheels.py dist/ --only verl-core verl-rollout-vllm
    pip install --find-links dist/ "verl==0.1.0" "verl-rollout-vllm==0.1.0"   # the rest from the registry

``python -m build`` makes the sdist and then the wheel from the unpacked sdist, so a distribution
whose sdist leaves a file out fails here. Name the version of ``verl`` when installing from a
wheelhouse: PyPI's ``verl`` is another project with higher version numbers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def distributions() -> dict[str, Path]:
    """Every distribution's name and folder: the root, the top-level packages, ``plugins/*``."""
    folders = [ROOT, *sorted(p.parent for p in ROOT.glob("*/pyproject.toml")),
               *sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))]
    found = {}
    for folder in folders:
        name = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]
        found[name] = folder
    return found


def build(outdir: Path, names: list[str] | None = None, *, isolation: bool = True) -> list[str]:
    """Build the named distributions (all by default) into ``outdir``; returns the names that failed."""
    outdir.mkdir(parents=True, exist_ok=True)
    every = distributions()
    unknown = sorted(set(names or []) - set(every))
    if unknown:
        raise SystemExit(f"unknown distribution(s) {unknown}; the repository has {sorted(every)}")
    failed = []
    for name, folder in every.items():
        if names and name not in names:
            continue
        cmd = [sys.executable, "-m", "build", "--outdir", str(outdir), str(folder)]
        if not isolation:
            cmd.insert(3, "--no-isolation")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        status = "ok" if proc.returncode == 0 else "FAILED"
        print(f"{status:6} {name} ({folder.relative_to(ROOT) if folder != ROOT else '.'})", flush=True)
        if proc.returncode:
            print((proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
            failed.append(name)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="distributions to build (default: all)")
    parser.add_argument("--no-isolation", action="store_true",
                        help="build with this environment's hatchling instead of a fresh build env per distribution")
    args = parser.parse_args(argv)
    failed = build(args.outdir, args.only, isolation=not args.no_isolation)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
