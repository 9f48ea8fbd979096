"""The multi-turn episode runner: token-in/token-out, with a loss mask.

:meth:`verl_env_kit.MultiTurnEnvironment.run_episodes` calls :func:`run_episodes`; the core's rollout
stage and validation call that on the run's environment class
(:meth:`verl_core.contracts.Environment.run_episodes`). Per trajectory (one per prompt and sample),
with an environment created for it:

1. the environment's :meth:`~verl_core.contracts.Environment.reset` gives the first messages
   (and its tools); the chat template renders them once into the prompt's token ids;
2. the engine samples the model's turn from the trajectory's token ids; **those tokens are kept
   exactly as sampled** (their log-probs too), and never re-tokenised;
3. the environment inspects the turn's text (:meth:`~verl_core.contracts.Environment.step`,
   which may be a coroutine) and answers with observation messages, a reward, or done;
4. only the environment's additions are tokenised: the text the chat template puts after the
   model's last token (the rest of the assistant turn's closing, the observation, the next
   generation prompt), found by rendering the conversation before and after the observation;
5. repeat until done, ``max_turns``, or the response token budget.

All trajectories of a batch advance in lockstep: each round, one batched ``generate`` over the
active ones, then their environment steps concurrently (a thread pool; coroutines on an event loop
per thread), so tool execution overlaps across trajectories.

**Append-only check.** At each trajectory's first observation, the decoded token ids
(prompt, sampled turn, additions) must equal the chat template's full rendering of the same
conversation. A template that is not append-only (one that rewrites earlier turns, e.g. drops
earlier reasoning) fails this; the trajectory then ends at that turn (``env/template_mismatch``
counts them, and a warning says which template) and never trains on mismatched tokens.

The response holds the model's turns and the environment's tokens; ``response_mask`` is 1 on model
tokens and 0 on environment tokens, so losses, KL, entropy and advantages skip tool output. Each
environment reward sits on the last model token of the turn it answered
(``batch.extras[ENV_REWARDS]``, :data:`verl_core.contracts.ENV_REWARDS`); the rollout stage adds them
to the reward stage's scores.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from verl_core.batch import Batch
from verl_core.kit import Boundary, check_messages, check_step_result
from verl_core.contracts import ENV_REWARDS, PromptIds, SamplingParams, StepResult
from verl_core.kit import left_pad, right_pad
from verl_kit.engine import stop_token_ids

if TYPE_CHECKING:
    from verl_core.contracts import Environment, EnvironmentConfig, RolloutEngine

__all__ = ["run_episodes", "render_tokens", "check_append_only"]

logger = logging.getLogger(__name__)


@dataclass
class _Trajectory:
    row: dict[str, Any]
    env: Any
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    tool_errors: int = 0
    components: dict[str, float] = field(default_factory=dict)  # StepResult.info["rewards"], summed over turns
    finish: str = "length"
    done: bool = False
    checked: bool = False
    mismatch: bool = False


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; run the coroutine to completion if it returns one (an async environment)."""
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        return asyncio.run(_await(out))
    return out


async def _await(awaitable: Any) -> Any:
    return await awaitable


def render_tokens(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Any, *, generation_prompt: bool
                  ) -> str:
    """The chat template's text for ``messages`` (with ``tools`` where the template takes them)."""
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt,
                                         **kwargs)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_append_only(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Any = None) -> str | None:
    """Whether rendering ``messages`` turn by turn gives the full rendering; the first difference if not.

    Renders each prefix of the conversation (with the generation prompt before every assistant
    turn) and checks that it is a prefix of the next; returns ``None`` when the template is
    append-only for this conversation, else a description of the first place it is not.
    """
    previous = ""
    for k in range(1, len(messages) + 1):
        nxt = messages[k] if k < len(messages) else None
        text = render_tokens(tokenizer, messages[:k], tools,
                             generation_prompt=nxt is not None and nxt.get("role") == "assistant")
        if not text.startswith(previous):
            at = next((i for i, (a, b) in enumerate(zip(previous, text)) if a != b), min(len(previous), len(text)))
            return (f"rendering {k} messages rewrites the rendering of {k - 1}: at character {at}, "
                    f"{previous[at:at + 40]!r} became {text[at:at + 40]!r}")
        previous = text
    return None


def _assistant_closing(tokenizer: Any, tools: Any) -> str:
    """What the template writes after an assistant message's content (``<|im_end|>\\n`` for ChatML)."""
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x00"}]
    text = render_tokens(tokenizer, probe, tools, generation_prompt=False)
    return text[text.rindex("\x00") + 1:]


