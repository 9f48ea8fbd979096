"""Every kind of call the torchrun executor dispatches, on a worker whose methods run collectives.

``torchrun --nproc_per_node=2 spmd_calls.py OUT``: rank 0 writes what it saw to ``OUT`` (JSON).
Two executors run one after the other, as two ``train()`` calls in one script would.
"""

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

from verl_core.contracts import Role, TrainingWorker, dispatch
from verl_executor_torchrun.executor import TorchrunExecutor, TorchrunExecutorConfig


class Worker(TrainingWorker):
    """Each method does its share and a collective, so a rank left out would hang the others."""

    role = Role.ACTOR

    def __init__(self, world, tag):
        self.world, self.tag = world, tag

    def compute_log_probs(self, batch, *, with_entropy=False):
        raise NotImplementedError

    @dispatch("split")
    def double(self, values):
        total = torch.tensor([float(len(values))])
        dist.all_reduce(total)  # every rank takes part
        return [(2 * v, self.world.rank, int(total)) for v in values]

    @dispatch("all")
    def where(self):
        return {"rank": self.world.rank, "pid": os.getpid(), "tag": self.tag, "threads": self.world.threads}

    def rank_sum(self):  # "broadcast" (no mark): rank 0's answer
        total = torch.tensor([float(self.world.rank)])
        dist.all_reduce(total)
        return float(total)

    def iter_weights(self):  # a generator: one collective per item
        for i in range(3):
            t = torch.tensor([float(i + self.world.rank)])
            dist.all_reduce(t)
            yield f"w{i}", float(t)

    @contextlib.contextmanager
    def generation_module(self):
        ranks = [None] * self.world.world_size
        dist.all_gather_object(ranks, self.world.rank)  # entering is a collective
        yield ranks

    @dispatch("split")
    def fail_on(self, values, *, rank):
        if self.world.rank == rank:
            raise ValueError(f"bad value on rank {self.world.rank}")
        return list(values)


def make_worker(tag, world):
    return Worker(world, tag)


def main(out):
    import functools

    seen = {}
    for run in ("first", "second"):
        executor = TorchrunExecutor(TorchrunExecutorConfig())
        group = executor.create_group(role=Role.ACTOR, factory=functools.partial(make_worker, run))
        seen[run] = {
            "double": group.double([1, 2, 3]),  # 3 over 2 ranks: one padded value
            "where": group.where(),
            "rank_sum": group.rank_sum(),
            "weights": list(group.iter_weights()),
        }
        with group.generation_module() as ranks:
            seen[run]["context"] = ranks
            seen[run]["inside"] = group.rank_sum()  # a call while every rank is inside the context
        for rank in (1, 0):
            try:
                group.fail_on([1, 2], rank=rank)
            except ValueError as exc:
                seen[run][f"error_{rank}"] = [str(exc), getattr(exc, "__notes__", [])]
        seen[run]["after_errors"] = group.double([5, 6])
        half_read = group.iter_weights()
        seen[run]["first_weight"] = next(iter(half_read))
        del half_read  # closed: the other ranks finish the stream with this one
        seen[run]["after_stream"] = group.rank_sum()
        executor.shutdown()
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main(sys.argv[1])
