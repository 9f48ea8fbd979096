"""The reward manager: turns a generated batch into one score per response.

:class:`RewardManager` decodes the responses, scores each sample with every configured reward
component (``reward.components``, or the single ``reward.name``), and sums the components with their
weights. A component is a rule or custom reward function (see :mod:`verl_rewards.functions` for the
names and shapes a reward may have) or the reward model (``reward.model_path``), which runs as a
``reward_model`` worker group on the training backend.

Rewards are resolved when the manager is built, for every data_source the data holds, so a typo or a
data_source without a reward fails before any model loads. Reward functions run in worker processes
with a time limit (:mod:`verl_rewards.workers`); a reward that raises or times out either stops the
run with the row and the error (``reward.on_error = "fail"``) or scores 0 and is counted in
``reward/errors`` (``"zero"``).

Metrics: ``reward/<component>/mean`` for each component when there are several,
``reward/source/<data_source>/mean`` for the summed score per data_source, ``reward/errors`` and
``reward/timeouts``.
"""

from __future__ import annotations

import difflib
import weakref
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from verl_core.batch import Batch
from verl_core.contracts import RewardScorer
from verl_rewards.config import REWARD_MODEL_COMPONENT, RewardConfig
from verl_rewards.functions import (
    LoadedReward,
    RewardError,
    RewardInput,
    RewardSpecError,
    load_reward,
    resolve_data_source,
)
from verl_rewards.workers import NOT_SCORED, Outcome, RewardWorkerPool, score_inline

__all__ = ["RewardManager"]


def _short(text: Any, limit: int = 300) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2:]


