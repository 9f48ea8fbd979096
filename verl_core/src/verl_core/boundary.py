"""Checks on what plugins hand the core, made once, where it enters.

Environments, reward scorers and rollout engines are other people's code. A NaN reward, a string
where a number belongs, an observation that is text instead of messages, a token id outside the
vocabulary, a prompt row without its token ids: each would otherwise be trained on, silently. Each check here raises
:class:`PluginOutputError` naming the plugin (its kind, entry-point name and distribution), the
step and row, what was expected and what came. After these checks the core trusts its own types.

A non-finite reward is the one invalid value a run may choose to live with: ``reward.on_invalid =
"skip"`` drops such rows, counts them in ``reward/invalid_rows`` and lets the health checks report
them (:func:`finite_rows`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from verl_core.contracts import RolloutOutput, StepResult

__all__ = ["Boundary", "PluginOutputError", "plugin_label", "check_messages", "check_step_result", "check_scores",
           "check_rollout_output", "check_advantages", "check_response_budget", "check_prompt_rows", "finite_rows"]


class PluginOutputError(RuntimeError):
    """A plugin returned something the core cannot train on; the step was not trained."""


@dataclass
class Boundary:
    """What the checks know of a run: how to name each plugin, the model's vocabulary, what a
    non-finite reward does (``reward.on_invalid``), and the last weight version the engine reported
    (so that it never goes back). One per rollout engine; the step context carries it."""

    rollout: str = "the rollout engine"
    scorer: str = "the reward scorer"
    environment: str = "the environment"
    algorithm: str = "the algorithm"
    vocab_size: int = 2**62
    on_invalid: str = "stop"
    last_version: int | None = None

    def engine_output(self, output: Any, *, expected: int, step: int) -> RolloutOutput:
        """:func:`check_rollout_output` against this engine's earlier versions; remembers this one's."""
        output = check_rollout_output(output, expected=expected, vocab_size=self.vocab_size, source=self.rollout,
                                      step=step, last_version=self.last_version)
        if output.weight_version is not None:
            self.last_version = output.weight_version
        return output


def plugin_label(registry: Any, kind: str, name: str) -> str:
    """``"environment 'calc' (verl-env-tools 0.1.0)"``: how errors name a plugin."""
    try:
        info = registry.info(kind, name)
        return f"{kind} {name!r} ({info.distribution} {info.version})"
    except Exception:  # an object passed in, not found by name: the kind and name still say which
        return f"{kind} {name!r}"


def _show(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= limit else text[:limit] + '...'}"


def _fail(source: str, where: str, expected: str, value: Any, *,
          outcome: str = "Nothing from this step was trained on") -> PluginOutputError:
    return PluginOutputError(f"{source} returned {_show(value)} {where}; expected {expected}. {outcome}; "
                             f"fix the plugin")


def check_messages(value: Any, *, source: str, where: str, **outcome: str) -> list[dict[str, Any]]:
    """Chat messages: a list of dicts, each with a string ``role`` and a ``content`` that is a string
    (or a list of content parts, for images)."""
    expected = "a list of chat messages, each a dict with a str 'role' and a str 'content'"
    if not isinstance(value, list):
        raise _fail(source, where, expected, value, **outcome)
    for i, message in enumerate(value):
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), (str, list))):
            raise _fail(source, f"{where} (message {i})", expected, message, **outcome)
    return value


def check_prompt_rows(rows: Any, *, source: str, split: str, vocab_size: int) -> list[dict[str, Any]]:
    """A data reader's rows of ``split``: a list of dicts, each with the fields the core reads
    (:class:`~verl_core.contracts.DataReader`), ``prompt_ids`` non-empty token ids in ``[0, vocab_size)``."""
    outcome = "Nothing was trained"
    if not isinstance(rows, list):
        raise _fail(source, f"as the {split} rows", "a list of row dicts", rows, outcome=outcome)
    for i, row in enumerate(rows):
        where = f"{split} row {i}"
        if not isinstance(row, dict):
            raise _fail(source, f"as {where}", "a dict with prompt_ids, prompt_text, data_source, ...", row,
                        outcome=outcome)
        ids = row.get("prompt_ids")
        if not isinstance(ids, list) or not ids or not (set(map(type, ids)) <= {int} or all(
                isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in ids)):
            raise _fail(source, f"as prompt_ids of {where}", "a non-empty list of int token ids (a PromptIds for a "
                        "prompt with images)", ids, outcome=outcome)
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise _fail(source, f"as prompt_ids of {where}", f"token ids in [0, {vocab_size}), the model's vocabulary",
                        [v for v in ids if not 0 <= v < vocab_size][:5], outcome=outcome)
        for key, kind, expected in (("data_source", str, "a non-empty str (it picks the reward)"),
                                    ("prompt_text", str, "a str (the rendered prompt)"),
                                    ("extra_info", dict, "a dict"), ("raw", dict, "a dict (the row's columns)")):
            if not isinstance(row.get(key), kind) or (key == "data_source" and not row[key]):
                raise _fail(source, f"as {key} of {where}", expected, row.get(key), outcome=outcome)
        check_messages(row.get("prompt_messages"), source=source, where=f"as prompt_messages of {where}",
                       outcome=outcome)
    return rows


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_step_result(value: Any, *, source: str, where: str) -> StepResult:
    """An environment's :class:`StepResult`: observation ``None`` or messages, a real-number reward
    (a bool or a string is refused: ``"1"`` is not a reward), a bool ``done``, a dict ``info``.
    A NaN or infinite reward passes here; the reward stage decides (``reward.on_invalid``)."""
    if not isinstance(value, StepResult):
        raise _fail(source, where, "a verl_core.contracts.StepResult", value)
    if value.observation is not None:
        check_messages(value.observation, source=source, where=f"as the observation {where}")
    if not _is_real(value.reward):
        raise _fail(source, f"as the reward {where}", "a real number (int or float; not a bool or a string)",
                    value.reward)
    if not isinstance(value.done, bool):
        raise _fail(source, f"as done {where}", "a bool", value.done)
    if not isinstance(value.info, dict):
        raise _fail(source, f"as info {where}", "a dict", value.info)
    parts = value.info.get("rewards", {})
    if not isinstance(parts, dict) or not all(isinstance(k, str) and _is_real(v) for k, v in parts.items()):
        raise _fail(source, f"as info['rewards'] {where}", "a dict of reward names to real numbers", parts)
    return value


def check_scores(value: Any, count: int, *, source: str, step: int) -> torch.Tensor:
    """A scorer's scores: ``count`` real numbers (a 1-D tensor); non-finite ones pass to :func:`finite_rows`."""
    where = f"as the scores of step {step}"
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.is_complex() or value.dtype == torch.bool:
        raise _fail(source, where, f"a 1-D real tensor of {count} scores", value)
    if value.shape[0] != count:
        raise _fail(source, where, f"{count} scores, one per response", f"{value.shape[0]} scores")
    return value.float()


