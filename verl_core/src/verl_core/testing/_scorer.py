"""Conformance tests for :class:`~verl_core.contracts.RewardScorer` implementations (``reward.scorer``),
and through a scorer for the reward functions it runs.

Subclass :class:`ScorerConformance` and provide the fixtures:

* ``scorer``: the scorer instance, built as the trainer builds it (``Scorer(config=..., registry=...,
  tokenizer=..., data_sources=...)``); it is closed after each test;
* ``cases``: ``(response, meta row, expected score)`` triples, at least three, with ``meta row`` the
  per-sample fields (``ground_truth``, ``data_source``, ``extra_info``, ``prompt_text``); the expected
  score is worked out from the reward's definition in the test, not from the implementation;
* ``tokenizer`` (optional): to check ``score(batch)`` against ``score_texts``; ``None`` skips that case.

Scores are checked with the core's own boundary check (:func:`verl_core.boundary.check_scores`), so a
scorer that passes here is not stopped by it in a run.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import pytest
import torch

from verl_core.boundary import check_scores
from verl_core.contracts import RewardScorer

__all__ = ["ScorerConformance"]

Case = tuple[str, dict[str, Any], float]


def _meta(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    keys = ("ground_truth", "data_source", "extra_info", "prompt_text", "prompt_messages")
    return {k: [r.get(k, {} if k == "extra_info" else None) for r in rows] for k in keys}


class ScorerConformance:
    """Contract tests every reward scorer must pass."""

    @pytest.fixture
    def scorer(self) -> Iterator[RewardScorer]:
        pytest.fail(f"{type(self).__name__} must provide a `scorer` fixture")

    @pytest.fixture
    def cases(self) -> list[Case]:
        pytest.fail(f"{type(self).__name__} must provide a `cases` fixture")

    @pytest.fixture
    def tokenizer(self) -> Any:
        return None

    def score(self, scorer: RewardScorer, cases: list[Case]) -> tuple[torch.Tensor, dict[str, float]]:
        scores, metrics = scorer.score_texts([c[0] for c in cases], _meta([c[1] for c in cases]))
        return check_scores(scores, len(cases), source=type(scorer).__name__, step=0), metrics

    def test_scores_are_the_rewards_definition(self, scorer: RewardScorer, cases: list[Case]) -> None:
        assert len(cases) >= 3, "give at least three cases"
        scores, metrics = self.score(scorer, cases)
        assert torch.isfinite(scores).all(), f"non-finite scores: {scores.tolist()}"
        for (response, row, expected), got in zip(cases, scores.tolist()):
            assert got == pytest.approx(expected), f"{response!r} (ground truth {row.get('ground_truth')!r}): {got}"
        assert isinstance(metrics, dict)
        for key, value in metrics.items():
            assert isinstance(key, str) and isinstance(value, float) and math.isfinite(value), (key, value)

    def test_scores_follow_the_rows_in_any_order(self, scorer: RewardScorer, cases: list[Case]) -> None:
        """Row ``i``'s score is row ``i``'s, whatever else is in the batch and in what order."""
        forward, _ = self.score(scorer, cases)
        backward, _ = self.score(scorer, cases[::-1])
        assert backward.tolist() == forward.flip(0).tolist()
        twice, _ = self.score(scorer, cases + cases)
        assert twice.tolist() == forward.tolist() * 2

    def test_an_empty_batch_gives_no_scores(self, scorer: RewardScorer) -> None:
        scores, _ = scorer.score_texts([], _meta([]))
        assert check_scores(scores, 0, source=type(scorer).__name__, step=0).numel() == 0

    def test_a_generated_batch_scores_as_its_decoded_texts(self, scorer: RewardScorer, cases: list[Case],
                                                          tokenizer: Any) -> None:
        """``score(batch)`` decodes the responses (tool tokens included, padding not) and scores them."""
        if tokenizer is None:
            pytest.skip(f"{type(self).__name__} provides no `tokenizer` fixture")
        from verl_core.batch import Batch
        from verl_core.rollout_utils import left_pad, right_pad

        ids = [tokenizer.encode(c[0], add_special_tokens=False) for c in cases]
        pad = tokenizer.pad_token_id or 0
        prompt, prompt_mask = left_pad([[pad + 0] for _ in cases], pad)
        response = right_pad(ids, pad, torch.long)
        mask = right_pad([[1] * len(r) for r in ids], 0, torch.long, response.shape[1])
        batch = Batch(prompt_ids=prompt, prompt_mask=prompt_mask, response_ids=response,
                      response_attention_mask=mask, response_mask=mask.clone(),
                      group_ids=torch.arange(len(cases)), meta=_meta([c[1] for c in cases]))
        scores, _ = scorer.score(batch)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        expected, _ = scorer.score_texts(texts, _meta([c[1] for c in cases]))
        assert check_scores(scores, len(cases), source=type(scorer).__name__, step=0).tolist() == expected.tolist()
