"""Fixtures of the Megatron backend's tests."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
import torch.distributed as dist

torch.set_num_threads(1)  # the machine is shared


@pytest.fixture(scope="module", autouse=True)
def _leave_process_group() -> Iterator[None]:
    """Leave torch.distributed and Megatron's parallel state as found, for later test modules."""
    was_initialized = dist.is_available() and dist.is_initialized()
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if not was_initialized and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
