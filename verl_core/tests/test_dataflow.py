"""Ordering of dataflow nodes from their declared reads and writes."""

import pytest

from verl_core.dataflow import Dataflow, DataflowError, Node


def names(flow: Dataflow) -> list[list[str]]:
    return [[n.name for n in level] for level in flow.levels]


def noop(ctx):
    return None


def test_independent_nodes_share_a_level():
    flow = Dataflow([
        Node("gen", noop, writes=("batch",)),
        Node("ref", noop, reads=("response_ids",), writes=("ref_log_probs",)),
        Node("values", noop, reads=("response_ids",), writes=("values",)),
        Node("adv", noop, reads=("ref_log_probs", "values"), writes=("advantages",)),
    ])
    assert names(flow) == [["gen"], ["ref", "values"], ["adv"]]


def test_reader_declared_before_writer_still_waits():
    flow = Dataflow([
        Node("gen", noop, writes=("batch",)),
        Node("adv", noop, reads=("values",), writes=("advantages",)),
        Node("values", noop, writes=("values",)),
    ])
    assert names(flow) == [["gen"], ["values"], ["adv"]]


def test_read_modify_write_keeps_declared_order():
    flow = Dataflow([
        Node("gen", noop, writes=("batch",)),
        Node("reward", noop, writes=("token_rewards",)),
        Node("kl", noop, reads=("token_rewards",), writes=("token_rewards",)),
        Node("adv", noop, reads=("token_rewards",), writes=("advantages",)),
    ])
    assert names(flow) == [["gen"], ["reward"], ["kl"], ["adv"]]


def test_batch_writer_is_a_barrier():
    flow = Dataflow([
        Node("gen", noop, writes=("batch",)),
        Node("reward", noop, writes=("scores",)),
        Node("filter", noop, reads=("scores",), writes=("batch",)),
        Node("lp", noop, writes=("old_log_probs",)),
    ])
    assert names(flow) == [["gen"], ["reward"], ["filter"], ["lp"]]


def test_missing_producer_is_an_error():
    with pytest.raises(DataflowError, match="reads 'values' but no node writes it"):
        Dataflow([Node("adv", noop, reads=("values",))])


def test_duplicate_and_unknown_after():
    with pytest.raises(DataflowError, match="duplicate"):
        Dataflow([Node("a", noop), Node("a", noop)])
    with pytest.raises(DataflowError, match="unknown node 'zz'"):
        Dataflow([Node("a", noop, after=("zz",))])


def test_undeclared_write_is_refused():
    from verl_core.dataflow import StepContext

    flow = Dataflow([Node("bad", lambda ctx: {"values": 1})])
    ctx = StepContext(step=1, prompts=[], algorithm=None, actor=None, rollout=None, reward=None, sampling=None)
    with pytest.raises(DataflowError, match="without declaring"):
        flow.run(ctx)


def test_run_parallel_gets_independent_nodes():
    seen = []

    def run_parallel(tasks):
        seen.append(len(tasks))
        return [t() for t in tasks]

    from verl_core.dataflow import StepContext

    flow = Dataflow([Node("a", noop, writes=("x",)), Node("b", noop, writes=("y",)),
                     Node("c", noop, reads=("x", "y"))])
    ctx = StepContext(step=1, prompts=[], algorithm=None, actor=None, rollout=None, reward=None, sampling=None)
    flow.run(ctx, run_parallel=run_parallel)
    assert seen == [2]
    assert set(ctx.metrics) == {"timing/a", "timing/b", "timing/c"}


def test_a_cycle_is_refused_naming_its_nodes():
    with pytest.raises(DataflowError, match="cycle: a -> b -> a"):
        Dataflow([Node("gen", noop, writes=("batch",)), Node("a", noop, reads=("x",), writes=("y",)),
                  Node("b", noop, reads=("y",), writes=("x",))])
