"""The RL step as a dataflow graph (the HybridFlow idea).

An algorithm declares its step as nodes - the rollout stage, log-probs, values, advantages,
updates - each saying which :class:`~verl_core.batch.Batch` fields it reads and
writes. The controller derives the order from those data dependencies and runs nodes that do
not depend on each other together (the executor decides whether "together" means concurrently).

Declaring a custom algorithm::

    df = DataflowBuilder()
    df.rollout()                       # the run's rollout stage: generate, score, filter
    df.actor_log_probs()
    df.compute_advantages(my_algorithm)
    df.update_actor(my_algorithm)
    flow = df.build()

Generation belongs to the run, not to the algorithm: :meth:`DataflowBuilder.rollout` is one node
running the rollout stage (:mod:`verl_core.rollout_stage`), and what an algorithm needs from it
(DAPO's dynamic sampling, ReMax's greedy baseline) it asks for with a
:class:`~verl_core.contracts.RolloutRequest`. Offline algorithms build the batch from the prompt
rows' own columns instead (:meth:`DataflowBuilder.batch_from_data`). The trainer syncs the rollout
engine's weights after every step; no dataflow declares it.
"""

from __future__ import annotations

import graphlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from verl_core.batch import Batch
from verl_core.boundary import check_advantages

from verl_core.contracts import Algorithm, AlgorithmLoss, RolloutRequest
from verl_core.step_context import StepContext

__all__ = ["Node", "Dataflow", "DataflowBuilder", "StepContext", "DataflowError", "old_log_probs_reusable"]

# Pseudo-field every node reads; a node that writes it (generation, filtering) replaces the whole
# batch and so acts as a barrier.
BATCH = "batch"
# A node writes one entry of Batch.extras by declaring the field "extras.<name>".
EXTRAS_PREFIX = "extras."


class DataflowError(ValueError):
    """A dataflow that cannot run: a cycle, a missing producer, a duplicate node name."""


@dataclass(frozen=True)
class Node:
    """One step of the dataflow.

    Attributes:
        name: unique name, also used for timing metrics (``timing/<name>``).
        fn: ``fn(ctx) -> dict | Batch | None``: a dict of batch fields to set, a whole new batch
            (only for nodes that write ``"batch"``), or nothing.
        reads: batch fields the node needs.
        writes: batch fields the node sets.
        after: names of nodes that must finish first although no data passes between them.
        role: the worker role the node runs on (for placement and display).
    """

    name: str
    fn: Callable[["StepContext"], Any]
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    role: str | None = None


class Dataflow:
    """An ordered, validated set of nodes.

    Attributes:
        rollout_request: what the rollout node asks of the rollout stage (None: the step has no rollout
            node, as offline algorithms); the overlapping trainer modes' producer runs the stage with it.
        old_log_probs_only_for_update: the old log-probs come from the actor's own forward and only the
            builder's actor update reads them, so the update may compute them itself (see
            :func:`old_log_probs_reusable`).
    """

    def __init__(self, nodes: Sequence[Node], *, rollout_request: RolloutRequest | None = None,
                 old_log_probs_only_for_update: bool = False) -> None:
        self.nodes = list(nodes)
        self.levels = _levels(self.nodes)
        self.rollout_request = rollout_request
        self.old_log_probs_only_for_update = old_log_probs_only_for_update

    def describe(self) -> str:
        """One line per level: nodes on the same line may run concurrently."""
        return "\n".join(" | ".join(n.name for n in level) for level in self.levels)

    def run(self, ctx: StepContext, *, run_parallel: Callable[[list[Callable[[], Any]]], list[Any]] | None = None,
            ) -> StepContext:
        """Run every node in dependency order, applying each node's writes to ``ctx.batch``."""
        for level in self.levels:
            tasks = [_timed(node, ctx) for node in level]
            if len(tasks) > 1 and run_parallel is not None:
                results = run_parallel(tasks)
            else:
                results = [task() for task in tasks]
            for node, (result, seconds) in zip(level, results):
                ctx.metrics[f"timing/{node.name}"] = seconds
                _apply(node, ctx, result)
        return ctx


