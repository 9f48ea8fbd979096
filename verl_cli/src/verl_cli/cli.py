"""The ``verl`` command line: a thin layer over the core's public surface (``Trainer``, :mod:`verl_core.api`,
the config and the registry).

:func:`main` adds the commands of installed ``verl.commands`` plugins (``verl data`` comes from
verl-data-prepare) before parsing; ``app`` alone holds only verl-cli's own commands.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

app = typer.Typer(help="verl: reinforcement-learning post-training for language models.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)
plugins_app = typer.Typer(help="Inspect installed plugins.", no_args_is_help=True)
config_app = typer.Typer(help="Inspect configuration.", no_args_is_help=True)
app.add_typer(plugins_app, name="plugins")
app.add_typer(config_app, name="config")

USER_ERROR_EXIT = 2
#: A run that started and failed (diverged, a dead worker past run.max_restarts, a checkpoint that
#: cannot be written, a server that stopped answering). Preempted runs exit with
#: verl_core.api.PREEMPTED_EXIT (75), runs stopped at once by a signal with 128 + its number.
RUN_FAILED_EXIT = 1


def _user_errors() -> tuple[type[BaseException], ...]:
    from verl_core.config import ConfigError
    from verl_core.contracts import DataError, RewardError
    from verl_core.kit import CheckpointError
    from verl_core.registry import PluginError

    return (ConfigError, PluginError, DataError, CheckpointError, FileNotFoundError, RewardError)


def _guard(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; user mistakes become a short message and exit code 2, no traceback."""
    try:
        return fn()
    except _user_errors() as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(USER_ERROR_EXIT) from None


# Option of `verl run` and `verl config show` -> the config key it sets.
_FLAG_KEYS = {
    "backend": "backend.name", "rollout": "rollout.name", "algo": "algorithm.name", "model": "model.path",
    "data": "data.train", "output_dir": "run.output_dir", "max_steps": "run.max_steps", "save_every": "run.save_every",
    "resume": "run.resume", "seed": "run.seed", "executor": "executor.name", "nnodes": "executor.nnodes",
    "procs_per_node": "executor.procs_per_node", "env": "environment.name",
}


def _config_format(path: Optional[Path], registry: Any) -> Any:
    """The first installed ``verl.config_formats`` plugin, by name, that reads ``path`` (None: dotted
    overrides alone), or None."""
    for name in registry.names("config_format"):
        fmt = registry.load("config_format", name)()
        if fmt.reads(path):
            return fmt
    return None


def _formats_hint(registry: Any) -> str:
    names = registry.names("config_format")
    return f"installed formats: {', '.join(names)}" if names else \
        "verl's and TRL's YAML/JSON configs: pip install verl-config-import"


def _collect(options: dict[str, Any]) -> tuple[Any, Any]:
    """Resolve the config that a command's options (its ``locals()``) describe; also return the registry."""
    from verl_core.config import ConfigError, apply_overrides, load_raw_config, resolve_config
    from verl_core.registry import PluginRegistry

    registry = PluginRegistry()
    path = options["config"]
    fmt = _config_format(path, registry) if path is not None and path.suffix.lower() != ".toml" else None
    if fmt is not None:  # e.g. a verl or TRL YAML: mapped, the mapping shown
        raw, notes = fmt.read(path, registry=registry)
        typer.echo("\n".join(notes), err=True)
    else:
        try:
            raw = load_raw_config(path)
        except ConfigError:
            if path is None or path.suffix.lower() == ".toml" or not path.is_file():
                raise
            raise ConfigError("", f"{path} is not valid TOML, and no installed config format reads it "
                                  f"({_formats_hint(registry)})") from None
    for name, key in _FLAG_KEYS.items():
        # Only flags the user gave become keys: the local executor has no nnodes/procs_per_node settings.
        if options[name] is not None:
            section, _, setting = key.partition(".")
            raw.setdefault(section, {})[setting] = options[name]
    raw = apply_overrides(raw, options["overrides"] or [])
    return resolve_config(raw, registry), registry


_RUN_HELP = "Dotted overrides, e.g. algorithm.kl_coef=0.001 rollout.n=4"


