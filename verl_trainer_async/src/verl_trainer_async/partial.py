"""``trainer.mode = "partial"``: partial rollouts, so that a step never waits for its longest sample (issue 33).

With response lengths that vary a lot, a synchronous step generates until its longest sample ends, and most
of the batch idles meanwhile. Here each step generates in *rounds*: every unfinished sample gets at most
``trainer.token_budget`` more tokens per round, and the step trains as soon as ``data.batch_size`` prompt
groups (all ``rollout.n`` samples of a prompt: GRPO's group) have finished. Samples that hit the round's
budget without a stop token and are still under ``rollout.max_new_tokens`` are *carried* into the next step
with the tokens, the engine's per-token log-probs and the weight version they had, and resumed there on the
new weights from prompt + partial response (abort and resume: every engine that generates from token ids
with a token limit does it, the HF, vLLM and SGLang rollouts alike; none needs a change).

Which prompts run: a new batch of prompts (the run's sampler, ``data.batch_size``) joins the pool before a
round whenever fewer than ``data.batch_size`` groups are unfinished, so the pool holds at most about twice
the batch; finished groups train oldest first, each exactly once.

**Importance correction.** A trained sample may hold tokens of several weight versions; the batch's
``rollout_log_probs`` are, token by token, the log-probs of the weights that sampled that token, and its
staleness (``SourcedStep.staleness``, ``partial/staleness``) is the age of its oldest token. The step then
recomputes the old log-probs on the current weights (never reused while a sample is stale) and the
algorithm weighs every token by ``min(pi_old / pi_behaviour, algorithm.rollout_is_cap)`` (truncated
importance sampling per token, the same estimator as the overlapping modes': ``rollout_is_cap`` is set to
``ASYNC_ROLLOUT_IS_CAP`` unless the user sets it), inside the usual PPO clip around the old log-probs.

**Checkpoints.** The pool (carried samples and finished groups not trained yet) is written into every
checkpoint (``partial_rollouts.json``) next to the sampler's position after the last prompts drawn, and
read back on resume, so a killed and resumed run trains every prompt once, as the uninterrupted one does
(bit for bit where the engine's sampling is seeded).

The source generates on the run's own engine, between updates, like ``sync``; it drives the core's rollout
stage (reward, filters, greedy baseline) on the finished groups through a replaying engine
(:class:`_Replay`), so nothing in the core knows about partial samples. Not with ``[environment]``:
multi-turn episodes run their own generation loop.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from verl_core.contracts import ConfigError, RolloutOutput, SamplingParams, SourcedStep, StepSource
from verl_core.kit import produce_rollout, sync_rollout_weights
from verl_trainer_async.source import EngineCheck, check_stale_samples, stale_sample_defaults

__all__ = ["PARTIAL_FILE", "PartialConfig", "PartialSource"]

#: The checkpoint file holding the pool of carried samples.
PARTIAL_FILE = "partial_rollouts.json"
#: Seed offset between two generation rounds of a step (a round's samples must not repeat the last round's).
_ROUND_SEED = 7907


@dataclass
class PartialConfig:
    """The ``[trainer]`` settings of ``trainer.mode = "partial"``.

    Attributes:
        token_budget: most tokens an unfinished sample generates per round; a sample still unfinished
            after it (no stop token, under ``rollout.max_new_tokens``) is carried into the next round, and
            into the next step once ``data.batch_size`` groups have finished. Smaller: shorter steps, more
            stale tokens; at ``rollout.max_new_tokens`` or above, every sample ends in one round (sync).
        sync_check_every: every this many syncs the weight-sync guard checks the engine, as in the overlapping
            modes (:func:`~verl_trainer_async.source.check_engine_sync`): a step with carried samples is stale,
            and its own check skips it. 0: off.
    """

    token_budget: int = 32
    sync_check_every: int = 1

    def validate(self) -> None:
        if self.token_budget < 1:
            raise ConfigError("token_budget", f"must be at least 1 token per sample and round (the step's "
                                              f"generation budget), got {self.token_budget}")
        if self.sync_check_every < 0:
            raise ConfigError("sync_check_every", "must be >= 0 updates (0: never check the engine's weights)")


@dataclass
class _Sample:
    """One response in progress: its tokens, their engine log-probs and the weight version of each segment."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    #: ``[version, tokens]`` per generation round that added tokens (the oldest first).
    segments: list[list[int]] = field(default_factory=list)
    finish: str | None = None

    @property
    def version(self) -> int:
        """The weight version of its oldest token."""
        return self.segments[0][0]


