"""verl's ``ppo_trainer.yaml`` and TRL's GRPOConfig/PPOConfig as verl configs: ``verl config import`` and
``verl run -c ppo_trainer.yaml``.

:mod:`verl_config_import.importer` holds the key-by-key mapping and the ``verl-yaml`` config format,
registered under ``verl.config_formats``. Kept free of imports: ``verl plugins list`` imports nothing,
and ``verl`` loads the format only for a file that is not TOML.
"""

__version__ = "0.1.0"