def _timed(node: Node, ctx: StepContext) -> Callable[[], tuple[Any, float]]:
    def task() -> tuple[Any, float]:
        start = time.perf_counter()
        result = node.fn(ctx)
        return result, time.perf_counter() - start

    return task


def _apply(node: Node, ctx: StepContext, result: Any) -> None:
    if result is None:
        return
    if isinstance(result, Batch):
        if BATCH not in node.writes:
            raise DataflowError(f"node {node.name!r} returned a whole batch but does not declare writes=('batch',)")
        ctx.batch = result
        return
    undeclared = set(result) - set(node.writes)
    if undeclared:
        raise DataflowError(f"node {node.name!r} set {sorted(undeclared)} without declaring them in writes")
    if ctx.batch is None:
        raise DataflowError(f"node {node.name!r} ran before any node produced the batch")
    fields = {k: v for k, v in result.items() if not k.startswith(EXTRAS_PREFIX)}
    extras = {k[len(EXTRAS_PREFIX):]: v for k, v in result.items() if k.startswith(EXTRAS_PREFIX)}
    if extras:
        fields["extras"] = {**ctx.batch.extras, **extras}
    ctx.batch = ctx.batch.replace(**fields)


def _levels(nodes: Sequence[Node]) -> list[list[Node]]:
    """Group nodes into levels by data dependencies (declaration order breaks ties).

    A reader depends on the last writer of the field declared before it (or, if none, the first
    writer declared after it); a writer also depends on earlier readers and writers of the field,
    so read-modify-write nodes (a KL penalty folded into rewards) keep their declared order.
    """
    names = [n.name for n in nodes]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise DataflowError(f"duplicate node names: {sorted(dupes)}")
    index = {n.name: i for i, n in enumerate(nodes)}
    deps: dict[int, set[int]] = {i: set() for i in range(len(nodes))}
    for i, node in enumerate(nodes):
        reads = {BATCH, *node.reads}
        for f in reads:
            writers_before = [j for j in range(i) if f in nodes[j].writes]
            writers_after = [j for j in range(i + 1, len(nodes)) if f in nodes[j].writes and f != BATCH]
            if writers_before:
                deps[i].add(writers_before[-1])
            elif writers_after:
                deps[i].add(writers_after[0])
            elif f != BATCH and not any(BATCH in nodes[j].writes for j in range(i)):
                # Fields with no writer of their own come from the node that produced the batch.
                raise DataflowError(
                    f"node {node.name!r} reads {f!r} but no node writes it; add a node that produces {f!r}")
        for f in node.writes:
            for j in range(i):
                earlier_read = f in nodes[j].reads and any(f in nodes[k].writes for k in range(j))
                if f == BATCH or f in nodes[j].writes or earlier_read:
                    deps[i].add(j)
        for name in node.after:
            if name not in index:
                raise DataflowError(f"node {node.name!r} runs after unknown node {name!r}; known: {names}")
            deps[i].add(index[name])
    sorter = graphlib.TopologicalSorter(deps)
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        raise DataflowError(f"the dataflow has a cycle: {' -> '.join(nodes[i].name for i in exc.args[1])}") from None
    levels: list[list[Node]] = []
    while sorter.is_active():  # a level: the nodes whose inputs the levels before it wrote
        ready = sorted(sorter.get_ready())
        levels.append([nodes[i] for i in ready])
        sorter.done(*ready)
    return levels