def run_episodes(engine: "RolloutEngine", prompts: Sequence[dict[str, Any]], sampling: SamplingParams,
                 make_env: Callable[[], "Environment"], config: "EnvironmentConfig", *, pad_id: int,
                 metrics: dict[str, float] | None = None, boundary: Boundary | None = None, step: int = 0) -> Batch:
    """Run ``sampling.n`` trajectories per prompt row to the end, one environment from ``make_env()``
    each, under ``config``'s turn, token and concurrency limits; the batch of their responses.

    What the environment and the engine return is checked as it arrives (``boundary``, with the
    plugins' names; a malformed value stops the step: :class:`~verl_core.boundary.PluginOutputError`).
    """
    boundary = boundary or Boundary()
    tokenizer = engine.tokenizer
    stop_ids = set(stop_token_ids(tokenizer, sampling.stop_token_ids))
    budget = config.max_response_tokens or sampling.max_new_tokens * config.max_turns
    pool = ThreadPoolExecutor(max_workers=max(1, config.concurrency), thread_name_prefix="verl-env")
    try:
        rows = [row for row in prompts for _ in range(sampling.n)]
        trajectories = list(pool.map(lambda i: _start(rows[i], make_env, tokenizer, boundary, f"at step {step}, row {i}"),
                                     range(len(rows))))
        closing = _assistant_closing(tokenizer, trajectories[0].tools) if trajectories else ""
        row_of = {id(t): i for i, t in enumerate(trajectories)}
        for turn in range(config.max_turns):
            active = [t for t in trajectories if not t.done]
            if not active:
                break
            room = [budget - len(t.response) for t in active]
            # One batched call with the largest room; each trajectory then keeps what fits its own.
            turn_sampling = dataclasses.replace(
                sampling, n=1, max_new_tokens=max(1, min(sampling.max_new_tokens, max(room))),
                seed=None if sampling.seed is None else sampling.seed + 104729 * turn)
            out = boundary.engine_output(engine.generate([t.prompt_ids + t.response for t in active],
                                                         sampling=turn_sampling), expected=len(active), step=step)
            for k, t in enumerate(active):
                ids = list(out.response_ids[k])[:max(1, room[k])]
                lps = list(out.log_probs[k])[:len(ids)] if out.log_probs is not None else [0.0] * len(ids)
                t.response += ids
                t.mask += [1] * len(ids)
                t.log_probs += lps
                t.rewards += [0.0] * len(ids)
                t.turns += 1
                t.finish = out.finish_reasons[k] if len(ids) == len(out.response_ids[k]) else "length"
                if len(t.response) >= budget:
                    t.done = True
            stepping = [t for t in active if not t.done]
            results = list(pool.map(lambda t: _step(t, tokenizer, stop_ids), stepping))
            for t, result in zip(stepping, results):
                check_step_result(result, source=boundary.environment,
                                  where=f"from step() at step {step}, row {row_of[id(t)]}, turn {turn + 1}")
                if result.reward:
                    t.rewards[_last_model_token(t.mask)] += float(result.reward)
                t.tool_errors += int(bool(result.info.get("tool_error")))
                for name, score in (result.info.get("rewards") or {}).items():
                    t.components[name] = t.components.get(name, 0.0) + float(score)
                if result.done or not result.observation or turn == config.max_turns - 1:
                    t.done = True
                    continue
                _append_observation(t, result.observation, tokenizer, closing, stop_ids, budget)
    finally:
        pool.map(_close, [t.env for t in locals().get("trajectories", [])])
        pool.shutdown(wait=True)
    if metrics is not None:
        n = max(1, len(trajectories))
        metrics.update({
            "env/turns_mean": sum(t.turns for t in trajectories) / n,
            "env/tool_errors": float(sum(t.tool_errors for t in trajectories)),
            "env/template_mismatch": float(sum(t.mismatch for t in trajectories)),
            "env/env_token_frac": sum(len(t.mask) - sum(t.mask) for t in trajectories)
            / max(1, sum(len(t.mask) for t in trajectories)),
        })
        for name in sorted({name for t in trajectories for name in t.components}):  # a reward's named parts
            scored = [t.components[name] for t in trajectories if name in t.components]
            metrics[f"reward/{name}"] = sum(scored) / len(scored)
    return _to_batch(trajectories, sampling.n, pad_id, budget)


def _start(row: dict[str, Any], make_env: Callable[[], Any], tokenizer: Any, boundary: Boundary,
           where: str) -> _Trajectory:
    env = make_env()
    extra = {**(row.get("extra_info") or {}), "ground_truth": row.get("ground_truth")}
    messages = list(check_messages(_call(env.reset, prompt=list(row.get("prompt_messages") or row.get("prompt") or []),
                                         extra_info=extra), source=boundary.environment, where=f"from reset() {where}"))
    tools = env.tools()
    given = row.get("prompt_ids")
    if getattr(given, "multi_modal_data", None):
        # A prompt with images keeps the processor's tokens (and its images): the template alone
        # cannot render them. An environment that rewrites such a prompt is refused, not run on text.
        if tools or messages != list(row.get("prompt_messages") or []):
            raise ValueError(f"environment {type(env).__name__} rewrote a prompt with images in reset() (or offers "
                             f"tools); the agent loop renders images only from the data's prompt")
        prompt_ids = given
    else:
        prompt_ids = _encode(tokenizer, render_tokens(tokenizer, messages, tools, generation_prompt=True))
    return _Trajectory(row=row, env=env, messages=messages, tools=tools, prompt_ids=prompt_ids)


