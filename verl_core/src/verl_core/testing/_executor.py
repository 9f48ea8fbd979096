"""Conformance tests for :class:`~verl_core.contracts.Executor` implementations.

Subclass :class:`ExecutorConformance` and provide the fixture ``executor``: a new executor (its groups
of :attr:`ExecutorConformance.world_size` ranks, or of the size its config sets), shut down by the
suite. Workers are :class:`EchoWorker`, a module-level class, so the factory pickles into worker
processes. A multi-process executor also opts in to :meth:`test_a_dying_worker_ends_the_call` with
``kills_workers = True`` (an in-process executor would kill the test itself).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch

from verl_core.batch import Batch
from verl_core.contracts import Executor, Role, WorkerFailedError, WorldInfo, dispatch
from verl_core.testing._factories import make_batch

__all__ = ["ExecutorConformance", "EchoWorker"]


class EchoWorker:
    """A worker that says which rank ran a call and what it was given."""

    def __init__(self, world: WorldInfo, tag: str = "") -> None:
        self.world = world
        self.tag = tag

    @dispatch("split")
    def rows(self, batch: Batch) -> Batch:
        """Its shard back, each sample's score replaced by this rank."""
        return batch.replace(scores=torch.full((len(batch),), float(self.world.rank)))

    @dispatch("broadcast")
    def whoami(self, value: Any) -> tuple[int, str, Any]:
        return self.world.rank, self.tag, value

    @dispatch("all")
    def every(self) -> tuple[int, int]:
        return self.world.rank, self.world.world_size

    @dispatch("broadcast")
    def fail(self, message: str) -> None:
        raise ValueError(message)

    @dispatch("all")
    def die(self) -> None:
        if self.world.rank == self.world.world_size - 1:
            os._exit(3)


class ExecutorConformance:
    """Contract tests every executor must pass."""

    #: Ranks per group the ``executor`` fixture gives.
    world_size = 1
    #: The executor runs workers in processes of their own, so one may be killed.
    kills_workers = False

    @pytest.fixture
    def executor(self) -> Executor:
        pytest.fail(f"{type(self).__name__} must provide an `executor` fixture")

    @pytest.fixture
    def group(self, executor: Executor) -> Any:
        group = executor.create_group(role=Role.ACTOR, factory=functools.partial(EchoWorker, tag="actor"))
        yield group
        executor.shutdown()

    def test_group_has_its_role_and_size(self, group: Any) -> None:
        assert group.role is Role.ACTOR
        assert group.world_size == self.world_size

    def test_split_calls_come_back_in_the_batchs_order(self, group: Any) -> None:
        """Every sample comes back once, in its place, from the rank it was sent to."""
        batch = make_batch(batch_size=4 * self.world_size + 2, group_size=1, seed=4)
        out = group.rows(batch)
        assert isinstance(out, Batch) and len(out) == len(batch)
        assert torch.equal(out.response_ids, batch.response_ids) and torch.equal(out.prompt_ids, batch.prompt_ids)
        assert set(out.scores.tolist()) == {float(r) for r in range(self.world_size)}

    def test_broadcast_returns_rank_0s_answer_and_all_returns_every_ranks(self, group: Any) -> None:
        assert group.whoami({"x": [1, 2]}) == (0, "actor", {"x": [1, 2]})
        assert sorted(group.every()) == [(r, self.world_size) for r in range(self.world_size)]

    def test_a_worker_error_reaches_the_caller_with_its_message(self, group: Any) -> None:
        with pytest.raises(Exception, match="the reward table is empty"):
            group.fail("the reward table is empty")
        assert group.whoami(1)[0] == 0  # the group still serves

    def test_run_parallel_returns_results_in_task_order(self, executor: Executor) -> None:
        try:
            assert executor.run_parallel([lambda i=i: i * i for i in range(5)]) == [0, 1, 4, 9, 16]
        finally:
            executor.shutdown()

    def test_shutdown_twice_is_harmless(self, executor: Executor) -> None:
        executor.create_group(role=Role.CRITIC, factory=EchoWorker)
        executor.shutdown()
        executor.shutdown()

    def test_a_dying_worker_ends_the_call(self, group: Any) -> None:
        """A worker process that exits mid-call ends the call with WorkerFailedError naming role and rank."""
        if not self.kills_workers:
            pytest.skip("in-process executor: a dying worker is the controller itself")
        with pytest.raises(WorkerFailedError) as info:
            group.die()
        assert info.value.role == "actor" and info.value.rank == self.world_size - 1
