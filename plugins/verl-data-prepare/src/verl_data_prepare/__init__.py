"""``verl data prepare``: public datasets' own files (GSM8K, MATH) -> verl-format parquet.

:mod:`verl_data_prepare.prepare` holds the conversion, :mod:`verl_data_prepare.cli` the ``verl data``
command group, registered under ``verl.commands``. Kept free of imports: ``verl`` loads the command
group at start-up, and the conversion only when it runs.
"""

__version__ = "0.1.0"
