"""Fixtures for the end-to-end tests: ``verl_cache`` (session cache) and ``run_verl`` (the real
CLI) live in the repository's root ``conftest.py``, shared with every distribution's tests."""