class DataflowBuilder:
    """Declares the nodes of an RL step. The named helpers add the standard nodes."""

    def __init__(self) -> None:
        self._nodes: list[Node] = []
        self._rollout_request: RolloutRequest | None = None
        # Names of the standard nodes that compute old log-probs on the actor and that update the actor.
        self._actor_old_log_probs: set[str] = set()
        self._actor_updates: set[str] = set()

    def node(self, name: str, fn: Callable[[StepContext], Any], *, reads: Sequence[str] = (),
             writes: Sequence[str] = (), after: Sequence[str] = (), role: str | None = None) -> str:
        """Add a custom node; returns its name (to use in ``after=``)."""
        self._nodes.append(Node(name, fn, tuple(reads), tuple(writes), tuple(after), role))
        return name

    def build(self) -> Dataflow:
        writers = {n.name for n in self._nodes if "old_log_probs" in n.writes}
        readers = {n.name for n in self._nodes if "old_log_probs" in n.reads}
        only_for_update = (len(writers) == 1 and writers <= self._actor_old_log_probs
                           and bool(readers) and readers <= self._actor_updates)
        return Dataflow(self._nodes, rollout_request=self._rollout_request,
                        old_log_probs_only_for_update=only_for_update)

    # ------------------------------------------------------------ standard nodes
    def rollout(self, request: RolloutRequest = RolloutRequest()) -> str:
        """The run's rollout stage: the step's scored batch (see :func:`verl_core.rollout_stage.run`).

        Writes the batch, ``scores`` and ``token_rewards`` (and ``extras.baseline_scores`` when the
        request asks for a greedy baseline). The stage also checks an engine with its own weights
        against the trainer on a few samples (the weight-sync guard).
        """
        from verl_core import rollout_stage

        self._rollout_request = request
        writes = [BATCH, "scores", "token_rewards"]
        if request.greedy_baseline:
            writes.append(EXTRAS_PREFIX + rollout_stage.BASELINE)
        return self.node("rollout", lambda ctx: rollout_stage.run(ctx, request), writes=writes, role="rollout")

    def batch_from_data(self, build: Callable[[StepContext], Batch], *, name: str = "batch_from_data") -> str:
        """Build the step's batch from its prompt rows instead of generating (offline data).

        ``build(ctx)`` returns a :class:`~verl_core.batch.Batch` made from ``ctx.prompts``; each
        row keeps its raw data columns under ``row["raw"]`` (preference pairs, SFT targets, ...)
        and ``ctx.tokenizer`` turns their text into tokens.
        """
        return self.node(name, build, writes=(BATCH,))

    def actor_log_probs(self, *, from_rollout: bool = False, reuse: bool = True) -> str:
        """Old log-probs: the policy's at the start of the step, recomputed by the actor.

        Recomputing also measures the engine's log-probs against the trainer's and stops a step
        whose gap says the weight sync broke (``rollout.max_log_prob_gap``). ``from_rollout``
        takes the engine's own log-probs instead (no extra forward pass, and no check). ``reuse=False``
        runs the forward even where the update's own log-probs are these (:func:`old_log_probs_reusable`).
        """
        if from_rollout:
            return self.node("old_log_probs", _rollout_log_probs, reads=("response_ids",), writes=("old_log_probs",))
        if reuse:
            self._actor_old_log_probs.add("old_log_probs")
        return self.node("old_log_probs", _old_log_probs, reads=("response_ids",), writes=("old_log_probs",),
                         role="actor")

    def reference_log_probs(self) -> str:
        """Log-probs under the reference policy (for the KL term)."""
        return self.node("ref_log_probs", _ref_log_probs, reads=("response_ids",), writes=("ref_log_probs",),
                         role="reference")

    def critic_values(self) -> str:
        """Critic value of each response token."""
        return self.node("values", _values, reads=("response_ids",), writes=("values",), role="critic")

    def compute_advantages(self, algorithm: Algorithm, *, reads: Sequence[str] = ("token_rewards",)) -> str:
        """Advantages and returns from the algorithm's estimator (``reads``: the fields it uses)."""
        def fn(ctx: StepContext) -> dict[str, torch.Tensor]:
            advantages, returns = algorithm.compute_advantages(ctx.batch)
            check_advantages(advantages, ctx.batch.response_mask, source=ctx.boundary.algorithm, step=ctx.step)
            return {"advantages": advantages, "returns": returns}

        return self.node("advantages", fn, reads=tuple(reads), writes=("advantages", "returns"))

    def update_critic(self, algorithm: Algorithm) -> str:
        """Fit the critic to the returns."""
        def fn(ctx: StepContext) -> None:
            cfg = algorithm.config
            ctx.metrics.update(ctx.critic.update_values(ctx.batch, loss_fn=AlgorithmLoss(algorithm, critic=True),
                                                        mini_batch_size=cfg.mini_batch_size, epochs=cfg.epochs))

        return self.node("update_critic", fn, reads=("returns", "values"), role="critic")

    def update_actor(self, algorithm: Algorithm, *,
                     reads: Sequence[str] = ("advantages", "old_log_probs")) -> str:
        """Optimise the policy with the algorithm's loss (``reads``: the fields that loss uses)."""
        def fn(ctx: StepContext) -> None:
            cfg = algorithm.config
            # Without old log-probs the old-log-prob node left them to the update.
            loss_fn = AlgorithmLoss(algorithm, detach_old_log_probs=(
                "old_log_probs" in reads and ctx.batch.old_log_probs is None))
            ctx.metrics.update(ctx.actor.update_policy(ctx.batch, loss_fn=loss_fn,
                                                       mini_batch_size=cfg.mini_batch_size, epochs=cfg.epochs))

        self._actor_updates.add("update_actor")
        return self.node("update_actor", fn, reads=tuple(reads), role="actor")


