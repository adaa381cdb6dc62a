"""Label audits: an independent, exact check that a prompt row's label is the answer to the question it prints.

A generator can print one question and label another: reasoning-gym 0.1.25's ``basic_arithmetic`` with
``allow_parentheses: false`` (``_generate_simple_task``) picks a new divisor for a ``/`` (or falls back to ``*``)
when it computes the label, but prints the original operand and operator, so "Calculate 4 / 1." is labelled 2.
An audit recomputes the label from the prompt text alone, never from the generator's code or metadata.

An audit is a function ``(row) -> problem | None`` (the row in verl's layout, see `hybridflow.engine.data`) registered
for a ``data_source`` in `AUDITS`; `audit_rows` runs the registered ones over a list of rows. Built in: exact
arithmetic (`arithmetic_audit`) for ``reasoning_gym/basic_arithmetic``, ``reasoning_gym/chain_sum``,
``reasoning_gym/products`` and
``arithmetic`` (the data_source to give your own arithmetic rows so that ``hf data check`` audits them), and letter
counts (`letter_counting_audit`) for ``reasoning_gym/letter_counting``.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from simpleeval import InvalidExpression, SimpleEval

Audit = Callable[[dict[str, Any]], "str | None"]

# A run of arithmetic characters holding at least one digit: "Calculate 4 / 1." -> " 4 / 1."
_EXPRESSION_RE = re.compile(r"[-+*/()\d\s.]*\d[-+*/()\d\s.]*")
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
"""+ - * / and signs: no powers (``9**9**9`` would not finish), no comparisons, no names, no calls."""


def exact_value(expression: str) -> Fraction:
    """The exact value of an arithmetic expression of numbers, ``+ - * /``, unary signs and parentheses.

    Evaluated by `simpleeval` (no ``eval``) with Python's precedence, every number literal an exact
    `fractions.Fraction` (no floats, no floor division): ``"7 / 2"`` is 7/2, ``"0.1 + 0.2"`` is 3/10. The calculator
    tool of agent rollouts (`hybridflow.engine.agent.calculator`) computes with it too.

    Raises:
        ZeroDivisionError: the expression divides by zero (named).
        ValueError: the text is not such an expression (e.g. it holds a name, ``**`` or ``//``).
    """
    evaluator = SimpleEval(operators=_OPERATORS, functions={}, names={})
    evaluator.nodes[ast.Constant] = _exact_number
    try:
        value = evaluator.eval(expression.strip())
    except ZeroDivisionError:
        raise ZeroDivisionError(f"division by zero in {expression.strip()!r}") from None
    except (SyntaxError, InvalidExpression, ValueError, TypeError) as e:
        raise ValueError(f"not an arithmetic expression: {expression!r} ({e})") from None
    if not isinstance(value, Fraction):
        raise ValueError(f"not an arithmetic expression: {expression!r} (its value is {value!r})")
    return value


def _exact_number(node: ast.Constant) -> Fraction:
    """A number literal as an exact fraction (``0.1`` is 1/10); any other constant is refused."""
    if isinstance(node.value, bool) or not isinstance(node.value, int | float):
        raise ValueError(f"{node.value!r} is not a number")
    return Fraction(str(node.value))


def question_expression(text: str) -> str:
    """The arithmetic expression a question prints: the longest run of digits, operators, parentheses and spaces in
    its first line, less a closing full stop (``"Calculate 4 / 1.\\nGive only the final answer."`` -> ``"4 / 1"``).

    Raises:
        ValueError: the first line holds no digit.
    """
    line = text.strip().splitlines()[0] if text.strip() else ""
    runs = _EXPRESSION_RE.findall(line)
    if not runs:
        raise ValueError(f"no arithmetic expression in the question {line!r}")
    return max(runs, key=lambda run: len(run.strip())).strip().rstrip(".").strip()


def parse_label(label: Any) -> Fraction:
    """A label as an exact number: an integer, a decimal or ``p/q`` (``"72"``, ``"-3"``, ``"0.5"``, ``"7/2"``).

    Raises:
        ValueError: the label is missing or not a number.
    """
    if label is None:
        raise ValueError("no label (reward_model.ground_truth is None)")
    text = str(label).strip().replace(",", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"label {text!r} is not a number") from None


def arithmetic_audit(row: dict[str, Any]) -> str | None:
    """Check that ``reward_model.ground_truth`` is the exact value of the expression in the row's last user message.

    Returns:
        None when it is; else the problem in words (the question, the label and the exact value, or why there is
        none: division by zero, no expression, a label that is not a number).
    """
    question = row["prompt"][-1]["content"]
    label = row["reward_model"].get("ground_truth")
    try:
        expression = question_expression(question)
        truth = exact_value(expression)
        given = parse_label(label)
    except (ValueError, ZeroDivisionError) as e:
        return f"{e}; label {label!r}"
    if given != truth:
        return f"{expression!r} = {truth}, labelled {label!r}"
    return None


_LETTER_QUESTION_RE = re.compile(r'the letter "(.)" appear in the text: "(.*)"', re.DOTALL)


def letter_counting_audit(row: dict[str, Any]) -> str | None:
    """Check that ``reward_model.ground_truth`` is how often the question's letter appears in the question's quoted
    text, ignoring case (reasoning-gym ``letter_counting``: 'How many times does the letter "h" appear in the text:
    "..."?').

    Returns:
        None when it is; else the problem in words (the letter, the count and the label, or that the question has
        no letter and text).
    """
    question = row["prompt"][-1]["content"]
    label = row["reward_model"].get("ground_truth")
    found = _LETTER_QUESTION_RE.search(question)
    if found is None:
        return f"no letter and quoted text in {question[:80]!r}; label {label!r}"
    letter, text = found.groups()
    count = text.lower().count(letter.lower())
    if str(label).strip() != str(count):
        return f"{letter!r} appears {count} times in {text[:60]!r}, labelled {label!r}"
    return None


AUDITS: dict[str, Audit] = {
    "reasoning_gym/basic_arithmetic": arithmetic_audit,
    "reasoning_gym/chain_sum": arithmetic_audit,
    "reasoning_gym/products": arithmetic_audit,
    "arithmetic": arithmetic_audit,
    "reasoning_gym/letter_counting": letter_counting_audit,
}


@dataclass
class AuditResult:
    """What `audit_rows` found.

    Attributes:
        audited: rows whose data_source has an audit.
        unaudited: data_sources with no audit, and their row counts.
        failures: ``(row position, data_source, question's first line, problem)`` per failing row, in row order.
    """

    audited: int
    unaudited: dict[str, int]
    failures: list[tuple[int, str, str, str]]


def audit_rows(rows: Sequence[dict[str, Any]], audits: dict[str, Audit] | None = None) -> AuditResult:
    """Run each row's registered audit (`AUDITS` by default).

    Args:
        rows: prompt rows in verl's layout (``data_source``, ``prompt``, ``reward_model.ground_truth``).
        audits: data_source -> audit; rows of other sources are counted in ``unaudited``.
    """
    audits = AUDITS if audits is None else audits
    audited, unaudited, failures = 0, {}, []
    for i, row in enumerate(rows):
        audit = audits.get(row["data_source"])
        if audit is None:
            unaudited[row["data_source"]] = unaudited.get(row["data_source"], 0) + 1
            continue
        audited += 1
        problem = audit(row)
        if problem is not None:
            question = row["prompt"][-1]["content"].strip().splitlines()[0]
            failures.append((i, row["data_source"], question, problem))
    return AuditResult(audited, unaudited, failures)
