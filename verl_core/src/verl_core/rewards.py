"""Built-in reward functions and the reward manager that applies them to a batch.

A reward plugin is a callable taking a :class:`~verl_core.interfaces.RewardInput` and returning
one float per response (it may be ``async``). :func:`per_sample` turns a plain
``fn(response, ground_truth) -> float`` into one.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Sequence

import torch

from verl_core.batch import Batch
from verl_core.interfaces import RewardInput

__all__ = ["per_sample", "arithmetic_reward", "exact_match_reward", "RewardManager", "RewardError"]


class RewardError(RuntimeError):
    """A reward function failed on a sample and ``reward.on_error`` is ``"fail"``."""


def per_sample(fn: Callable[..., float]) -> Callable[[RewardInput], list[float]]:
    """Wrap ``fn(response, ground_truth) -> float`` as a batch reward function."""

    def batch_fn(inputs: RewardInput) -> list[float]:
        return [float(fn(r, g)) for r, g in zip(inputs.responses, inputs.ground_truths)]

    batch_fn.__doc__ = fn.__doc__
    batch_fn.__name__ = getattr(fn, "__name__", "reward")
    return batch_fn


def _exact(response: str, ground_truth: Any) -> float:
    """1.0 when the stripped response equals the ground truth exactly."""
    return 1.0 if response.strip() == str(ground_truth).strip() else 0.0


exact_match_reward = per_sample(_exact)
# The built-in addition task answers with the number alone, so its rule is exact match.
arithmetic_reward = per_sample(_exact)


class RewardManager:
    """Decodes responses, routes each sample to its reward function and returns scores.

    With ``name="auto"`` a sample's reward plugin is the one named like its ``data_source``.
    """

    def __init__(self, *, registry: Any, tokenizer: Any, name: str = "auto", on_error: str = "fail") -> None:
        self.registry = registry
        self.tokenizer = tokenizer
        self.name = name
        self.on_error = on_error

    def _function(self, data_source: str) -> Callable[[RewardInput], Any]:
        return self.registry.load("reward", self.name if self.name != "auto" else data_source)

    def score_texts(self, responses: Sequence[str], meta: dict[str, list[Any]]) -> tuple[torch.Tensor, dict[str, float]]:
        n = len(responses)
        sources = [s or "default" for s in meta.get("data_source", [None] * n)]
        truths = meta.get("ground_truth", [None] * n)
        extras = [e or {} for e in meta.get("extra_info", [None] * n)]
        prompts = [p or "" for p in meta.get("prompt_text", [None] * n)]
        scores = torch.zeros(n, dtype=torch.float32)
        errors = 0
        metrics: dict[str, float] = {}
        for source in sorted(set(sources)):
            idx = [i for i, s in enumerate(sources) if s == source]
            fn = self._function(source)
            inputs = RewardInput(responses=[responses[i] for i in idx], prompts=[prompts[i] for i in idx],
                                 ground_truths=[truths[i] for i in idx], data_sources=[source] * len(idx),
                                 extra_infos=[extras[i] for i in idx])
            try:
                values = fn(inputs)
                if inspect.isawaitable(values):
                    values = asyncio.run(_await(values))
                values = [float(v) for v in values]
                if len(values) != len(idx):
                    raise ValueError(f"returned {len(values)} scores for {len(idx)} responses")
            except Exception as exc:
                if self.on_error == "fail":
                    raise RewardError(f"reward for data_source {source!r} failed on response "
                                      f"{inputs.responses[0]!r} (ground truth {inputs.ground_truths[0]!r}): "
                                      f"{type(exc).__name__}: {exc}") from exc
                values = [0.0] * len(idx)
                errors += len(idx)
            scores[idx] = torch.tensor(values, dtype=torch.float32)
            metrics[f"reward/{source}/mean"] = sum(values) / len(values)
        metrics["reward/errors"] = float(errors)
        return scores, metrics

    def score(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores ``[B]`` for a generated batch, plus ``reward/...`` metrics."""
        texts = self.tokenizer.batch_decode(
            [ids[mask.bool()].tolist() for ids, mask in zip(batch.response_ids, batch.response_attention_mask)],
            skip_special_tokens=True)
        return self.score_texts(texts, batch.meta)


async def _await(value: Any) -> Any:
    return await value
