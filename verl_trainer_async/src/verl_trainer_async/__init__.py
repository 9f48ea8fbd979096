"""Overlapping generation and training for verl (``trainer.mode = "colocate_async" | "separate_async"``)."""

__version__ = "0.1.0"
