"""A calculator tool: arithmetic on int and float numbers, evaluated from the syntax tree (no eval).

Allowed: numbers, + - * / // % **, unary + and -, parentheses. Anything else (names, calls, attributes,
strings, comparisons...) is an error outcome, as are division by zero, overflow, a complex result and results
too large to print. Sizes are bounded before computing, so no expression takes more than milliseconds.

The result's text: an int as an int ("8"); a float with an integral value below 1e16 as an int ("7.0" -> "7"),
any other float as Python's repr, the shortest text that reads back to the same float ("0.6666666666666666",
"1e+16"); nan or inf is an error.
"""
from __future__ import annotations

import ast
import math
import operator

from rl_megatron.tools.base import Tool, ToolOutcome

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 10_000  # |b| of a ** b with an int b, whatever a is
MAX_DIGITS = 4000  # of an int result: below the 4300 digits Python prints at most (sys.get_int_max_str_digits)
_MAX_BITS = int(MAX_DIGITS * math.log2(10))

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculationError(ValueError):
    """What the model is told about an expression it cannot have computed."""


class CalculatorTool(Tool):
    async def execute(self, arguments: dict, state: dict) -> ToolOutcome:
        try:
            return ToolOutcome(text=format_number(evaluate(arguments["expression"])))
        except CalculationError as err:
            return ToolOutcome.failure(f"Error: {err}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculationError says why there is none."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"the expression is {len(expression)} characters long; the limit is "
                               f"{MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as err:
        raise CalculationError(f"not a valid expression ({getattr(err, 'msg', err)})") from None
    try:
        return _value(tree.body)
    except ZeroDivisionError:
        raise CalculationError("division by zero") from None
    except OverflowError:
        raise CalculationError("the result is too large") from None
    except RecursionError:
        raise CalculationError("the expression is nested too deeply") from None


def format_number(value: int | float) -> str:
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise CalculationError("the result is too large" if math.isinf(value) else "the result is not a number")
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        # bool is an int subclass, and True + True is no arithmetic a model should rely on
        if type(node.value) not in (int, float):
            raise CalculationError(f"{node.value!r} is not a number")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):  # (-8) ** (1/3)
            raise CalculationError("the result is a complex number")
        if isinstance(result, int) and result.bit_length() > _MAX_BITS:
            raise CalculationError(f"the result has more than {MAX_DIGITS} digits")
        return result
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculationError("^ is not supported; write ** for a power")
    text = ast.unparse(node)
    text = text if len(text) <= 40 else text[:37] + "..."
    raise CalculationError(f"{text!r} is not arithmetic: only numbers, + - * / // % ** and parentheses are allowed")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would be too large, before computing it (a float power overflows by itself)."""
    if not isinstance(exponent, int):
        return
    if abs(exponent) > MAX_EXPONENT:
        raise CalculationError(f"the exponent {exponent} is larger than {MAX_EXPONENT} in absolute value")
    if isinstance(base, int) and abs(base) > 1 and exponent * math.log10(abs(base)) > MAX_DIGITS:
        raise CalculationError(f"the result would have more than {MAX_DIGITS} digits")