def check_rollout_output(output: Any, *, expected: int, vocab_size: int, source: str, step: int,
                         last_version: int | None = None) -> RolloutOutput:
    """A rollout engine's output: ``expected`` responses of token ids inside ``[0, vocab_size)``, as
    many log-probs as tokens, each finite and at most 0 (1e-4 of rounding allowed), a finish reason
    per response, and a weight version that never goes back."""
    where = f"at step {step}"
    if not isinstance(output, RolloutOutput):
        raise _fail(source, where, "a verl_core.contracts.RolloutOutput", output)
    ids, lps = output.response_ids, output.log_probs
    if len(ids) != expected or len(output.finish_reasons) != expected or (lps is not None and len(lps) != expected):
        raise _fail(source, where, f"{expected} responses with a finish reason (and log-probs) each",
                    f"{len(ids)} responses, {len(output.finish_reasons)} finish reasons"
                    + ("" if lps is None else f", {len(lps)} log-prob lists"))
    for row, tokens in enumerate(ids):  # as tensors: a long response is checked at C speed
        t = _tensor(tokens)
        if t is None or t.is_floating_point() or t.dtype == torch.bool or (
                t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size)):
            bad = [v for v in tokens if not isinstance(v, numbers.Integral) or not 0 <= v < vocab_size]
            raise _fail(source, f"as token ids {where}, row {row}", f"integers in [0, {vocab_size})", bad[:5])
        if lps is None:
            continue
        if len(lps[row]) != len(tokens):
            raise _fail(source, f"as log-probs {where}, row {row}", f"one per token ({len(tokens)})",
                        f"{len(lps[row])} log-probs")
        v = _tensor(lps[row], torch.float64)
        if v is None or not (torch.isfinite(v) & (v <= 1e-4)).all():
            wrong = [x for x in lps[row] if not (_is_real(x) and math.isfinite(x) and x <= 1e-4)]
            raise _fail(source, f"as log-probs {where}, row {row}", "finite numbers <= 0", wrong[:5])
    version = output.weight_version
    if version is not None and last_version is not None and version < last_version:
        raise _fail(source, f"as weight_version {where}", f"at least {last_version} (the version it reported "
                    f"before: weights never go back)", version)
    return output


