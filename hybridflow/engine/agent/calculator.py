"""The built-in calculator tool: exact arithmetic on numbers (`hybridflow.engine.audit.exact_value`, evaluated by
`simpleeval`: no ``eval``, no names, no powers)."""

from __future__ import annotations

from hybridflow.engine.audit import exact_value


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, exactly.

    Args:
        expression: the expression, for example "(123 * 45) - 678 / 2"
    """
    value = exact_value(expression.replace("×", "*").replace("÷", "/"))
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.10g}"
