"""The tools: a calculator and a sandboxed Python interpreter, with OpenAI-style schemas."""

from __future__ import annotations

import ast
import operator
from typing import Any, Callable

from verl_env_tools.sandbox import SandboxLimits, run_python

__all__ = ["Tool", "calculator", "python_tool", "TOOLS"]

_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


class ToolError(ValueError):
    """The tool could not do what it was asked; the message goes back to the model."""


class Tool:
    def __init__(self, name: str, description: str, parameters: dict[str, Any],
                 fn: Callable[[dict[str, Any], Any], str]) -> None:
        self.name, self.description, self.parameters, self.fn = name, description, parameters, fn

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def __call__(self, arguments: dict[str, Any], config: Any) -> str:
        return self.fn(arguments, config)


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ToolError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ToolError("only numbers and + - * / // % ** ( ) are allowed")


def _calculate(arguments: dict[str, Any], config: Any) -> str:
    expression = arguments.get("expression")
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("calculator needs a non-empty 'expression' string")
    if len(expression) > 200:
        raise ToolError("expression longer than 200 characters")
    try:
        value = _evaluate(ast.parse(expression, mode="eval"))
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r}") from None
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _python(arguments: dict[str, Any], config: Any) -> str:
    code = arguments.get("code")
    if not isinstance(code, str):
        raise ToolError("python needs a 'code' string")
    limits = SandboxLimits(cpu_s=config.cpu_s, wall_s=config.wall_s, memory_mb=config.memory_mb,
                           max_output=config.max_output, allow_network=config.allow_network)
    result = run_python(code, limits)
    if not result.ok:
        raise ToolError(f"{result.error}\n{result.output}".strip())
    return result.output


calculator = Tool("calculator", "Evaluate an arithmetic expression exactly.",
                  {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                  _calculate)
python_tool = Tool("python", "Run Python code in a sandbox (no network, limited CPU, memory and time); "
                   "returns what it prints.",
                   {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, _python)
TOOLS = {t.name: t for t in (calculator, python_tool)}
