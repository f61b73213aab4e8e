"""MATH (Hendrycks et al.): the last `\\boxed{...}` of the response against the dataset's answer.

By default (reward.math_match=exact) each data source scores as verl's `default_compute_score` scores it, so
that reward curves compare with verl runs:

- `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`: verl's `math_reward`, the
  MATH benchmark's own normaliser. Both sides are normalised (`\\dfrac` and `\\tfrac`, `\\left`/`\\right`,
  degrees, `\\$`, `\\%`, one `\\text{ unit}`, `x = ...`, `\\sqrt3`, `\\frac12`, `a/b`, `0.5`, spaces) and then
  must be equal as text: 1.0, else 0.0.
- `math`: verl's DAPO scorer (math_dapo.py): the last `Answer: ...` line, score 1.0 or -1.0 with acc 1.0 or 0.0.

reward.math_match=numeric scores all four with the lenient equivalence of math_numeric.py, which also finds
`\\fbox{}` and compares numbers by value (`\\boxed{0.50}` = `\\frac{1}{2}`).
"""
from rl_megatron.config.choices import MATCH_MODES
from rl_megatron.rewards import math_dapo, math_numeric, register
from rl_megatron.rewards.math_numeric import braced_group
from rl_megatron.rewards.numbers import as_text


class NotNormalizable(ValueError):
    """An answer the MATH normaliser fails on; verl then compares the two answers as they are written."""


def last_boxed_answer(text) -> str | None:
    """The answer verl's MATH scorer reads: the argument of the last `\\boxed{...}` (braces balanced), or None.

    As in verl: a `\\boxed ` followed by a space anywhere wins over every braced one, its answer running from
    the last such `\\boxed ` to the next `$` (or the end); `\\fbox` and a `\\boxed` not followed by `{` are no
    answer."""
    if not isinstance(text, str):
        return None
    if "\\boxed " in text:
        return text.rsplit("\\boxed ", 1)[1].split("$", 1)[0]
    start = text.rfind("\\boxed")
    if start < 0 or not text.startswith("\\boxed{", start):
        return None
    return braced_group(text[start + len("\\boxed"):])[0]


def _drop_trailing_unit(text: str) -> str:
    """"5 \\text{ cm}" -> "5 ": the dataset writes units (only them) as `\\text{ ...}` with a space."""
    if "\\text{ " not in text:
        return text
    before, *units = text.split("\\text{ ")
    if len(units) > 1:
        raise NotNormalizable("more than one \\text{ ")
    return before


def _brace_sqrt_arguments(text: str) -> str:
    """\\sqrt3 -> \\sqrt{3}: an unbraced \\sqrt takes the next character, even a space ("\\sqrt 3" ends up as
    "\\sqrt{}3" once spaces go, as in verl)."""
    first, *pieces = text.split("\\sqrt")
    rebuilt = [first]
    for piece in pieces:
        if not piece:
            raise NotNormalizable("\\sqrt without an argument")
        rebuilt.append("\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:]))
    return "".join(rebuilt)


def _brace_frac_arguments(text: str) -> str:
    """\\frac12 -> \\frac{1}{2} and \\frac1{2} -> \\frac{1}{2}; a \\frac whose first argument is braced is kept
    as written (so \\frac{1}2 stays), and a \\frac with one character after it leaves the whole text unchanged."""
    first, *pieces = text.split("\\frac")
    rebuilt = [first]
    for piece in pieces:
        if not piece:
            raise NotNormalizable("\\frac without arguments")
        if piece[0] == "{":
            rebuilt.append("\\frac" + piece)
        elif len(piece) < 2:
            return text
        elif piece[1] == "{":
            rebuilt.append("\\frac{" + piece[0] + "}" + piece[1:])
        else:
            rebuilt.append("\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:])
    return "".join(rebuilt)


def _integer_ratio_as_frac(text: str) -> str:
    """"3/4" -> "\\frac{3}{4}" when both sides are integers written plainly ("-1/2" too, not "01/2" or "1.5/2")."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return f"\\frac{{{numerator}}}{{{denominator}}}"


def normalize(answer: str) -> str:
    """The MATH benchmark's canonical text form of an answer; raises NotNormalizable where verl's does."""
    text = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    # Plain text replacements, as in verl: "\leftarrow" becomes "arrow".
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    text = _drop_trailing_unit(text)
    text = text.replace("\\\\%", "").replace("\\%", "")  # a bare "%" stays: "50%" is not "50"
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5" -> " 5"; " x = 5" keeps its three-character left side
        text = sides[1]
    text = _brace_sqrt_arguments(text).replace(" ", "")
    text = _brace_frac_arguments(text)
    if text == "0.5":  # the one decimal the normaliser turns into a fraction
        text = "\\frac{1}{2}"
    return _integer_ratio_as_frac(text)


def is_equivalent(answer: str, expected: str) -> bool:
    """Equal after `normalize`; equal as written when either side cannot be normalised."""
    try:
        return normalize(answer) == normalize(expected)
    except NotNormalizable:
        return answer == expected


def _check_match(match: str) -> None:
    if match not in MATCH_MODES:
        raise ValueError(f"math match={match!r} is unknown: use one of {', '.join(MATCH_MODES)}")


@register("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
          from_config={"match": "math_match"})
def compute_score(solution_str, ground_truth, format_score: float = 0.0, score: float = 1.0,
                  match: str = "exact") -> float:
    """`score` when the last boxed answer is equivalent to ground_truth, `format_score` for a wrong boxed answer,
    0 without one. A ground truth that is a number or bytes is compared as its text."""
    _check_match(match)
    if match == "numeric":
        return math_numeric.compute_score(solution_str, ground_truth, format_score, score)
    answer, expected = last_boxed_answer(solution_str), as_text(ground_truth)
    if answer is None or expected is None:
        return 0.0
    return score if is_equivalent(answer, expected) else format_score


@register("math", from_config={"match": "math_match"})
def compute_score_math_source(solution_str, ground_truth, match: str = "exact") -> float | math_dapo.DapoScore:
    """data_source "math": verl's DAPO scorer (score 1.0 / -1.0, acc 1.0 / 0.0), or with match="numeric" the lenient
    boxed answer (1.0 / 0.0)."""
    _check_match(match)
    if match == "numeric":
        return math_numeric.compute_score(solution_str, ground_truth)
    return math_dapo.compute_score(solution_str, ground_truth)
