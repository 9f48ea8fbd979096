"""verl-cli: the ``verl`` command line, a front end over the core's public surface.

:mod:`verl_cli.cli` holds the commands (``main`` is the ``verl`` console script), :mod:`verl_cli.dryrun`
the report of ``verl run --dry-run`` and :mod:`verl_cli.export` ``verl export``. The runs themselves are
the core's (:mod:`verl_core.api`); ``python -m verl_cli`` is ``verl``.
"""

__version__ = "0.1.0"
