"""GSM8K: the final number of the response against the dataset's answer (verl's `openai/gsm8k` scorer).

strict: the last `#### <number>`, the format GSM8K's reference solutions use; flexible: the last number anywhere
in the response. How an answer is read and compared is `match` (reward.gsm8k_match):

- "exact" (the default) gives verl's scores, so that reward curves compare with verl runs: only the last 300
  characters of the response are read (verl's shortcut for long responses); strict needs `#### ` with exactly
  one space before the number and drops its commas; flexible takes the last run of digits, dots and commas
  that is not a lone ".", commas kept; the answer then scores only if it is ground_truth's text exactly, so
  `#### 72.00`, `#### 72.` and `####72` do not score against "72".
- "numeric" reads the whole response, also accepts `####72` and `#### $72`, drops commas, `$` and a full stop
  after the number in both methods, and scores answers equal as numbers ("72.00" = "72", "1,000" = "1000").
"""
import re

from rl_megatron.config.choices import MATCH_MODES
from rl_megatron.rewards import register
from rl_megatron.rewards.numbers import as_text, parse_decimal

METHODS = ("strict", "flexible")
CLIP_CHARS = 300  # exact: verl reads only the response's last 300 characters
# The patterns are free of nested optional runs, so a huge response costs linear time.
VERL_STRICT_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
LENIENT_STRICT_ANSWER = re.compile(r"####\s*(?:\$\s*)?(-?[0-9.,]+)")  # numeric
NUMBER_LIKE = re.compile(r"-?[0-9.,]+")  # flexible, both modes: runs of digits, dots and commas


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"gsm8k method={method!r} is unknown: use one of {', '.join(METHODS)}")


def extract_answer(solution_str, method: str = "strict") -> str | None:
    """The final answer as verl reads it (match="exact"), or None when the response has none."""
    _check_method(method)
    if not isinstance(solution_str, str):
        return None
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        answers = VERL_STRICT_ANSWER.findall(tail)
        return answers[-1].replace(",", "") if answers else None
    runs = NUMBER_LIKE.findall(tail)
    # verl passes over lone "."s (full stops); when every run is one, its answer is "." (a wrong answer, not none).
    return next((run for run in reversed(runs) if run != "."), "." if runs else None)


def extract_number(solution_str, method: str = "strict") -> str | None:
    """The final answer as a clean number string (match="numeric"), or None when the response has none."""
    _check_method(method)
    if not isinstance(solution_str, str):
        return None
    pattern = LENIENT_STRICT_ANSWER if method == "strict" else NUMBER_LIKE
    numbers = [_clean(found) for found in pattern.findall(solution_str)]
    numbers = [number for number in numbers if any(c.isdigit() for c in number)]  # "..." is no number
    return numbers[-1] if numbers else None


def _clean(number: str) -> str:
    # A sentence's full stop or a list's comma after the number is not part of it.
    return number.replace(",", "").replace("$", "").strip().rstrip(".")


def numbers_match(answer: str, expected: str) -> bool:
    if answer == expected:
        return True
    answer_value, expected_value = parse_decimal(answer), parse_decimal(expected)
    return answer_value is not None and answer_value == expected_value


@register("openai/gsm8k", "gsm8k", from_config={"match": "gsm8k_match"})
def compute_score(solution_str, ground_truth, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0, match: str = "exact") -> float:
    """`score` when the extracted answer equals ground_truth, `format_score` for a wrong one, 0 without one.

    A ground truth that is a number or bytes (verl's parquet files hold text) is compared as its text."""
    if match not in MATCH_MODES:
        raise ValueError(f"gsm8k match={match!r} is unknown: use one of {', '.join(MATCH_MODES)}")
    answer = (extract_answer if match == "exact" else extract_number)(solution_str, method)
    if answer is None:
        return 0.0
    expected = as_text(ground_truth)
    if expected is None:
        return 0.0
    if match == "exact":
        return score if answer == expected else format_score
    return score if numbers_match(answer, _clean(expected)) else format_score