class RewardManager(RewardScorer):
    """Scores batches with the configured reward components: the ``default`` scorer (``verl.scorers``).

    Args:
        config: the ``reward`` section; overrides ``name`` and ``on_error``.
        registry: the plugin registry rewards are found in (default: the installed plugins).
        tokenizer: the policy's tokenizer (to decode responses).
        data_sources: data sources the data holds, resolved (and checked) now.
        name: the reward when no ``config`` is given (``"auto"`` picks by data_source).
        on_error: ``"fail"`` or ``"zero"`` when no ``config`` is given.

    Raises:
        RewardSpecError: a reward name, file or option is wrong, or a data_source has no reward.
    """

    Config = RewardConfig
    config: RewardConfig

    def __init__(self, *, config: RewardConfig | None = None, registry: Any = None, tokenizer: Any = None,
                 data_sources: Iterable[str] = (), name: str = "auto", on_error: str = "fail") -> None:
        config = config or RewardConfig(name=name, on_error=on_error)
        config.validate()
        if registry is None:
            from verl_core.registry import PluginRegistry

            registry = PluginRegistry()
        super().__init__(config=config, registry=registry, tokenizer=tokenizer, data_sources=data_sources)
        self.on_error = self.config.on_error
        self.components = self.config.resolved_components()
        self._loaded: dict[str, LoadedReward] = {}
        self._routes: dict[str, str] = {}
        self._pool: RewardWorkerPool | None = None
        if self.config.isolation == "process":
            self._pool = RewardWorkerPool(self.config.workers)
            self._finalizer = weakref.finalize(self, self._pool.close)
        self.reward_model: Any = None
        self.reward_model_tokenizer: Any = None
        if self.config.model_path and not Path(self.config.model_path).expanduser().is_dir():
            raise RewardSpecError("reward.model_path", f"{self.config.model_path!r} is not a directory (give a local "
                                                       f"Hugging Face sequence-classification model)")
        for i, component in enumerate(self.components):
            path = f"reward.components[{i}].name" if self.config.components else "reward.name"
            if component.name not in ("auto", REWARD_MODEL_COMPONENT):
                self._reward(component.name, path=path)
        data_sources = set(data_sources)
        self.check_data_sources(data_sources)
        # Every reward of the run is resolved now when its data_sources are known (or none is picked by them).
        self._check_options(complete=bool(data_sources) or not self.uses_auto)

    # ------------------------------------------------------------------ resolution
    @property
    def uses_auto(self) -> bool:
        return any(c.name == "auto" for c in self.components)

    def check_data_sources(self, data_sources: Iterable[str]) -> None:
        """Resolve the reward of each data_source now (only matters for ``"auto"`` components)."""
        if self.uses_auto:
            for source in sorted(set(data_sources)):
                self._reward(self._route(source), path=f"reward.aliases.{source}")

    def _route(self, data_source: str) -> str:
        if data_source not in self._routes:
            self._routes[data_source] = resolve_data_source(data_source, registry=self.registry,
                                                            aliases=self.config.aliases)
        return self._routes[data_source]

    def _reward(self, spec: str, *, path: str = "reward.name") -> LoadedReward:
        if spec not in self._loaded:
            label = spec.rpartition(":")[2] if spec.startswith("file:") else spec
            self._loaded[spec] = load_reward(spec, registry=self.registry, options=self.config.options.get(label),
                                             path=path)
        return self._loaded[spec]

    def _check_options(self, *, complete: bool) -> None:
        """Each ``reward.options`` key names a reward; when ``complete``, one this run scores with (options for
        another installed reward would be accepted and change nothing)."""
        used = {r.label for r in self._loaded.values()}
        known = set(self.registry.names("reward")) | used
        for key in self.config.options:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise RewardSpecError(f"reward.options.{key}",
                                      f"no reward named {key!r}{hint}; rewards: {sorted(known)}")
            if complete and key not in used:
                raise RewardSpecError(f"reward.options.{key}",
                                      f"this run scores with no {key!r} reward (it scores with {sorted(used)}), so "
                                      f"these settings would change nothing; remove them, or route a data_source "
                                      f"to it (reward.aliases)")

    # ------------------------------------------------------------------ reward model
    def reward_model_path(self) -> str | None:
        """``reward.model_path``, which the trainer starts as the ``reward_model`` role, or None."""
        return self.config.model_path or None

    def attach_reward_model(self, group: Any, tokenizer: Any) -> None:
        """Use ``group`` (a ``reward_model`` worker group) and its tokenizer for the reward model component."""
        self.reward_model = group
        self.reward_model_tokenizer = tokenizer

    def _reward_model_batch(self, responses: Sequence[str], meta: dict[str, list[Any]]) -> Batch:
        """Re-tokenize (prompt, response) pairs for the reward model, in its own chat format."""
        from verl_core.kit import left_pad, right_pad

        tok = self.reward_model_tokenizer
        n = len(responses)
        messages_list = meta.get("prompt_messages") or [None] * n
        texts = meta.get("prompt_text") or [""] * n
        prompts, answers = [], []
        for response, messages, prompt_text in zip(responses, messages_list, texts):
            messages = list(messages or [{"role": "user", "content": prompt_text or ""}])
            if getattr(tok, "chat_template", None):
                prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                full = tok.apply_chat_template([*messages, {"role": "assistant", "content": response}],
                                               tokenize=False)
                answer = full[len(prompt):] if full.startswith(prompt) else response
            else:
                prompt, answer = "\n".join(m["content"] for m in messages), response
            p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            a_ids = tok(answer, add_special_tokens=False)["input_ids"]
            if not p_ids and not a_ids:
                a_ids = [tok.eos_token_id if tok.eos_token_id is not None else 0]
            prompts.append(p_ids)
            answers.append(a_ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        prompt_ids, prompt_mask = left_pad(prompts, pad)
        width = max(1, max(len(a) for a in answers))
        response_ids = right_pad(answers, pad, torch.long, width)
        attn = right_pad([[1] * len(a) for a in answers], 0, torch.long, width)
        return Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                     response_attention_mask=attn, response_mask=attn.clone(), group_ids=torch.arange(n),
                     info={"pad_token_id": pad})

    def _score_reward_model(self, responses: Sequence[str], meta: dict[str, list[Any]]) -> torch.Tensor:
        if self.reward_model is None:
            raise RewardError("the reward_model component has no reward model worker; the trainer starts one "
                              "from reward.model_path (call attach_reward_model when using RewardManager directly)")
        scores = self.reward_model.compute_scores(self._reward_model_batch(responses, meta))
        return torch.as_tensor(scores, dtype=torch.float32).reshape(-1)

    # ------------------------------------------------------------------ scoring
    def _run(self, reward: LoadedReward, inputs: RewardInput) -> list[Outcome]:
        if self._pool is not None:
            return self._pool.score(reward, inputs, timeout=self.config.timeout, fail_fast=self.on_error == "fail")
        return score_inline(reward, inputs, timeout=self.config.timeout)

    def score_texts(self, responses: Sequence[str], meta: dict[str, list[Any]],
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores ``[N]`` for decoded responses with their per-sample ``meta`` lists, plus metrics.

        ``meta`` holds ``ground_truth``, ``data_source``, ``extra_info``, ``prompt_text`` and (for the
        reward model) ``prompt_messages``, one entry per response.
        """
        n = len(responses)
        sources = [s or "default" for s in (meta.get("data_source") or [None] * n)]
        prompts = [p or "" for p in (meta.get("prompt_text") or [None] * n)]
        inputs = RewardInput(responses=list(responses), prompts=prompts,
                             ground_truths=list(meta.get("ground_truth") or [None] * n), data_sources=sources,
                             extra_infos=[e or {} for e in (meta.get("extra_info") or [None] * n)])
        total = torch.zeros(n, dtype=torch.float32)
        metrics: dict[str, float] = {}
        errors = timeouts = 0
        for component in self.components:
            label = component.name.rpartition(":")[2] if component.name.startswith("file:") else component.name
            if component.name == REWARD_MODEL_COMPONENT:
                values = self._score_reward_model(responses, meta)
            else:
                values = torch.zeros(n, dtype=torch.float32)
                groups: dict[str, list[int]] = {}
                for i, source in enumerate(sources):
                    spec = self._route(source) if component.name == "auto" else component.name
                    groups.setdefault(spec, []).append(i)
                for spec, idx in groups.items():
                    reward = self._reward(spec)
                    outcomes = self._run(reward, inputs.select(idx))
                    if self.on_error == "fail":  # name the row that failed, not one a fail-fast call skipped
                        order = sorted(range(len(idx)), key=lambda k: outcomes[k].error == NOT_SCORED)
                        idx, outcomes = [idx[k] for k in order], [outcomes[k] for k in order]
                    for i, outcome in zip(idx, outcomes):
                        if outcome.error is None:
                            values[i] = outcome.score
                            continue
                        if self.on_error == "fail":
                            raise RewardError(self._describe_failure(reward, inputs, i, outcome))
                        errors += 1
                        timeouts += int(outcome.timed_out)
            total += component.weight * values
            if len(self.components) > 1:
                metrics[f"reward/{label}/mean"] = float(values.mean()) if n else 0.0
        for source in sorted(set(sources)):
            idx = [i for i, s in enumerate(sources) if s == source]
            metrics[f"reward/source/{source}/mean"] = float(total[idx].mean())
        metrics["reward/errors"] = float(errors)
        metrics["reward/timeouts"] = float(timeouts)
        return total, metrics

    def _describe_failure(self, reward: LoadedReward, inputs: RewardInput, i: int, outcome: Outcome) -> str:
        what = "timed out" if outcome.timed_out else "failed"
        return (f"reward {reward.spec!r} {what} on row {i} of the batch (data_source {inputs.data_sources[i]!r}): "
                f"{outcome.error}\n  response: {_short(inputs.responses[i])!r}\n  ground truth: "
                f"{_short(inputs.ground_truths[i], 200)!r}\n  prompt: {_short(inputs.prompts[i], 200)!r}\n"
                f"Fix the reward, or set reward.on_error=\"zero\" to score such rows 0 and count them in "
                f"reward/errors")

    def score(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores ``[B]`` for a generated batch, plus ``reward/...`` metrics."""
        texts = self.tokenizer.batch_decode(
            [ids[mask.bool()].tolist() for ids, mask in zip(batch.response_ids, batch.response_attention_mask)],
            skip_special_tokens=True)
        return self.score_texts(texts, batch.meta)

    def close(self) -> None:
        """Stop the reward worker processes."""
        if self._pool is not None:
            self._pool.close()