def _turn_text(t: _Trajectory, tokenizer: Any, stop_ids: set[int]) -> str:
    """The text of the model's last turn, without its stop token."""
    start = len(t.mask) - next(i for i, m in enumerate(reversed(t.mask)) if m == 0) if 0 in t.mask else 0
    ids = t.response[start:]
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def _step(t: _Trajectory, tokenizer: Any, stop_ids: set[int]) -> StepResult:
    text = _turn_text(t, tokenizer, stop_ids)
    t.messages.append({"role": "assistant", "content": text})
    try:
        return _call(t.env.step, text)
    except Exception as exc:  # an environment that breaks ends its trajectory, not the run
        logger.warning("environment %s failed on a step: %s", type(t.env).__name__, exc)
        return StepResult(observation=None, reward=0.0, done=True, info={"tool_error": True, "error": str(exc)})


def _append_observation(t: _Trajectory, observation: list[dict[str, Any]], tokenizer: Any, closing: str,
                        stop_ids: set[int], budget: int) -> None:
    """Tokenise only what the environment adds after the model's last token; mask it out. An
    observation that leaves no room for another model turn in the budget ends the trajectory."""
    before = render_tokens(tokenizer, t.messages, t.tools, generation_prompt=False)
    t.messages += observation
    after = render_tokens(tokenizer, t.messages, t.tools, generation_prompt=True)
    ended_with_stop = bool(t.response) and t.response[-1] in stop_ids
    stop_text = tokenizer.decode([t.response[-1]], skip_special_tokens=False) if ended_with_stop else ""
    # The model's turn ends the assistant content (and its stop token, if sampled); the rest of
    # the template's closing is the environment's, as are the observation and the next prompt.
    rest_of_closing = closing[len(stop_text):] if ended_with_stop and closing.startswith(stop_text) else closing
    problem = None if after.startswith(before) else "the rendering with the observation rewrites the conversation"
    added = _encode(tokenizer, rest_of_closing + after[len(before):]) if problem is None else []
    if problem is None and not t.checked:
        t.checked = True
        full = render_tokens(tokenizer, t.messages, t.tools, generation_prompt=True)
        built = tokenizer.decode(t.prompt_ids + t.response + added, skip_special_tokens=False)
        if built != full:
            problem = "token-by-token building differs from the full rendering"
    if problem is not None:
        t.mismatch, t.done = True, True
        logger.warning("chat template of %s is not append-only (%s); the trajectory ends at turn %d rather than "
                       "train on re-rendered tokens", getattr(tokenizer, "name_or_path", "?"), problem, t.turns)
        return
    if len(t.response) + len(added) >= budget:
        del t.messages[len(t.messages) - len(observation):]  # the transcript holds what was trained on
        t.done, t.finish = True, "length"
        return
    t.response += added
    t.mask += [0] * len(added)
    t.log_probs += [0.0] * len(added)
    t.rewards += [0.0] * len(added)


def _last_model_token(mask: list[int]) -> int:
    return max(i for i, m in enumerate(mask) if m)


def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        try:
            _call(close)
        except Exception as exc:  # closing is best effort
            logger.warning("closing environment %s failed: %s", type(env).__name__, exc)


def _to_batch(trajectories: list[_Trajectory], n: int, pad_id: int, budget: int) -> Batch:
    prompt_ids, prompt_mask = left_pad([t.prompt_ids for t in trajectories], pad_id)
    width = max(1, max((len(t.response) for t in trajectories), default=1))
    response_ids = right_pad([t.response for t in trajectories], pad_id, torch.long, width)
    attention = right_pad([[1] * len(t.response) for t in trajectories], 0, torch.long, width)
    meta_keys = ("ground_truth", "data_source", "extra_info", "prompt_text")
    rows = [t.row for t in trajectories]
    vision = [PromptIds.inputs_of(t.prompt_ids) for t in trajectories]
    return Batch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_attention_mask=attention,
        response_mask=right_pad([t.mask for t in trajectories], 0, torch.long, width),
        group_ids=torch.arange(len(trajectories) // max(1, n)).repeat_interleave(n),
        rollout_log_probs=right_pad([t.log_probs for t in trajectories], 0.0, torch.float32, width),
        finish_reasons=[t.finish for t in trajectories],
        meta={**{k: [r.get(k) for r in rows] for k in meta_keys},
              "prompt_messages": [r.get("prompt_messages") for r in rows],
              "transcript": [t.messages for t in trajectories], "weight_version": [None] * len(rows),
              **({"multi_modal_data": [getattr(t.prompt_ids, "multi_modal_data", {}) for t in trajectories]}
                 if any(vision) else {})},
        extras={ENV_REWARDS: right_pad([t.rewards for t in trajectories], 0.0, torch.float32, width)},
        # The trajectory's response budget: the constant a Dr. GRPO loss divides by, whatever the batch's width.
        info={"pad_token_id": pad_id, "max_new_tokens": budget},
        multi_modal_inputs=vision if any(vision) else [],
    )