@dataclass
class _Group:
    """A prompt (its index in the training rows) and its ``rollout.n`` samples."""

    index: int
    samples: list[_Sample]

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    def to_state(self) -> dict[str, Any]:
        return {"index": self.index, "samples": [dataclasses.asdict(s) for s in self.samples]}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "_Group":
        return cls(index=int(state["index"]), samples=[_Sample(**s) for s in state["samples"]])


class _Replay:
    """The run's engine, except that its first ``generate`` on the finished groups' prompts returns their
    responses: the core's rollout stage scores and filters them as if it had generated them. Any other call
    (a greedy baseline, dynamic sampling's extra prompts) generates on the engine, with the current weights."""

    def __init__(self, engine: Any, prompts: Sequence[Sequence[int]], output: RolloutOutput, n: int) -> None:
        self._engine = engine
        self._prompts = [list(p) for p in prompts]
        self._output: RolloutOutput | None = output
        self._n = n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, sampling: SamplingParams) -> RolloutOutput:
        output, self._output = self._output, None
        if (output is not None and sampling.n == self._n and not sampling.greedy
                and [list(p) for p in prompt_ids] == self._prompts):
            return output
        return self._engine.generate(prompt_ids, sampling=sampling)


class PartialSource(StepSource):
    """Steps from budgeted generation rounds on the run's engine; unfinished samples carried over (see the module)."""

    Config = PartialConfig

    @classmethod
    def check(cls, config: PartialConfig, *, mode: str, algorithm: str, generates: bool, off_policy: bool,
              executor: Any, executor_config: Any) -> None:
        check_stale_samples(mode=mode, algorithm=algorithm, generates=generates, off_policy=off_policy)

    @classmethod
    def defaults(cls, raw: Mapping[str, Any], registry: Any) -> tuple[dict[str, dict[str, Any]], str]:
        """Carried samples are stale: the algorithm's truncated importance weights are on unless the user
        set them (as for the overlapping modes)."""
        return stale_sample_defaults(raw, registry)

    def __init__(self, config: PartialConfig, *, trainer: Any,
                 resumed: tuple[Path, Mapping[str, Any]] | None = None) -> None:
        super().__init__(config, trainer=trainer, resumed=resumed)
        if trainer.make_environment is not None:
            raise ConfigError("trainer.mode", "'partial' cannot carry multi-turn episodes over (the environment "
                                              "runs its own generation loop); use trainer.mode='sync' or "
                                              "'colocate_async' with [environment]")
        #: Prompt groups drawn and not trained yet, in the order they were drawn.
        self.pool: list[_Group] = []
        self.engine_check = EngineCheck(config.sync_check_every)  # the run's engine, after each sync
        if resumed is not None and (resumed[0] / PARTIAL_FILE).is_file():
            saved = json.loads((resumed[0] / PARTIAL_FILE).read_text())
            self.pool = [_Group.from_state(g) for g in saved["groups"]]

    # -------------------------------------------------------------------- the step
    def next(self, step: int) -> SourcedStep:
        checked = self.engine_check.result()
        t = self.trainer
        rc = t.config.rollout.config
        want = t.config.data.batch_size
        version = step - 1  # the engine holds the weights after step - 1 updates
        sampling = t.step_context(step, []).sampling
        started = time.perf_counter()
        rounds = generated = 0
        while sum(g.done for g in self.pool) < want:
            if sum(not g.done for g in self.pool) < want:
                self.pool += [_Group(i, [_Sample() for _ in range(rc.n)]) for i in t.sampler.next_batch()]
            generated += self._round(step, sampling, rounds, version, rc.max_new_tokens)
            rounds += 1
        generate_s = time.perf_counter() - started
        take = [g for g in self.pool if g.done][:want]
        self.pool = [g for g in self.pool if not any(g is x for x in take)]

        rows = [t.train_rows[g.index] for g in take]
        samples = [s for g in take for s in g.samples]
        output = RolloutOutput(response_ids=[list(s.tokens) for s in samples],
                               log_probs=[list(s.log_probs) for s in samples],
                               finish_reasons=[s.finish for s in samples])
        t._drawn = []  # what the stage's dynamic sampling draws on top (t.draw_prompts records it)
        ctx = t.step_context(step, rows, rollout=_Replay(t.rollout, [r["prompt_ids"] for r in rows], output, rc.n))
        batch = produce_rollout(ctx, t.dataflow.rollout_request)
        oldest = [min(s.version for s in g.samples) for g in take]
        # Group ids past the step's groups are dynamic sampling's extra prompts, generated on the current weights.
        versions = [oldest[g] if g < len(take) else version for g in batch.group_ids.tolist()]
        batch = batch.replace(meta={**batch.meta, "weight_version": versions})
        trained_tokens = sum(len(s.tokens) for s in samples)
        stale_tokens = sum(n for s in samples for v, n in s.segments if v < version)
        unfinished = [s for g in self.pool for s in g.samples if s.finish is None]
        metrics = dict(ctx.metrics)
        metrics.update({
            "timing/generate": generate_s + metrics.get("timing/generate", 0.0),
            "partial/rounds": float(rounds),
            "partial/generated_tokens": float(generated),
            "partial/staleness": float(version - min(oldest)),
            "partial/resumed_samples": float(sum(len(s.segments) > 1 for s in samples)),
            "partial/stale_token_frac": stale_tokens / max(1, trained_tokens),
            "partial/carried_samples": float(sum(len(s.tokens) > 0 for s in unfinished)),
            "partial/pool_groups": float(len(self.pool)), **checked,
        })
        return SourcedStep(prompts=rows, indices=[g.index for g in take] + list(t._drawn), produced=batch,
                           staleness=version - min(versions), metrics=metrics)

    def _round(self, step: int, sampling: SamplingParams, rnd: int, version: int, max_new: int) -> int:
        """One generation round: every unfinished sample of the pool resumes from prompt + its tokens, for at
        most ``token_budget`` tokens (fewer where it would pass ``max_new``); returns the tokens generated."""
        t = self.trainer
        active = [(g, s) for g in self.pool for s in g.samples if s.finish is None]
        limits = [min(self.config.token_budget, max_new - len(s.tokens)) for _, s in active]
        prompts = [t.train_rows[g.index]["prompt_ids"] + s.tokens for g, s in active]
        if not getattr(t.rollout, "accepts_multi_modal", False) and any(
                getattr(p, "multi_modal_data", None) for p in prompts):
            raise ConfigError("rollout.name", f"prompts have images, and the {t.config.rollout.name!r} rollout engine "
                                              f"cannot take images (it would sample from the text alone); use "
                                              f"rollout.name='hf', or an engine with accepts_multi_modal")
        seed = None if sampling.seed is None else sampling.seed + _ROUND_SEED * (rnd + 1)
        # One call for the whole round (each sample its own prompt: n = 1); a sample with fewer tokens left
        # than the budget keeps only its share of the response (the rest would pass its limit).
        out = t.rollout.generate(prompts, sampling=dataclasses.replace(sampling, n=1, max_new_tokens=max(limits),
                                                                       seed=seed))
        out = t.boundary.engine_output(out, expected=len(active), step=step)
        if out.log_probs is None:
            raise RuntimeError(f"rollout engine {t.config.rollout.name!r} returned no log-probs; trainer.mode="
                               f"'partial' needs the engine's per-token log-probs to weigh carried samples")
        generated = 0
        for (_, s), limit, response, lps, reason in zip(active, limits, out.response_ids, out.log_probs,
                                                        out.finish_reasons):
            # A stop token past the sample's limit does not count: the response is cut before it.
            stopped = reason == "stop" and len(response) <= limit
            tokens = list(response[:limit])
            if tokens:
                s.segments.append([version, len(tokens)])
            s.tokens += tokens
            s.log_probs += list(lps[:limit])
            generated += len(tokens)
            if stopped:
                s.finish = "stop"
            elif len(s.tokens) >= max_new or not tokens:  # at its response limit (or the engine gave nothing)
                s.finish = "length"
        return generated

    def start(self) -> None:
        # A batch with carried samples is stale and its step's own check skips it: the engine is checked
        # on the weights it starts from here, and after each sync below.
        t = self.trainer
        if self.engine_check.due(t, t.step, starting=True):
            self.engine_check.run(t, t.rollout, t.step)

    def after_update(self, step: int) -> None:
        sync_rollout_weights(self.trainer.rollout, self.trainer.actor)
        if self.engine_check.due(self.trainer, step):
            self.engine_check.run(self.trainer, self.trainer.rollout, step)

    # -------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """How many groups and samples the pool carries (the samples themselves: :data:`PARTIAL_FILE`)."""
        unfinished = [s for g in self.pool for s in g.samples if s.finish is None]
        return {"partial": {"groups": len(self.pool), "finished_groups": sum(g.done for g in self.pool),
                            "carried_samples": sum(len(s.tokens) > 0 for s in unfinished),
                            "prompts": [g.index for g in self.pool]}}

    def write_checkpoint(self, directory: Path) -> None:
        (directory / PARTIAL_FILE).write_text(json.dumps({"groups": [g.to_state() for g in self.pool]}))