def check_response_budget(batch: Any, *, source: str, step: int) -> None:
    """The response budget an episode batch records (``info["max_new_tokens"]``), the constant Dr. GRPO's loss
    divides by: an int no smaller than the batch's response width."""
    budget, width = batch.info.get("max_new_tokens"), batch.response_length
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < max(1, width):
        raise _fail(source, f"as the batch's info['max_new_tokens'] at step {step}",
                    f"its response budget, an int >= the responses' width ({width})", budget)


def check_advantages(advantages: Any, response_mask: torch.Tensor, *, source: str, step: int) -> torch.Tensor:
    """An algorithm's advantages: a ``[B, R]`` tensor like the response mask, finite on every loss token.

    Rewards reach the algorithm finite (:func:`finite_rows`), so a NaN here is the estimator's own (a
    division by a zero spread, say): always a stop, whatever ``reward.on_invalid`` says."""
    where = f"as advantages at step {step}"
    if not isinstance(advantages, torch.Tensor) or advantages.shape != response_mask.shape:
        raise _fail(source, where, f"a tensor of shape {tuple(response_mask.shape)} (the response mask's)",
                    tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else advantages)
    bad = ~torch.isfinite(advantages) & (response_mask > 0)
    if bad.any():
        row, col = (int(i) for i in torch.nonzero(bad)[0])
        raise PluginOutputError(f"{source} computed a non-finite advantage ({float(advantages[row, col])}) at step "
                                f"{step}, row {row}, token {col}, from finite rewards; nothing from this step was "
                                f"trained on and the last checkpoint is kept. Fix the algorithm's estimator")
    return advantages


def _tensor(values: Sequence[Any], dtype: torch.dtype | None = None) -> torch.Tensor | None:
    if any(isinstance(v, (bool, str, bytes)) for v in values[:1]) or (values and isinstance(values[-1], (bool, str))):
        return None
    try:
        return torch.as_tensor(list(values), dtype=dtype)
    except (TypeError, ValueError, RuntimeError):
        return None


def finite_rows(scores: torch.Tensor, *, parts: Sequence[tuple[str, torch.Tensor]], on_invalid: str,
                step: int) -> torch.Tensor | None:
    """Rows whose reward is finite; ``None`` when all are.

    ``parts`` names where each summand of ``scores`` came from (the scorer, an environment's per-turn
    rewards), so that a stop names the plugin that produced the non-finite value. With ``on_invalid
    = "stop"`` any such row raises; with ``"skip"`` the others' indices come back (a step where
    nothing is left stops too: there is nothing to train on).
    """
    bad = ~torch.isfinite(scores)
    if not bad.any():
        return None
    rows = torch.nonzero(bad).flatten().tolist()
    culprit = next((name for name, part in parts if not torch.isfinite(part[rows[0]]).all()), "a plugin")
    if on_invalid == "skip" and len(rows) < len(scores):
        return torch.nonzero(~bad).flatten()
    how = ("every row is invalid, so nothing is left to train on" if on_invalid == "skip" else
           "set reward.on_invalid = \"skip\" to drop such rows (counted in reward/invalid_rows) and go on")
    raise PluginOutputError(f"{culprit} gave a non-finite reward ({float(scores[rows[0]])}) at step {step}, row "
                            f"{rows[0]} ({len(rows)} of {len(scores)} rows); nothing from this step was trained on "
                            f"and the last checkpoint is kept. Fix the plugin, or {how}")
