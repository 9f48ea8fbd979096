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

Capabilities some algorithms need are builder methods too, so no algorithm needs the controller
to know its name: :meth:`DataflowBuilder.generate_until_full` (keep generating until the filtered
batch is full, DAPO's dynamic sampling), :meth:`DataflowBuilder.greedy_baseline` (score one greedy
response per prompt, ReMax's baseline) and :meth:`DataflowBuilder.batch_from_data` (build the batch
from the prompt rows' own columns instead of generating: preference pairs, SFT targets).
"""

from __future__ import annotations

import dataclasses
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


@dataclass
class StepContext:
    """What nodes see while one RL step runs. The controller fills it in.

    Attributes:
        tokenizer: the run's tokenizer, for nodes that turn text into tokens (offline data).
        draw_prompts: returns the next batch of training prompt rows, for nodes that need more
            prompts than the step's own (dynamic sampling); None where no more can be drawn.
    """

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
    tokenizer: Any = None
    draw_prompts: Callable[[], list[dict[str, Any]]] | None = None


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

    def generate_until_full(self, algorithm: "Algorithm", *, max_extra_rounds: int) -> str:
        """Generate, score and filter until the batch holds as many prompt groups as the step has prompts.

        Each round samples responses, scores them and keeps what ``algorithm.filter_batch`` keeps;
        while fewer groups than the step's prompts survive, another batch of prompts is drawn
        (``ctx.draw_prompts``), at most ``max_extra_rounds`` times. The first groups that survive
        make the batch (a smaller one when the cap is reached). When nothing survives at all the
        first round is kept unfiltered, so the step still trains on real samples. DAPO's dynamic
        sampling (arXiv:2503.14476) is this node with a filter that drops equal-reward groups.
        Replaces :meth:`actor_generate`, :meth:`reward_score` and :meth:`filter_batch`.
        """
        if max_extra_rounds < 0:
            raise ValueError(f"max_extra_rounds must be >= 0, got {max_extra_rounds}")
        return self.node("generate", lambda ctx: _generate_until_full(ctx, algorithm, max_extra_rounds),
                         writes=(BATCH, "scores", "token_rewards"), role="rollout")

    def greedy_baseline(self, *, name: str = "baseline_scores") -> str:
        """Score one greedy response per prompt of the batch; each sample gets its prompt's score.

        The result is ``batch.extras[name]`` (``[B]``), written before the policy changes, so it
        is the reward of the current policy's greedy answer: ReMax's baseline (arXiv:2310.10505).
        """
        return self.node("greedy_baseline", lambda ctx: _greedy_baseline(ctx, name),
                         writes=(EXTRAS_PREFIX + name,), role="rollout")

    def batch_from_data(self, build: Callable[[StepContext], Batch], *, name: str = "batch_from_data") -> str:
        """Build the step's batch from its prompt rows instead of generating (offline data).

        ``build(ctx)`` returns a :class:`~verl_core.batch.Batch` made from ``ctx.prompts``; each
        row keeps its raw data columns under ``row["raw"]`` (preference pairs, SFT targets, ...)
        and ``ctx.tokenizer`` turns their text into tokens.
        """
        return self.node(name, build, writes=(BATCH,))

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

    def update_actor(self, algorithm: "Algorithm", *,
                     reads: Sequence[str] = ("advantages", "old_log_probs")) -> str:
        """Optimise the policy with the algorithm's loss (``reads``: the fields that loss uses)."""
        def fn(ctx: StepContext) -> None:
            cfg = algorithm.config
            ctx.metrics.update(ctx.actor.update_policy(ctx.batch, loss_fn=algorithm.policy_loss,
                                                       mini_batch_size=cfg.mini_batch_size, epochs=cfg.epochs))

        return self.node("update_actor", fn, reads=tuple(reads), role="actor")

    def sync_weights(self) -> str:
        """Push the updated policy weights into the rollout engine."""
        def fn(ctx: StepContext) -> None:
            from verl_core.rollout_utils import sync_rollout_weights

            sync_rollout_weights(ctx.rollout, ctx.actor)

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
    return _score(ctx, ctx.batch)


def _score(ctx: StepContext, batch: Batch, *, record: bool = True) -> dict[str, torch.Tensor]:
    """Scores and token rewards of ``batch``; ``record`` adds the reward metrics to the step's."""
    from verl_core.algorithms.functional import scores_to_token_rewards

    scores, metrics = ctx.reward.score(batch)
    if record:
        lengths = batch.response_attention_mask.sum(-1).float()
        ctx.metrics.update(metrics)
        ctx.metrics.update({
            "reward/mean": float(scores.mean()),
            "reward/max": float(scores.max()),
            "reward/min": float(scores.min()),
            "response_length/mean": float(lengths.mean()),
            "response_length/clip_frac": sum(r == "length" for r in batch.finish_reasons) / max(1, len(lengths)),
        })
    return {"scores": scores, "token_rewards": scores_to_token_rewards(scores, batch.response_mask)}


def _generate_until_full(ctx: StepContext, algorithm: "Algorithm", max_extra_rounds: int) -> Batch:
    from verl_core.rollout_utils import generate_batch

    target = len(ctx.prompts)
    prompts = ctx.prompts
    first: Batch | None = None
    kept: list[Batch] = []
    kept_groups: list[int] = []
    generated = 0
    rounds = 0
    for rounds in range(max_extra_rounds + 1):
        if rounds > 0:
            if ctx.draw_prompts is None:
                break
            prompts = ctx.draw_prompts()
        sampling = ctx.sampling
        if rounds > 0 and sampling.seed is not None:
            # A fresh seed per round: the same seed on new prompts would correlate the samples.
            sampling = dataclasses.replace(sampling, seed=sampling.seed + 7919 * rounds)
        batch = generate_batch(ctx.rollout, prompts, sampling)
        # Group ids restart at 0 in every round; shift them so groups of different rounds stay apart.
        batch = batch.replace(group_ids=batch.group_ids + rounds * target)
        # The reward metrics describe the step's own prompts, as for every other algorithm.
        batch = batch.replace(**_score(ctx, batch, record=rounds == 0))
        generated += len(batch)
        if first is None:
            first = batch
        survivors = algorithm.filter_batch(batch)
        if len(survivors):
            kept.append(survivors)
            kept_groups += list(dict.fromkeys(survivors.group_ids.tolist()))
        if len(kept_groups) >= target:
            break
    ctx.metrics.update({
        "dynamic_sampling/rounds": float(rounds + 1),
        "dynamic_sampling/generated_samples": float(generated),
        "dynamic_sampling/kept_groups": float(min(len(kept_groups), target)),
        "dynamic_sampling/fallback_unfiltered": float(not kept),
    })
    if not kept:
        return first
    batch = Batch.concat(kept)
    wanted = set(kept_groups[:target])
    return batch.select([i for i, g in enumerate(batch.group_ids.tolist()) if g in wanted])


def _greedy_baseline(ctx: StepContext, name: str) -> dict[str, torch.Tensor]:
    from verl_core.rollout_utils import generate_batch

    b = ctx.batch
    group_ids = b.group_ids.tolist()
    first_row: dict[int, int] = {}
    for i, g in enumerate(group_ids):
        first_row.setdefault(g, i)
    rows = []
    for i in first_row.values():
        rows.append({"prompt_ids": b.prompt_ids[i][b.prompt_mask[i].bool()].tolist(),
                     **{key: values[i] for key, values in b.meta.items()}})
    sampling = dataclasses.replace(ctx.sampling, n=1, greedy=True)
    greedy = generate_batch(ctx.rollout, rows, sampling)
    scores, _ = ctx.reward.score(greedy)
    per_group = dict(zip(first_row, scores.tolist()))
    ctx.metrics["baseline/greedy_reward_mean"] = float(scores.mean())
    return {EXTRAS_PREFIX + name: torch.tensor([per_group[g] for g in group_ids], dtype=torch.float32)}


def _old_log_probs(ctx: StepContext) -> dict[str, torch.Tensor]:
    if ctx.algorithm.config.use_rollout_log_probs:
        if ctx.batch.rollout_log_probs is None:
            raise ValueError("algorithm.use_rollout_log_probs is set but the rollout engine returned no log-probs")
        return {"old_log_probs": ctx.batch.rollout_log_probs}
    old = ctx.actor.compute_log_probs(ctx.batch, with_entropy=False).log_probs
    if ctx.batch.rollout_log_probs is not None:
        # How far the rollout engine's probabilities are from the trainer's (0 for an exact engine).
        from verl_core.algorithms.functional import masked_mean

        gap = (old - ctx.batch.rollout_log_probs).abs() * ctx.batch.response_mask
        ctx.metrics["rollout/log_prob_diff_mean"] = float(masked_mean(gap, ctx.batch.response_mask))
        ctx.metrics["rollout/log_prob_diff_max"] = float(gap.max())
    return {"old_log_probs": old}


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
