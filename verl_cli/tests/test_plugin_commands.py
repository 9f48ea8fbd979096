"""``verl.commands`` plugins: ``verl <name>`` subcommands that installed distributions add to ``verl``.

The test writes throw-away distributions (dist-info metadata plus a module) into a temporary directory,
so the real ``importlib.metadata`` discovery runs without installing anything.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import typer
from typer.testing import CliRunner

from verl_cli.cli import add_plugin_commands
from verl_core.registry import PluginRegistry

COMMANDS = """
    import typer

    group = typer.Typer()

    @group.command("hello")
    def hello(name: str = "verl"):
        print(f"hello {name}")

    def shout():
        print("HEY")

    not_a_command = 42
"""


def _distribution(site: Path, module: str, source: str, commands: dict[str, str]) -> None:
    """``module`` with ``source``, in a distribution that declares plugin API v3 and ``commands`` (name -> attr)."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.strip('_').replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[verl.commands]\n" + "".join(f"{n} = {module}:{a}\n" for n, a in
                                                                        commands.items()) + "\n[verl.plugin_api]\nv3 = unused\n")


def test_command_plugins_are_added_and_broken_ones_only_skipped(site: Path, capsys) -> None:
    _distribution(site, "_verl_cli_commands", COMMANDS,
                  {"greet": "group", "shout": "shout", "run": "shout", "odd": "not_a_command"})
    _distribution(site, "_verl_cli_commands_broken", "raise ImportError('needs a missing package')\n",
                  {"broken": "app"})
    registry = PluginRegistry(paths=[str(site)], core_version="0.1.0")
    app = typer.Typer()

    @app.command("run")
    def run() -> None:
        print("core run")

    try:
        add_plugin_commands(app, registry)
        add_plugin_commands(app, registry)  # idempotent: nothing is added twice
        notes = capsys.readouterr().err
        assert "skipping command plugin 'broken'" in notes and "needs a missing package" in notes
        assert "skipping command plugin 'run'" in notes and "already has a command of that name" in notes
        assert "skipping command plugin 'odd'" in notes
        runner = CliRunner()
        assert runner.invoke(app, ["greet", "hello", "--name", "you"]).output == "hello you\n"
        assert runner.invoke(app, ["shout"]).output == "HEY\n"
        assert runner.invoke(app, ["run"]).output == "core run\n"
    finally:
        for module in ("_verl_cli_commands", "_verl_cli_commands_broken"):
            sys.modules.pop(module, None)