@app.command()
def run(
    overrides: List[str] = typer.Argument(None, help=_RUN_HELP, show_default=False),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file."),
    backend: Optional[str] = typer.Option(None, help="Training backend plugin (default fsdp)."),
    rollout: Optional[str] = typer.Option(None, help="Rollout engine plugin (default hf)."),
    algo: Optional[str] = typer.Option(None, help="Algorithm plugin (default grpo)."),
    model: Optional[str] = typer.Option(None, help="Hugging Face model directory."),
    data: Optional[str] = typer.Option(None, help="Training data: parquet/jsonl file or builtin:addition."),
    output_dir: Optional[str] = typer.Option(None, help="Run directory."),
    max_steps: Optional[int] = typer.Option(None, help="RL steps in total."),
    save_every: Optional[int] = typer.Option(None, help="Checkpoint every N steps."),
    resume: Optional[str] = typer.Option(None, help="auto | never (start over) | force (resume whatever "
                                         "differs) | PATH."),
    seed: Optional[int] = typer.Option(None, help="Random seed."),
    executor: Optional[str] = typer.Option(None, help="Executor plugin: local (default, one process) or ray."),
    nnodes: Optional[int] = typer.Option(None, help="Nodes per worker group (multi-process executors)."),
    procs_per_node: Optional[int] = typer.Option(None, help="Worker processes per node (multi-process executors)."),
    env: Optional[str] = typer.Option(None, help="Multi-turn environment plugin (e.g. tools); runs its built-in "
                                      "task unless --model/--data say otherwise."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check everything the run checks before step 1 and "
                                 "describe the run (prompt, dataflow, placement, memory), without loading weights "
                                 "or starting engines; exit 0 if it would start, 2 with its error if not."),
) -> None:
    """Train. With no arguments: GRPO on the built-in addition task with a tiny model."""
    options = locals()
    if dry_run:
        _guard(lambda: _dry_run(options))
        return

    def go() -> None:
        import signal

        from verl_core import Trainer
        from verl_core.api import PREEMPTED_EXIT, RUN_FAILURES, CheckpointWriteError, Preempted

        cfg, registry = _collect(options)
        trainer = Trainer(cfg, registry=registry)
        try:
            metrics = trainer.train()
        except Preempted as exc:
            typer.secho(f"verl: {exc}", err=True)
            raise typer.Exit(PREEMPTED_EXIT) from None
        except KeyboardInterrupt as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            typer.secho(f"interrupted ({signal.Signals(signum).name}); the last complete checkpoint is kept", err=True)
            raise typer.Exit(128 + signum) from None
        except FloatingPointError as exc:
            typer.secho(f"error: training diverged: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None
        except CheckpointWriteError as exc:
            typer.secho(f"error: {exc}. Free space (or fix the disk) and run the same command again to resume, or "
                        f"set run.on_checkpoint_error=\"continue\" to go on without checkpoints that fail",
                        fg=typer.colors.RED, err=True)
            raise typer.Exit(RUN_FAILED_EXIT) from None
        except RUN_FAILURES as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(RUN_FAILED_EXIT) from None
        if "val/reward_mean" in metrics:
            typer.echo(f"final val/reward_mean {metrics['val/reward_mean']:.4f}")

    _guard(go)


def _dry_run(options: dict[str, Any]) -> None:
    from verl_cli.dryrun import dry_run

    cfg, registry = _collect(options)
    report = dry_run(cfg, registry)
    for line in report.lines:
        typer.echo(line)
    for warning in report.warnings:
        typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW)
    typer.echo(f"dry run: the run would start ({report.seconds:.1f} s; no weights loaded, nothing written)")


@config_app.command("check")
def config_check(
    overrides: List[str] = typer.Argument(None, help=_RUN_HELP, show_default=False),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file."),
    backend: Optional[str] = typer.Option(None), rollout: Optional[str] = typer.Option(None),
    algo: Optional[str] = typer.Option(None), model: Optional[str] = typer.Option(None),
    data: Optional[str] = typer.Option(None), output_dir: Optional[str] = typer.Option(None),
    max_steps: Optional[int] = typer.Option(None), save_every: Optional[int] = typer.Option(None),
    resume: Optional[str] = typer.Option(None), seed: Optional[int] = typer.Option(None),
    executor: Optional[str] = typer.Option(None), nnodes: Optional[int] = typer.Option(None),
    procs_per_node: Optional[int] = typer.Option(None), env: Optional[str] = typer.Option(None),
) -> None:
    """`verl run --dry-run` (same arguments): check the run before step 1 without loading weights; exit 0 or 2."""
    options = locals()
    _guard(lambda: _dry_run(options))


