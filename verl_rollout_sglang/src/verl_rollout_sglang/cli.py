"""``verl sglang ...``: build and inspect SGLang's own environment (entry point ``verl.commands``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

__all__ = ["app"]

app = typer.Typer(help="SGLang's own Python environment (it pins its own torch).", no_args_is_help=True)


@app.command("setup")
def setup(
    venv: Optional[Path] = typer.Option(None, help="Where to build it (default: $VERL_SGLANG_VENV or "
                                        "~/.cache/verl/sglang-<version>)."),
    full: bool = typer.Option(False, help="Install sglang with all its CUDA packages (GPU machines)."),
) -> None:
    """Build the environment the sglang rollout launches its server with (idempotent)."""
    from verl_rollout_sglang.environment import SGLangEnvironmentError, build

    try:
        python = build(venv, full=full)
    except SGLangEnvironmentError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(f"SGLang's interpreter: {python}")


@app.command("info")
def info(server_python: str = typer.Option("", help="The rollout.server_python to check.")) -> None:
    """Say which interpreter the sglang rollout would launch its server with, and its versions."""
    import subprocess

    from verl_rollout_sglang.environment import SGLANG_VERSION, SGLangEnvironmentError
    from verl_rollout_sglang.environment import server_python as find

    try:
        python = find(server_python)
    except SGLangEnvironmentError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    done = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('sglang'), "
                           "m.version('torch'))"], capture_output=True, text=True)
    versions = done.stdout.split() if done.returncode == 0 else ["?", "?"]
    typer.echo(f"server python: {python}\nsglang: {versions[0]} (tested: {SGLANG_VERSION})\ntorch: {versions[-1]}")
