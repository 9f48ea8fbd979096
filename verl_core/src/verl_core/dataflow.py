"""The RL step as a dataflow graph (the HybridFlow idea).

An algorithm declares its step as nodes - generate, reward, log-probs, values, advantages,
updates, weight sync - each saying which :class:`~verl_core.batch.Batch` fields it reads and
writes. The controller derives the order from those data dependencies and runs nodes that do
not depend on each other together (the executor decides whether "together" means concurrently).

Declaring a custom algorithm::

    df = DataflowBuilder()
    df.actor_generate()
    df.reward_score()
    df.actor_log_probs()
    df.compute_advantages(my_algorithm)
    df.update_actor(my_algorithm)
    df.sync_weights()
    flow = df.build()
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from verl_core.batch import Batch

if TYPE_CHECKING:
    from verl_core.interfaces import Algorithm

__all__ = ["Node", "Dataflow", "DataflowBuilder", "StepContext", "DataflowError", "standard_dataflow"]

# Pseudo-field every node reads; a node that writes it (generation, filtering) replaces the whole
# batch and so acts as a barrier.
BATCH = "batch"


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


@dataclass
class StepContext:
    """What nodes see while one RL step runs. The controller fills it in."""

    step: int
    prompts: list[dict[str, Any]]
    algorithm: Any
    actor: Any
    rollout: Any
    reward: Any
    sampling: Any
    critic: Any = None
    reference: Any = None
    batch: Batch | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)


class Dataflow:
    """An ordered, validated set of nodes."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = list(nodes)
        self.levels = _levels(self.nodes)

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
    ctx.batch = ctx.batch.replace(**result)


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
    depth: dict[int, int] = {}
    visiting: set[int] = set()

    def level_of(i: int) -> int:
        if i in depth:
            return depth[i]
        if i in visiting:
            raise DataflowError(f"the dataflow has a cycle through {nodes[i].name!r}")
        visiting.add(i)
        depth[i] = 1 + max((level_of(j) for j in deps[i]), default=-1)
        visiting.discard(i)
        return depth[i]

    for i in range(len(nodes)):
        level_of(i)
    levels: list[list[Node]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for i, node in enumerate(nodes):
        levels[depth[i]].append(node)
    return levels


class DataflowBuilder:
    """Declares the nodes of an RL step. The named helpers add the standard nodes."""

    def __init__(self) -> None:
        self._nodes: list[Node] = []

    def node(self, name: str, fn: Callable[[StepContext], Any], *, reads: Sequence[str] = (),
             writes: Sequence[str] = (), after: Sequence[str] = (), role: str | None = None) -> str:
        """Add a custom node; returns its name (to use in ``after=``)."""
        self._nodes.append(Node(name, fn, tuple(reads), tuple(writes), tuple(after), role))
        return name

    def build(self) -> Dataflow:
        return Dataflow(self._nodes)

    # ------------------------------------------------------------ standard nodes
    def actor_generate(self) -> str:
        """Sample responses for the step's prompts with the rollout engine."""
        return self.node("generate", _generate, writes=(BATCH,), role="rollout")

    def reward_score(self) -> str:
        """Score responses with the reward functions; scores go on the last response token."""
        return self.node("reward", _reward, reads=("response_ids",), writes=("scores", "token_rewards"),
                         role="reward")

    def filter_batch(self, algorithm: "Algorithm") -> str:
        """Let the algorithm drop samples (dynamic sampling, ...) before log-probs are computed."""
        return self.node("filter", lambda ctx: algorithm.filter_batch(ctx.batch), reads=("scores",),
                         writes=(BATCH,))

    def actor_log_probs(self) -> str:
        """Log-probs of the responses under the policy that generated them (old log-probs)."""
        return self.node("old_log_probs", _old_log_probs, reads=("response_ids",), writes=("old_log_probs",),
                         role="actor")

    def reference_log_probs(self) -> str:
        """Log-probs under the reference policy (for the KL term)."""
        return self.node("ref_log_probs", _ref_log_probs, reads=("response_ids",), writes=("ref_log_probs",),
                         role="reference")

    def critic_values(self) -> str:
        """Critic value of each response token."""
        return self.node("values", _values, reads=("response_ids",), writes=("values",), role="critic")

    def kl_in_reward(self, algorithm: "Algorithm") -> str:
        """Subtract ``kl_coef * KL`` from the token rewards (PPO's KL-in-reward)."""
        return self.node("kl_reward", lambda ctx: _kl_reward(ctx, algorithm),
                         reads=("token_rewards", "old_log_probs", "ref_log_probs"), writes=("token_rewards",))

    def compute_advantages(self, algorithm: "Algorithm", *, reads: Sequence[str] = ("token_rewards",)) -> str:
        """Advantages and returns from the algorithm's estimator."""
        def fn(ctx: StepContext) -> dict[str, torch.Tensor]:
            advantages, returns = algorithm.compute_advantages(ctx.batch)
            return {"advantages": advantages, "returns": returns}

        return self.node("advantages", fn, reads=tuple(reads), writes=("advantages", "returns"))

    def compute_gae(self, algorithm: "Algorithm") -> str:
        """GAE advantages (the algorithm's estimator, reading rewards and critic values)."""
        return self.compute_advantages(algorithm, reads=("token_rewards", "values"))

    def update_critic(self, algorithm: "Algorithm") -> str:
        """Fit the critic to the returns."""
        def fn(ctx: StepContext) -> None:
            cfg = algorithm.config
            ctx.metrics.update(ctx.critic.update_values(ctx.batch, loss_fn=algorithm.value_loss,
                                                        mini_batch_size=cfg.mini_batch_size, epochs=cfg.epochs))

        return self.node("update_critic", fn, reads=("returns", "values"), role="critic")

    def update_actor(self, algorithm: "Algorithm") -> str:
        """Optimise the policy with the algorithm's loss."""
        def fn(ctx: StepContext) -> None:
            cfg = algorithm.config
            ctx.metrics.update(ctx.actor.update_policy(ctx.batch, loss_fn=algorithm.policy_loss,
                                                       mini_batch_size=cfg.mini_batch_size, epochs=cfg.epochs))

        return self.node("update_actor", fn, reads=("advantages", "old_log_probs"), role="actor")

    def sync_weights(self) -> str:
        """Push the updated policy weights into the rollout engine."""
        def fn(ctx: StepContext) -> None:
            if not ctx.rollout.shares_actor_weights:
                ctx.rollout.load_weights(ctx.actor.iter_weights())

        updates = [n.name for n in self._nodes if n.name == "update_actor"]
        return self.node("sync_weights", fn, after=tuple(updates), role="rollout")


def standard_dataflow(df: DataflowBuilder, algorithm: "Algorithm") -> None:
    """The usual policy-gradient step; which nodes appear follows from the algorithm's needs."""
    needs = algorithm.requirements()
    df.actor_generate()
    df.reward_score()
    df.filter_batch(algorithm)
    df.actor_log_probs()
    if needs.reference:
        df.reference_log_probs()
    if needs.critic:
        df.critic_values()
    if needs.reference and algorithm.config.kl_in_reward:
        df.kl_in_reward(algorithm)
    if needs.critic:
        df.compute_gae(algorithm)
        df.update_critic(algorithm)
    else:
        df.compute_advantages(algorithm)
    df.update_actor(algorithm)
    df.sync_weights()


# ---------------------------------------------------------------- node bodies
def _generate(ctx: StepContext) -> Batch:
    from verl_core.rollout_utils import generate_batch

    return generate_batch(ctx.rollout, ctx.prompts, ctx.sampling)


def _reward(ctx: StepContext) -> dict[str, torch.Tensor]:
    from verl_core.algorithms.functional import scores_to_token_rewards

    scores, metrics = ctx.reward.score(ctx.batch)
    lengths = ctx.batch.response_attention_mask.sum(-1).float()
    ctx.metrics.update(metrics)
    ctx.metrics.update({
        "reward/mean": float(scores.mean()),
        "reward/max": float(scores.max()),
        "reward/min": float(scores.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/clip_frac": sum(r == "length" for r in ctx.batch.finish_reasons) / max(1, len(lengths)),
    })
    return {"scores": scores, "token_rewards": scores_to_token_rewards(scores, ctx.batch.response_mask)}


def _old_log_probs(ctx: StepContext) -> dict[str, torch.Tensor]:
    if ctx.algorithm.config.use_rollout_log_probs:
        if ctx.batch.rollout_log_probs is None:
            raise ValueError("algorithm.use_rollout_log_probs is set but the rollout engine returned no log-probs")
        return {"old_log_probs": ctx.batch.rollout_log_probs}
    return {"old_log_probs": ctx.actor.compute_log_probs(ctx.batch, with_entropy=False).log_probs}


def _ref_log_probs(ctx: StepContext) -> dict[str, torch.Tensor]:
    return {"ref_log_probs": ctx.reference.compute_log_probs(ctx.batch).log_probs}


def _values(ctx: StepContext) -> dict[str, torch.Tensor]:
    return {"values": ctx.critic.compute_values(ctx.batch)}


def _kl_reward(ctx: StepContext, algorithm: "Algorithm") -> dict[str, torch.Tensor]:
    from verl_core.algorithms.functional import kl_penalty, masked_mean

    b = ctx.batch
    kl = kl_penalty(b.old_log_probs, b.ref_log_probs, algorithm.config.kl_estimator) * b.response_mask
    ctx.metrics["ppo/kl_in_reward"] = float(masked_mean(kl, b.response_mask))
    return {"token_rewards": b.token_rewards - algorithm.config.kl_coef * kl}