@config_app.command("import")
def config_import(
    items: List[str] = typer.Argument(..., help="A verl ppo_trainer.yaml-style file or TRL GRPOConfig/PPOConfig "
                                      "YAML/JSON, and/or verl's dotted overrides (data.train_batch_size=256 ...)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the TOML here (default: stdout)."),
) -> None:
    """Translate a verl or TRL config into ours: the TOML, with every key's mapping and what has no equivalent."""
    def go() -> None:
        from verl_core.config import ConfigError, dump_toml
        from verl_core.registry import PluginRegistry

        files = [i for i in items if "=" not in i]
        if len(files) > 1:
            raise ConfigError("", f"one file at a time, got {files}")
        registry = PluginRegistry()
        path = Path(files[0]) if files else None
        fmt = _config_format(path, registry)
        if fmt is None:
            raise ConfigError("", f"no installed config format reads {path or 'dotted overrides'} "
                                  f"({_formats_hint(registry)})")
        raw, notes = fmt.read(path, overrides=[i for i in items if "=" in i], registry=registry)
        text = "".join(f"# {line}\n" for line in notes) + "\n" + dump_toml(raw)
        if output is None:
            typer.echo(text, nl=False)
            return
        if output.exists():
            raise ConfigError("", f"{output} exists; give another --output or remove it")
        output.write_text(text)
        typer.echo("\n".join(notes))
        typer.echo(f"wrote {output}; check it with: verl config check -c {output}")

    _guard(go)


@config_app.command("show")
def config_show(
    overrides: List[str] = typer.Argument(None, help=_RUN_HELP, show_default=False),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file."),
    backend: Optional[str] = typer.Option(None), rollout: Optional[str] = typer.Option(None),
    algo: Optional[str] = typer.Option(None), model: Optional[str] = typer.Option(None),
    data: Optional[str] = typer.Option(None), output_dir: Optional[str] = typer.Option(None),
    max_steps: Optional[int] = typer.Option(None), save_every: Optional[int] = typer.Option(None),
    resume: Optional[str] = typer.Option(None), seed: Optional[int] = typer.Option(None),
    executor: Optional[str] = typer.Option(None), nnodes: Optional[int] = typer.Option(None),
    procs_per_node: Optional[int] = typer.Option(None), env: Optional[str] = typer.Option(None),
) -> None:
    """Print the resolved config (same arguments as `verl run`) as TOML, after a comment naming its defaults profile."""
    options = locals()

    def go() -> None:
        from verl_core.config import config_to_dict, dump_toml
        from verl_cli.dryrun import unset_keys

        cfg, _ = _collect(options)
        # Unset keys (a default that depends on other settings) as comments with what they resolve to.
        typer.echo(f"# profile: {cfg.profile}\n{dump_toml(config_to_dict(cfg), unset_keys(cfg))}", nl=False)

    _guard(go)


