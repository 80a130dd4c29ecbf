"""The tools the environment server runs, as plain functions (also usable in-process).

``calculate`` is :func:`safe_calculate`: integer arithmetic with ``+ - * // %``, parentheses
and unary minus, nothing else (no names, no calls, no power), the calculator of the built-in
``calculator`` workflow (docs/agents.md). :data:`TOOLS` maps an endpoint's tool name to its
function; the server runs each call in a thread.
"""

from __future__ import annotations

import ast
import operator
from typing import Callable

__all__ = ["safe_calculate", "TOOLS", "MAX_EXPRESSION_CHARS"]

#: The longest expression :func:`safe_calculate` accepts.
MAX_EXPRESSION_CHARS = 200

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def safe_calculate(expression: str) -> int:
    """Evaluate integer arithmetic (``+ - * // %``, parentheses, unary minus), nothing else.

    Args:
        expression: at most :data:`MAX_EXPRESSION_CHARS` (200) characters; ``×`` reads as ``*``.

    Returns:
        the exact integer value.

    Raises:
        ValueError: anything but integer literals and those operators, a result or operand
            beyond 10**30, division by zero, or a longer expression.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("×", "*"), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression.strip()!r}") from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            v = node.value
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
                raise ValueError("division by zero")
            v = _OPS[type(node.op)](a, b)
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            v = _OPS[type(node.op)](ev(node.operand))
        else:
            raise ValueError(f"only integers and + - * // % are allowed, got {type(node).__name__}")
        if abs(v) > 10**30:
            raise ValueError("number too large")
        return v

    return ev(tree)


#: tool name (the endpoint ``POST /tools/<name>``) -> the function run for one call
TOOLS: dict[str, Callable[..., object]] = {"calculate": safe_calculate}
