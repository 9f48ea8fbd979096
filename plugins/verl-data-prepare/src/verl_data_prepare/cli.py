"""``verl data ...``: the command group this package adds to ``verl`` (entry point ``verl.commands``: ``data``).

Imports only typer; the conversion (:mod:`verl_data_prepare.prepare`, pyarrow) loads when a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

__all__ = ["app"]

app = typer.Typer(help="Prepare datasets.", no_args_is_help=True)


@app.command("prepare")
def prepare(
    dataset: str = typer.Argument(..., help="gsm8k, math, geometry3k or mbpp."),
    inputs: List[Path] = typer.Option(..., "--input", "-i", help="The dataset's own file or directory "
                                      "(repeatable: e.g. train.jsonl and test.jsonl)."),
    output: Path = typer.Option(..., "--output", "-o", help="Directory for <split>.parquet."),
    split: Optional[str] = typer.Option(None, help="Split of every input (default: from each file's path)."),
    instruction: Optional[str] = typer.Option(None, help="Text appended to each question ('' for none)."),
    data_source: Optional[str] = typer.Option(None, help="data_source of the rows (default: verl's name)."),
) -> None:
    """Convert GSM8K / MATH / Geometry3K / MBPP files into verl-format parquet, extracting the ground truths."""
    from verl_core.kit import DataError

    from verl_data_prepare.prepare import prepare as run_prepare

    try:
        result = run_prepare(dataset, inputs, output, split=split, instruction=instruction, data_source=data_source)
    except (DataError, FileNotFoundError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    for name, s in result.splits.items():
        note = f"; skipped {s.skipped} without an answer (first: {s.first_skipped})" if s.skipped else ""
        typer.echo(f"{dataset} {name}: {s.rows} rows -> {s.path}{note}")