@plugins_app.command("list")
def plugins_list(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    kind: Optional[str] = typer.Option(None, help="Only this kind (backend, rollout, algorithm, ...)."),
    check: bool = typer.Option(False, "--check", help="Import every available plugin; those that fail show as "
                                                       "broken, with the error, and the exit code is 1."),
) -> None:
    """Every installed plugin with its kind, distribution, version and status (imports nothing without --check)."""
    import dataclasses

    from verl_core.registry import PluginError, PluginRegistry

    registry = PluginRegistry()
    infos = _guard(lambda: registry.list(kind))
    found: dict[tuple[str, str, str], str] = {}  # what --check found, per plugin
    if check:
        for info in infos:
            if info.status == "available":
                try:
                    registry.load(info.kind, info.name)
                    found[(info.kind, info.name, info.distribution)] = "imported OK"
                except PluginError:
                    pass  # the registry now lists it as broken, with the cause
        infos = registry.list(kind)
        for i in infos:
            found.setdefault((i.kind, i.name, i.distribution), {
                "broken": "import failed", "incompatible": "not imported: incompatible",
                "duplicate": "not imported: duplicate"}.get(i.status, "not imported"))
    if as_json:
        rows_json = [dataclasses.asdict(i) for i in infos]
        if check:
            for row, i in zip(rows_json, infos):
                row["check"] = found[(i.kind, i.name, i.distribution)]
        typer.echo(json.dumps(rows_json, indent=1))
        if check and any(i.status == "broken" for i in infos):
            raise typer.Exit(1)
        return
    header = ("KIND", "NAME", "DISTRIBUTION", "VERSION", "STATUS") + (("CHECK",) if check else ())
    rows = [header]
    rows += [(i.kind, i.name, i.distribution, i.version, i.status)
             + ((found[(i.kind, i.name, i.distribution)],) if check else ()) for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    for r in rows:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    for i in infos:
        if i.message:
            typer.echo(f"  {i.kind}/{i.name}: {i.message}")
    if check:
        counts = {what: sum(1 for v in found.values() if v == what) for what in dict.fromkeys(found.values())}
        typer.echo("check: " + ", ".join(f"{n} {what}" for what, n in counts.items()))
    if check and any(i.status == "broken" for i in infos):
        raise typer.Exit(1)


@app.command("export")
def export(path: Path = typer.Argument(..., help="A checkpoint, or a run directory (its latest checkpoint)."),
           hf_dir: Path = typer.Argument(..., help="Output Hugging Face model directory."),
           force: bool = typer.Option(False, "--force", help="Write into HF_DIR even if it is not empty."),
           store: str = typer.Option("local", "--store", help="The run store (run.store) that keeps the run.")) -> None:
    """Write a checkpoint's policy as a Hugging Face model (safetensors + tokenizer)."""
    def go() -> None:
        from verl_core.config import ConfigError
        from verl_cli.export import export_checkpoint

        if hf_dir.is_file():
            raise ConfigError("", f"{hf_dir} is a file; give a directory to write the model into")
        if hf_dir.is_dir() and any(hf_dir.iterdir()) and not force:
            held = sorted(p.name for p in hf_dir.iterdir())
            raise ConfigError("", f"{hf_dir} is not empty ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}); "
                                  f"export into a new or empty directory, or pass --force to write over what is there")

        ckpt = export_checkpoint(path, hf_dir, store=store)
        typer.echo(f"exported {ckpt} -> {hf_dir}")

    _guard(go)


@app.command()
def version() -> None:
    """Print the verl-core version and plugin API version."""
    from verl_core import __version__
    from verl_core.registry import PLUGIN_API_VERSION

    typer.echo(f"verl-core {__version__} (plugin API v{PLUGIN_API_VERSION})")


def add_plugin_commands(target: typer.Typer, registry: Any = None) -> None:
    """Add the installed ``verl.commands`` plugins to ``target``, each under its entry-point name.

    A plugin's object is a ``typer.Typer`` (added as a command group) or a function (one command).
    One that cannot be loaded, or whose name a core command already has, is skipped with a note
    on stderr: a broken command plugin must never break ``verl``.
    """
    from verl_core.registry import PluginError, PluginRegistry

    registry = registry or PluginRegistry()
    added = {g.name: g.typer_instance for g in target.registered_groups}
    taken = set(added) | {c.name or c.callback.__name__ for c in target.registered_commands if c.callback}
    for info in registry.list("command"):
        if info.status not in ("available", "broken"):
            typer.secho(f"verl: skipping command plugin {info.name!r}: {info.message}", err=True)
            continue
        try:
            obj = registry.load("command", info.name)
        except PluginError as exc:
            typer.secho(f"verl: skipping command plugin {info.name!r}: {exc}", err=True)
            continue
        if added.get(info.name) is obj:
            continue  # added by an earlier call
        if info.name in taken:
            typer.secho(f"verl: skipping command plugin {info.name!r} from {info.distribution}: "
                        f"verl already has a command of that name", err=True)
        elif isinstance(obj, typer.Typer):
            target.add_typer(obj, name=info.name)
        elif callable(obj):
            target.command(info.name)(obj)
        else:
            typer.secho(f"verl: skipping command plugin {info.name!r}: {type(obj).__name__} is neither a "
                        f"typer.Typer nor a function", err=True)
        taken.add(info.name)


def main() -> None:
    from verl_core.registry import PluginRegistry, provider_of

    registry = PluginRegistry()
    add_plugin_commands(app, registry)
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    provider = provider_of("command", name)
    if provider and name not in {i.name for i in registry.list("command")}:
        typer.secho(f"error: `verl {name}` is provided by a separate package: pip install {provider}",
                    fg=typer.colors.RED, err=True)
        raise SystemExit(USER_ERROR_EXIT)
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