# ---------------------------------------------------------------- node bodies
def _rollout_log_probs(ctx: StepContext) -> dict[str, torch.Tensor]:
    if ctx.batch.rollout_log_probs is None:
        raise ValueError("algorithm.use_rollout_log_probs is set but the rollout engine returned no log-probs")
    return {"old_log_probs": ctx.batch.rollout_log_probs}


def old_log_probs_reusable(ctx: StepContext) -> bool:
    """Whether this step's old log-probs are the update's own log-probs, detached, so their forward can go.

    They are when the policy that generated the batch is the one being updated (``ctx.staleness == 0``)
    and the update takes one gradient step on the whole batch (one epoch, one mini-batch): its first
    forward then runs on the weights the old-log-prob forward would have used. The run decides the
    rest (``ctx.reuse_update_log_probs``): only the actor's update reads them, the log-probs come from
    the trainer (not the engine's, ``use_rollout_log_probs``), and the forward is deterministic (no
    dropout). The PPO ratio is then exactly 1 in value, as TRL computes it in this case.
    """
    cfg = getattr(ctx.algorithm, "config", None)
    if not ctx.reuse_update_log_probs or ctx.staleness != 0 or cfg is None:
        return False
    mini = getattr(cfg, "mini_batch_size", 0)
    return getattr(cfg, "epochs", 1) == 1 and (not mini or mini >= len(ctx.batch))


def _old_log_probs(ctx: StepContext) -> dict[str, torch.Tensor | None]:
    from verl_core.rollout_utils import check_log_prob_gap

    reused = old_log_probs_reusable(ctx)
    ctx.metrics["actor/old_log_probs_reused"] = float(reused)
    if reused:
        return {"old_log_probs": None}
    old = ctx.actor.compute_log_probs(ctx.batch, with_entropy=False).log_probs
    if ctx.batch.rollout_log_probs is not None and ctx.staleness == 0:
        # A stale batch came from older weights on purpose: its gap is the off-policy-ness, not a broken sync.
        check_log_prob_gap(ctx, old, ctx.batch)
    return {"old_log_probs": old}


def _ref_log_probs(ctx: StepContext) -> dict[str, torch.Tensor]:
    return {"ref_log_probs": ctx.reference.compute_log_probs(ctx.batch).log_probs}


def _values(ctx: StepContext) -> dict[str, torch.Tensor]:
    return {"values": ctx.critic.compute_values(ctx.batch)}
