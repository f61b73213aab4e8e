"""MATH with reward.math_match=numeric: the lenient equivalence of the last `\\boxed{...}` and the answer.

More lenient than verl's scorer (math.py, the default): `\\fbox{}` counts, a reference solution with its own
`\\boxed{}` may serve as ground truth, both sides are normalised more thoroughly (every `\\text{...}` unit, bare
`%` and `$`, `\\frac{1}2`, `5.0` = `5`, `x_1 = ...`), and answers that both read as numbers (`0.5`, `\\frac12`,
`1/2`, `1,000`) are compared by exact value.
"""
import re
from fractions import Fraction

from rl_megatron.rewards.numbers import as_text, parse_decimal

BOX_COMMANDS = ("\\boxed", "\\fbox")
# Text removed outright: line breaks, LaTeX spacing commands, degree marks, dollar and percent signs.
_REMOVED = ("\n", "\\!", "\\,", "\\;", "\\:", "^{\\circ}", "^\\circ", "°", "\\$", "$", "\\%", "%")
_LEFT_RIGHT = re.compile(r"\\(left|right)(?![a-zA-Z])")  # \left( but not \leftarrow
_TRAILING_UNITS = re.compile(r"(?<=\S)\s*\\(text|mbox)\{[^{}]*\}\s*$")  # "5 \text{ cm}": the unit goes
_TEXT_WRAPPER = re.compile(r"\\(text|mbox|textbf)\{([^{}]*)\}")  # "\text{Monday}" reads as "Monday"
_VARIABLE_LHS = re.compile(r"\s*[a-zA-Z](_\{?\w+\}?|\w)?\s*")  # "x", "y1", "a_n", "x_{0}" before an "="
_SQRT_SHORT = re.compile(r"\\sqrt\s*(\w)")  # \sqrt3 -> \sqrt{3}
_INTEGER_RATIO = re.compile(r"(-?\d+)/(\d+)")
_TRAILING_ZEROS = re.compile(r"(?<![\d.])(\d+)\.(\d*?)0+(?!\d)")  # 5.0 -> 5, 2.50 -> 2.5
_FRACTION = re.compile(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}")


def last_boxed_answer(text) -> str | None:
    """The argument of the last \\boxed{...} / \\fbox{...} (braces balanced), or of `\\boxed 5`; None if absent."""
    if not isinstance(text, str):
        return None
    start = max(text.rfind(command) for command in BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in BOX_COMMANDS if text.startswith(c, start))
    argument = text[start + len(command):]
    if argument.startswith("{"):
        return braced_group(argument)[0]
    if argument[:1] in (" ", "\t"):  # "\boxed 5": the argument runs to the closing $ or the end of the line
        return re.split(r"[$\n]", argument.strip(" \t"), maxsplit=1)[0].strip() or None
    return None


def braced_group(text: str) -> tuple[str | None, str]:
    """(inside, rest) of the balanced {...} group that opens `text`; (None, text) when it does not close."""
    depth = 0
    for i, char in enumerate(text):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[1:i], text[i + 1:]
    return None, text


def _brace_fraction_arguments(text: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} and \\frac{1}2 likewise: each argument becomes a braced group."""
    pieces = text.split("\\frac")
    rebuilt = [pieces[0]]
    for piece in pieces[1:]:
        arguments = []
        for _ in range(2):
            if piece.startswith("{"):
                inside, rest = braced_group(piece)
                if inside is None:
                    break
                arguments.append(inside)
                piece = rest
            elif piece and piece[0] != "\\":
                arguments.append(piece[0])
                piece = piece[1:]
            else:
                break
        braced = "".join("{" + a + "}" for a in arguments)
        rebuilt.append("\\frac" + braced + piece)
    return "".join(rebuilt)


def normalize_answer(answer: str) -> str:
    """The canonical text form of an answer, so that equal answers written differently compare equal."""
    text = answer.strip().replace("\\\\", "\\").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for removed in _REMOVED:
        text = text.replace(removed, "")
    text = _LEFT_RIGHT.sub("", text)
    text = _TRAILING_UNITS.sub("", text)
    text = _TEXT_WRAPPER.sub(r"\2", text)
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    lhs, equals, rhs = text.partition("=")
    if equals and "=" not in rhs and _VARIABLE_LHS.fullmatch(lhs):  # "x = 5" -> "5"
        text = rhs
    text = _SQRT_SHORT.sub(r"\\sqrt{\1}", text).replace(" ", "")
    text = _brace_fraction_arguments(text)
    ratio = _INTEGER_RATIO.fullmatch(text)
    if ratio:
        sign = "-" if ratio[1].startswith("-") else ""
        text = f"{sign}\\frac{{{ratio[1].lstrip('-')}}}{{{ratio[2]}}}"
    return _TRAILING_ZEROS.sub(lambda m: m[1] + ("." + m[2] if m[2] else ""), text)


def as_number(normalized: str) -> Fraction | None:
    """The exact value of a normalised answer that is a plain number or a fraction of two, else None."""
    value = parse_decimal(normalized)
    if value is not None:
        return value
    fraction = _FRACTION.fullmatch(normalized)
    if fraction:
        numerator, denominator = parse_decimal(fraction[2]), parse_decimal(fraction[3])
        if numerator is not None and denominator:
            return (-1 if fraction[1] else 1) * numerator / denominator
    return None


def is_equivalent(answer: str, expected: str) -> bool:
    answer, expected = normalize_answer(answer), normalize_answer(expected)
    if answer == expected:
        return True
    answer_value, expected_value = as_number(answer), as_number(expected)
    return answer_value is not None and answer_value == expected_value


def compute_score(solution_str, ground_truth, format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` when the last boxed answer is equivalent to ground_truth (the bare answer, or a reference
    solution with its own \\boxed{}), `format_score` for a wrong boxed answer, 0 without one."""
    answer = last_boxed_answer(solution_str)
    expected = as_text(ground_truth)
    if expected is not None and any(command in expected for command in BOX_COMMANDS):
        expected = last_boxed_answer(expected)
    if not answer or not expected or not expected.strip():
        return 0.0
    return score if is_equivalent(answer, expected) else format_score
