"""The built-in calculator tool: arithmetic on numbers, evaluated by `simpleeval` (no ``eval``, no names)."""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

from simpleeval import SimpleEval

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
"""+ - * / and signs: no powers (``9**9**9`` would hang the tool), no comparisons, no names, no calls."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, exactly.

    Args:
        expression: the expression, for example "(123 * 45) - 678 / 2"
    """
    evaluator = SimpleEval(operators=_OPERATORS, functions={}, names={})
    # every number literal becomes an exact fraction, so 0.1 + 0.2 is 0.3 and 7 / 2 is 3.5
    evaluator.nodes[ast.Constant] = _exact
    value = evaluator.eval(expression.replace("×", "*").replace("÷", "/"))
    if not isinstance(value, Fraction):
        raise ValueError(f"not a number: {value!r}")
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def _exact(node: ast.Constant) -> Fraction:
    """A number literal as an exact fraction (``0.1`` is 1/10); any other constant is refused."""
    if isinstance(node.value, bool) or not isinstance(node.value, int | float):
        raise ValueError(f"only numbers are allowed, not {node.value!r}")
    return Fraction(str(node.value))
