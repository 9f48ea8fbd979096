"""verl-backend-megatron: the Megatron-Core training backend (tensor, pipeline and data parallel).

Registered as ``megatron`` under ``verl.backends``; :mod:`verl_backend_megatron.backend` holds it and is
imported only when the backend is used, so listing plugins imports no Megatron.
"""

__version__ = "0.1.0"
