"""Does every config field of an algorithm do something? The machinery behind that conformance check.

A config field that is accepted, validated and logged but never reaches the loss is a silent
no-op: the user believes a KL penalty or an importance-sampling correction is on, and training is
unchanged. The check runs the algorithm's *own* declared dataflow (so dataflow-level knobs such as
``kl_in_reward`` count) on one fixed synthetic batch, once per config, and compares what the step
would train on:

* the advantages and returns the dataflow computed;
* the policy loss and its gradient w.r.t. the log-probs and entropy, the value loss and its
  gradient w.r.t. the values (when there is a critic);
* the ``mini_batch_size`` / ``epochs`` the updates were called with;
* the algorithm's :class:`~verl_core.contracts.RolloutRequest` and its filter's output on the batch.

Metrics are recorded but not compared: a field that only changes a logged number is a no-op.
Comparisons are exact (``torch.equal``, ``==``).

The harness replaces nothing real; it stands in for the parts of a run the algorithm does not own:

* the ``rollout`` node (``df.rollout``) returns the fixed scored batch, with the request's filter
  applied (all of it when nothing survives, as the real stage does) and
  ``extras["baseline_scores"]`` when a greedy baseline is asked for; a ``df.batch_from_data`` node
  returns the same batch;
* actor, reference and critic stand-ins answer ``compute_log_probs`` / ``compute_values`` with
  fixed numbers, a function of each row's tokens (so they follow rows through filters and
  through nodes that rebuild the batch);
* ``update_policy`` / ``update_values`` call the given ``loss_fn`` once on the whole batch with fixed
  current log-probs, entropy and values, and record the loss, its gradient, the metrics and the
  ``mini_batch_size`` / ``epochs`` keyword arguments.

Off-default values come from each field's type and are tried in order until one has an effect:
a ``bool`` is flipped; an ``int`` becomes ``+1``, ``+2`` (``1``, ``2`` from 0); a ``float`` ``x2``,
``/2`` (``0.1``, ``1.5`` from 0); a ``typing.Literal`` takes every other allowed value, and each
of them must have an effect. Values the config's ``validate()`` refuses are skipped; a field with
no valid other value is pinned and cannot be a no-op. Other types (a plain ``str``: a column name,
a path) have no automatic value and must be declared.

A field passes when moving it changes the effect from the fixture's config (normally the
defaults), or, for a field that only acts together with another (``kl_estimator`` needs
``kl_coef > 0``), from that config with one other field moved. A field that has an effect must keep
having one when any other single field is moved: that is how ``kl_coef`` is caught doing nothing
once ``kl_in_reward`` moves the KL from the loss into rewards that the advantages never read.

A config declares what legitimately does nothing here, with a reason, as class attributes merged
along its MRO (see :class:`~verl_core.contracts.AlgorithmConfig`)::

    inert_fields: ClassVar[dict[str, str]] = {"chosen_key": "names the data column ...; tested by ..."}
    inert_when: ClassVar[dict[tuple[str, str], str]] = {("eps", "norm_adv_by_std"): "..."}

``inert_fields`` names fields that never change the step's advantages or losses on this batch;
``inert_when`` pairs ``(field, other)`` where ``field`` legitimately stops mattering once ``other`` is
moved off its value (an epsilon guarding a division that ``other`` switches off).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch

from verl_core.batch import Batch, scores_to_token_rewards
from verl_core.dataflow import DataflowBuilder, StepContext
from verl_core.contracts import Algorithm, AlgorithmConfig, LogProbs, RolloutRequest, SamplingParams

__all__ = [
    "ConfigEffect",
    "EffectHarness",
    "config_effect_batch",
    "config_field_problems",
    "declared_inert_fields",
    "declared_inert_pairs",
    "off_default_values",
]

#: ``batch.extras`` key of the greedy baseline (as :mod:`verl_core.rollout_stage` writes it).
_BASELINE = "baseline_scores"


# ----------------------------------------------------------------------------- the fixed batch
def config_effect_batch(*, max_new_tokens: int = 8) -> Batch:
    """The fixed scored batch the config check runs every config on (a rollout stage's output).

    Three prompts of different lengths, four samples each, so that every knob shows:

    * rewards: group 0 and 2 unequal (positive and negative advantages), group 1 all equal (what a
      dynamic-sampling filter drops; zero advantage under a group baseline);
    * responses of 1 to 8 tokens, several ending at or near ``max_new_tokens`` (length shaping,
      constant-length loss normalisation), with a tool-output span inside the longer ones
      (``response_mask`` 0 inside a response);
    * ``rollout_log_probs`` that differ from the trainer's old log-probs by up to +-0.5 per token
      (rollout importance sampling, ``use_rollout_log_probs``);
    * ``info["max_new_tokens"]`` = ``max_new_tokens``, which may exceed the responses' width (8):
      every response then stopped early, as in a run with a long budget.

    Old, reference, current log-probs, entropy and values come from :class:`EffectHarness`'s
    stand-ins, a fixed function of each row's tokens.
    """
    scores = [1.0, 0.0, 0.75, 0.25, 0.5, 0.5, 0.5, 0.5, 0.0, 1.0, 0.0, 0.3]
    lengths = [8, 3, 7, 5, 6, 8, 2, 7, 8, 4, 6, 1]
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    group_size = 4
    if max_new_tokens < max(lengths):
        raise ValueError(f"max_new_tokens must be >= {max(lengths)}, the longest response")
    B, R, P = len(scores), max(lengths), max(len(p) for p in prompts)
    # A seed whose tokens put every sequence-level ratio clearly on its row's side of 1 (a test
    # of the harness checks this coverage).
    g = torch.Generator().manual_seed(1235)
    prompt_ids = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    for row in range(B):
        ids = prompts[row // group_size]
        prompt_ids[row, P - len(ids):] = torch.tensor(ids)
        prompt_mask[row, P - len(ids):] = 1
    attention = (torch.arange(R).expand(B, R) < torch.tensor(lengths).unsqueeze(1)).long()
    response_ids = torch.where(attention.bool(), torch.randint(2, 16, (B, R), generator=g), torch.zeros(B, R).long())
    # The first token's parity makes a row's update-time log-ratios lean up (even) or down (odd):
    # up, up, down, down within each group, against advantages of both signs in groups 0 and 2.
    response_ids[:, 0] = torch.tensor([2, 2, 3, 3]).repeat(B // group_size)
    response_mask = attention.clone()
    for row, n in enumerate(lengths):
        if n >= 5:
            response_mask[row, n // 3: n // 3 + n // 4] = 0  # tool output between policy tokens
    score_t = torch.tensor(scores)
    batch = Batch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_attention_mask=attention, response_mask=response_mask,
        group_ids=torch.arange(B // group_size).repeat_interleave(group_size),
        scores=score_t, token_rewards=scores_to_token_rewards(score_t, response_mask),
        finish_reasons=["length" if n == max_new_tokens else "stop" for n in lengths],
        meta={"ground_truth": [str(7 + 11 * (row // group_size)) for row in range(B)],
              "data_source": ["conformance"] * B},
        info={"pad_token_id": 0, "max_new_tokens": max_new_tokens},
    )
    rollout = EffectHarness.old_log_probs(batch) + (_row_noise(batch, salt=6) - 0.5)
    return batch.replace(rollout_log_probs=rollout * attention)


@functools.lru_cache(maxsize=None)
def _noise_table(salt: int) -> torch.Tensor:
    return torch.rand(1009, generator=torch.Generator().manual_seed(salt))


def _row_noise(batch: Batch, *, salt: int) -> torch.Tensor:
    """``[B, R]`` numbers in [0, 1): a fixed function of each row's prompt, its tokens and positions."""
    table = _noise_table(salt)
    prompt_key = (batch.prompt_ids * batch.prompt_mask).sum(-1, keepdim=True)
    positions = torch.arange(batch.response_length).unsqueeze(0)
    key = (batch.response_ids * 31 + positions * 131 + prompt_key * 17) % table.numel()
    return table[key]


# ----------------------------------------------------------------------------- what a config does
def _same(a: Any, b: Any) -> bool:
    """Exact equality; NaN equals NaN, so a NaN-producing config is not counted as an effect."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)) if a.is_floating_point() \
            else bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@dataclass
class ConfigEffect:
    """What one config makes the algorithm's step compute on the fixed batch.

    Attributes:
        advantages, returns: as the batch holds them when the actor update runs (None without).
        policy_loss: the actor's loss (detached) and ``policy_grads`` its gradient w.r.t. the
            current log-probs and entropy (None where the loss does not depend on them).
        value_loss, value_grad: the critic's loss and its gradient w.r.t. the values.
        updates: ``(role, mini_batch_size, epochs)`` of every update call, in order.
        request: ``(has a filter, max_extra_rounds, greedy_baseline)`` of each rollout request.
        filtered: per request with a filter, the kept rows' group ids and response ids.
        metrics: the metrics the step reported (recorded for messages, never compared).
    """

    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    policy_loss: torch.Tensor | None = None
    policy_grads: tuple[torch.Tensor | None, ...] = ()
    value_loss: torch.Tensor | None = None
    value_grad: torch.Tensor | None = None
    updates: list[tuple[str, int, int]] = field(default_factory=list)
    request: list[tuple[bool, int, bool]] = field(default_factory=list)
    filtered: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    COMPARED: typing.ClassVar[tuple[str, ...]] = (
        "advantages", "returns", "policy_loss", "policy_grads", "value_loss", "value_grad", "updates", "request",
        "filtered")

    def differences(self, other: "ConfigEffect") -> list[str]:
        """The compared parts that differ between two effects (empty: the configs act the same)."""
        return [name for name in self.COMPARED if not _same(getattr(self, name), getattr(other, name))]


class _StandInTokenizer:
    """Enough of a tokenizer for nodes that encode target text (one token per byte)."""

    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [2 + b % 14 for b in str(text).encode()]}


class _StandInWorker:
    """Actor, reference or critic: fixed numbers in, recorded losses out."""

    def __init__(self, role: str, effect: ConfigEffect) -> None:
        self.role = role
        self.effect = effect

    def compute_log_probs(self, batch: Batch, *, with_entropy: bool = False) -> LogProbs:
        lp = EffectHarness.reference_log_probs(batch) if self.role == "reference" else EffectHarness.old_log_probs(batch)
        return LogProbs(lp, EffectHarness.entropy(batch) if with_entropy else None)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        return EffectHarness.old_values(batch)

    def update_policy(self, batch: Batch, *, loss_fn: Callable[..., Any], mini_batch_size: int,
                      epochs: int) -> dict[str, float]:
        log_probs = EffectHarness.current_log_probs(batch).requires_grad_(True)
        entropy = EffectHarness.entropy(batch).requires_grad_(True)
        loss, metrics = loss_fn(batch=batch, log_probs=log_probs, entropy=entropy)
        e = self.effect
        e.advantages, e.returns = batch.advantages, batch.returns
        e.policy_loss = loss.detach()
        e.policy_grads = _grads(loss, (log_probs, entropy))
        e.updates.append(("actor", mini_batch_size, epochs))
        return dict(metrics)

    def update_values(self, batch: Batch, *, loss_fn: Callable[..., Any], mini_batch_size: int,
                      epochs: int) -> dict[str, float]:
        values = EffectHarness.current_values(batch).requires_grad_(True)
        loss, metrics = loss_fn(batch=batch, values=values)
        self.effect.value_loss = loss.detach()
        self.effect.value_grad = _grads(loss, (values,))[0]
        self.effect.updates.append(("critic", mini_batch_size, epochs))
        return dict(metrics)


def _grads(loss: torch.Tensor, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    if not loss.requires_grad:
        return tuple(None for _ in inputs)
    return tuple(torch.autograd.grad(loss, list(inputs), allow_unused=True))


class _StandInBuilder(DataflowBuilder):
    """A :class:`DataflowBuilder` whose batch-producing nodes return the fixed batch.

    The algorithm declares its dataflow on it exactly as on the real one; only the bodies of the
    ``rollout`` and ``batch_from_data`` nodes change (their names, reads and writes stay), and the
    rollout requests are recorded. ``sources`` names the nodes that were added through them.
    """

    def __init__(self, harness: "EffectHarness") -> None:
        super().__init__()
        self.harness = harness
        self.requests: list[RolloutRequest] = []
        self.sources: list[str] = []

    def rollout(self, request: RolloutRequest = RolloutRequest()) -> str:
        name = super().rollout(request)
        self.requests.append(request)
        self.sources.append(name)
        self._nodes[-1] = dataclasses.replace(self._nodes[-1], fn=lambda ctx: self.harness.rollout_output(ctx, request))
        return name

    def batch_from_data(self, build: Callable[[StepContext], Batch], *, name: str = "batch_from_data") -> str:
        self.sources.append(name)
        return super().batch_from_data(lambda ctx: self.harness.batch, name=name)


class EffectHarness:
    """Runs an algorithm's declared dataflow on a fixed batch and returns its :class:`ConfigEffect`.

    Args:
        batch: the scored batch the rollout stage (or ``batch_from_data``) hands the dataflow;
            :func:`config_effect_batch` by default.
        baseline_scores: the greedy baseline per group id, for algorithms that request one.
    """

    def __init__(self, batch: Batch | None = None, *, baseline_scores: Sequence[float] = (0.5, 0.25, 0.75)) -> None:
        self.batch = batch if batch is not None else config_effect_batch()
        self.baseline_scores = torch.tensor(baseline_scores, dtype=torch.float32)

    # The stand-in models: fixed numbers, a function of each row's tokens (see _row_noise).
    @staticmethod
    def old_log_probs(batch: Batch) -> torch.Tensor:
        """The policy's log-probs at the step start, in [-5.05, -1.05] (room for ratios up to e)."""
        return -4.0 * _row_noise(batch, salt=1) - 1.05

    @staticmethod
    def current_log_probs(batch: Batch) -> torch.Tensor:
        """The log-probs during the update: log-ratios to the old ones spread over [-1, 1].

        Each row leans up or down by 0.5 (by its first token's parity), so that sequence-level
        ratios (GSPO's) also fall on both sides of 1, for positive and negative advantages alike.
        """
        lean = torch.where(batch.response_ids[:, :1] % 2 == 0, 0.5, -0.5)
        log_ratio = (2.0 * _row_noise(batch, salt=2) - 1.0 + lean).clamp(-1.0, 1.0)
        return EffectHarness.old_log_probs(batch) + log_ratio

    @staticmethod
    def reference_log_probs(batch: Batch) -> torch.Tensor:
        """The reference policy: up to +-4 from the policy, so KL estimators (and their clamps) differ."""
        return (EffectHarness.old_log_probs(batch) + 8.0 * _row_noise(batch, salt=3) - 4.0).clamp(max=-1e-3)

    @staticmethod
    def entropy(batch: Batch) -> torch.Tensor:
        return 2.0 * _row_noise(batch, salt=4)

    @staticmethod
    def old_values(batch: Batch) -> torch.Tensor:
        return 2.0 * _row_noise(batch, salt=5) - 1.0

    @staticmethod
    def current_values(batch: Batch) -> torch.Tensor:
        """The critic during its update: up to +-1 from the old values (a value clip acts)."""
        return EffectHarness.old_values(batch) + 2.0 * _row_noise(batch, salt=7) - 1.0

    # ------------------------------------------------------------------ the stage stand-in
    def rollout_output(self, ctx: StepContext, request: RolloutRequest) -> Batch:
        """The fixed batch as the rollout stage would return it for ``request``."""
        batch = self.batch
        if request.filter is not None:
            kept = request.filter(batch)
            ctx.extras.setdefault("filtered", []).append((kept.group_ids, kept.response_ids))
            if len(kept):  # nothing surviving: the real stage keeps the round unfiltered
                batch = kept
        if request.greedy_baseline:
            batch = batch.replace(extras={**batch.extras, _BASELINE: self.baseline_scores[batch.group_ids]})
        return batch

    def prompts(self) -> list[dict[str, Any]]:
        """One prompt row per group (``ctx.prompts``), for nodes that read the step's rows."""
        b = self.batch
        rows: dict[int, dict[str, Any]] = {}
        for i, group in enumerate(b.group_ids.tolist()):
            rows.setdefault(group, {"prompt_ids": b.prompt_ids[i][b.prompt_mask[i].bool()].tolist(),
                                    **{k: v[i] for k, v in b.meta.items()}, "raw": {}})
        return [rows[g] for g in sorted(rows)]

    # ------------------------------------------------------------------ running
    def declare(self, algorithm: Algorithm) -> _StandInBuilder:
        """The algorithm's dataflow, declared on a builder whose batch sources are stand-ins."""
        df = _StandInBuilder(self)
        algorithm.build_dataflow(df)
        return df

    def measure(self, algorithm: Algorithm) -> ConfigEffect:
        """Run one step of ``algorithm``'s dataflow on the fixed batch; what it would train on."""
        df = self.declare(algorithm)
        effect = ConfigEffect(request=[(r.filter is not None, r.max_extra_rounds, r.greedy_baseline)
                                       for r in df.requests])
        ctx = StepContext(
            step=1, prompts=self.prompts(), algorithm=algorithm, actor=_StandInWorker("actor", effect),
            rollout=None, reward=None, sampling=SamplingParams(n=4, max_new_tokens=self.batch.info["max_new_tokens"]),
            critic=_StandInWorker("critic", effect), reference=_StandInWorker("reference", effect),
            tokenizer=_StandInTokenizer(), max_log_prob_gap=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "shaping is off for this budget": the effect shows it
            df.build().run(ctx)
        if not any(role == "actor" for role, _, _ in effect.updates):
            raise AssertionError(f"{type(algorithm).__name__}'s dataflow never called the actor's update_policy")
        effect.filtered = ctx.extras.get("filtered", [])
        effect.metrics = dict(ctx.metrics)
        return effect


# ----------------------------------------------------------------------------- fields and their values
def declared_inert_fields(config_cls: type) -> dict[str, str]:
    """``inert_fields`` of ``config_cls`` and its bases merged (subclasses win)."""
    out: dict[str, str] = {}
    for klass in reversed(config_cls.__mro__):
        out.update(vars(klass).get("inert_fields", {}))
    return out


def declared_inert_pairs(config_cls: type) -> dict[tuple[str, str], str]:
    """``inert_when`` of ``config_cls`` and its bases merged (subclasses win)."""
    out: dict[tuple[str, str], str] = {}
    for klass in reversed(config_cls.__mro__):
        out.update(vars(klass).get("inert_when", {}))
    return out


def off_default_values(annotation: Any, value: Any) -> list[Any] | None:
    """Values to move a field of type ``annotation`` to from ``value``, in the order tried.

    None when the type has none the suite can pick (a plain ``str``, a tuple, ...): such a field
    must be declared in ``inert_fields``.
    """
    if typing.get_origin(annotation) is Literal:
        return [v for v in typing.get_args(annotation) if v != value]
    if annotation is bool:
        return [not value]
    if annotation is int:
        return [value + 1, value + 2] if value else [1, 2]
    if annotation is float:
        return [value * 2, value / 2] if value else [0.1, 1.5]
    return None


@dataclass
class _Field:
    name: str
    annotation: Any
    candidates: list[Any] | None

    @property
    def every_value_counts(self) -> bool:
        """Literal fields: each other allowed value must act; numbers: one of the values tried."""
        return typing.get_origin(self.annotation) is Literal


def _fields(config: AlgorithmConfig) -> list[_Field]:
    hints = typing.get_type_hints(type(config))
    out = []
    for f in dataclasses.fields(config):
        if f.init:
            current = getattr(config, f.name)
            candidates = off_default_values(hints.get(f.name), current)
            aliases = getattr(type(config), "value_aliases", {}).get(f.name, {})
            if candidates is not None and aliases:  # another name for a value is not another value
                candidates = [v for v in candidates if v not in aliases and v != aliases.get(current, current)]
            out.append(_Field(f.name, hints.get(f.name), candidates))
    return out


def _moved(config: AlgorithmConfig, name: str, value: Any) -> AlgorithmConfig | None:
    """``config`` with ``name = value``, or None when the config's ``validate()`` refuses it."""
    try:
        moved = dataclasses.replace(config, **{name: value})
        moved.validate()
    except (ValueError, TypeError):
        return None
    return moved


# ----------------------------------------------------------------------------- the check
def config_field_problems(algorithm: Algorithm, harness: EffectHarness | None = None) -> list[str]:
    """Every config field of ``algorithm`` that changes nothing it trains on, as messages saying what to do.

    Empty when each field either has an effect (see the module docstring for what counts) or is
    declared in ``inert_fields`` / ``inert_when`` with its reason. Also reported: declarations that
    name no field, and fields declared inert that do have an effect (stale declarations).

    The algorithm class is rebuilt for every config as ``type(algorithm)(config)``.
    """
    harness = harness or EffectHarness()
    base = algorithm.config
    cls = type(base)
    algo_name = type(algorithm).__name__
    inert = declared_inert_fields(cls)
    inert_when = declared_inert_pairs(cls)
    fields_ = _fields(base)
    by_name = {f.name: f for f in fields_}
    problems: list[str] = []
    cache: dict[str, ConfigEffect] = {}

    def effect(config: AlgorithmConfig) -> ConfigEffect:
        key = repr(sorted(dataclasses.asdict(config).items()))
        if key not in cache:
            try:
                cache[key] = harness.measure(type(algorithm)(config))
            except Exception as exc:
                changed = {k: v for k, v in dataclasses.asdict(config).items() if getattr(base, k) != v}
                raise AssertionError(f"{algo_name} with {changed or 'its fixture config'} passes validate() but "
                                     f"its dataflow fails on the conformance batch: {exc!r}") from exc
        return cache[key]

    def changes(f: _Field, at: AlgorithmConfig) -> tuple[bool | None, list[str]]:
        """Whether moving ``f`` from ``at`` has an effect (None: no value validates there), and what changed."""
        results = []
        for value in f.candidates or []:
            moved = _moved(at, f.name, value)
            if moved is not None:
                results.append((value, effect(at).differences(effect(moved))))
                if results[-1][1] and not f.every_value_counts:
                    break  # one value with an effect is enough for a number or a flag
        if not results:
            return None, []  # pinned here: nothing else validates, so it cannot be a no-op
        hits = [bool(diff) for _, diff in results]
        live = all(hits) if f.every_value_counts else any(hits)
        return live, [f"{f.name} = {value!r}: " + (", ".join(diff) if diff else "nothing") for value, diff in results]

    def first_move(g: _Field) -> tuple[Any, AlgorithmConfig] | None:
        for value in g.candidates or []:
            moved = _moved(base, g.name, value)
            if moved is not None:
                return value, moved
        return None

    for name in inert:
        if name not in by_name:
            problems.append(f"{algo_name}: {cls.__name__}.inert_fields names {name!r}, which is not a field of "
                            f"{cls.__name__}; fields: {sorted(by_name)}")
    for pair in inert_when:
        missing = [n for n in pair if n not in by_name]
        if missing:
            problems.append(f"{algo_name}: {cls.__name__}.inert_when names {missing}, not fields of {cls.__name__}")

    moves = {g.name: first_move(g) for g in fields_}
    live_at_base: list[_Field] = []
    for f in fields_:
        declared = f.name in inert
        if f.candidates is None:
            if not declared:
                problems.append(
                    f"{algo_name}: algorithm.{f.name} is a {getattr(f.annotation, '__name__', f.annotation)} the "
                    f"suite cannot pick another value for (only bool, int, float and typing.Literal fields are "
                    f"moved); make it change the loss/advantages with a Literal type, or declare it in "
                    f"{cls.__name__}.inert_fields with the reason (and test it where it acts)")
            continue
        live, tried = changes(f, base)
        if declared:
            if live:
                problems.append(f"{algo_name}: algorithm.{f.name} is declared in inert_fields "
                                f"({inert[f.name]!r}) but changes the step ({'; '.join(tried)}); remove the declaration")
            continue
        if live is None:
            continue
        if live:
            live_at_base.append(f)
            continue
        # Acts only together with another field (kl_estimator needs kl_coef > 0)?
        enabled_by = next((g for g in fields_ if g.name != f.name and moves[g.name] is not None
                           and changes(f, moves[g.name][1])[0] is True), None)
        if enabled_by is None:
            problems.append(
                f"{algo_name}: algorithm.{f.name} changes nothing the step trains on (advantages, returns, losses and "
                f"their gradients, update settings, rollout request) on the conformance batch, from the fixture's "
                f"config or with any one other field moved ({'; '.join(tried)}). Make it change the loss/advantages, "
                f"or declare it in {cls.__name__}.inert_fields with the reason")

    # A field that acts must keep acting when another field moves (kl_coef once kl_in_reward is on).
    for f in live_at_base:
        for g in fields_:
            if g.name == f.name or g.name in inert or moves[g.name] is None or (f.name, g.name) in inert_when:
                continue
            value, at = moves[g.name]
            live, tried = changes(f, at)
            if live is False:
                problems.append(
                    f"{algo_name}: algorithm.{f.name} stops changing anything the step trains on once "
                    f"algorithm.{g.name} = {value!r} ({'; '.join(tried)}). Make it take effect there, or declare "
                    f"({f.name!r}, {g.name!r}) in {cls.__name__}.inert_when with the reason")
    return problems
