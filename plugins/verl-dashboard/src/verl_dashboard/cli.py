"""The ``verl dashboard`` and ``verl report`` commands (``verl.commands`` plugins)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from verl_dashboard.runs import RunDirError

__all__ = ["dashboard", "report"]

_RUNS_HELP = "Run directories (verl run --output-dir), or folders holding run directories."


def dashboard(
    run_dirs: List[Path] = typer.Argument(..., help=_RUNS_HELP, show_default=False),
    port: int = typer.Option(8765, help="Port on the host (0: any free port)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on; the default is this machine only."),
    interval: float = typer.Option(1.0, help="Seconds between the page's updates."),
) -> None:
    """Serve a live web page of runs: charts, generated samples, config diff, checkpoints, status."""
    from verl_dashboard.server import make_server

    try:
        server = make_server([str(p) for p in run_dirs], host=host, port=port, interval_ms=int(interval * 1000))
    except RunDirError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        typer.secho(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    names = ", ".join(r.id for r in server.runs.runs()) or "none yet"
    typer.echo(f"verl dashboard: {server.url} (runs: {names}); Ctrl-C stops it", err=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def report(
    run_dirs: List[Path] = typer.Argument(..., help=_RUNS_HELP, show_default=False),
    output: Path = typer.Option(Path("report.html"), "--output", "-o", help="The HTML file to write."),
) -> None:
    """Write the dashboard's views of runs as one self-contained HTML file to share."""
    from verl_dashboard.report import write_report

    try:
        size = write_report([str(p) for p in run_dirs], output)
    except RunDirError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {output} ({size / 1e6:.2f} MB)")
