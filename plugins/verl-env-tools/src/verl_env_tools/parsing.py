"""Tool calls in a model's turn: the Hermes/Qwen format, and a hook for others.

A parser takes the turn's text and returns the :class:`ToolCall` s it makes (empty: a final answer)
or raises :class:`ToolCallError` for a call it cannot read. ``environment.parser`` names one:
``"hermes"`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what Qwen2.5 and
Hermes models emit) or ``"package.module:function"`` for another format.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ToolCall", "ToolCallError", "parse_hermes", "load_parser"]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


class ToolCallError(ValueError):
    """A tool call that cannot be read (bad JSON, no name, arguments not an object)."""


def parse_hermes(text: str) -> list[ToolCall]:
    calls = []
    if "<tool_call>" in text and not _HERMES.search(text):
        raise ToolCallError("a <tool_call> without its closing </tool_call>")
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"the tool call is not JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallError('a tool call needs {"name": ..., "arguments": {...}}')
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):  # some models send the arguments JSON-encoded
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ToolCallError("the tool call's arguments are not a JSON object") from None
        if not isinstance(arguments, dict):
            raise ToolCallError("the tool call's arguments are not a JSON object")
        calls.append(ToolCall(obj["name"], arguments))
    return calls


def load_parser(name: str) -> Callable[[str], list[ToolCall]]:
    """``"hermes"``, or a ``module:function`` import path."""
    if name == "hermes":
        return parse_hermes
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"parser: {name!r} is neither 'hermes' nor 'package.module:function'")
    return getattr(importlib.import_module(module), attr)
