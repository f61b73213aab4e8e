"""DAPO's math scorer (verl's `math_dapo`, Minerva's answer normaliser): the last `Answer: ...` line against the
answer, scoring 1.0 when they are equal after normalisation and -1.0 otherwise (a missing answer included). Like
verl's, the scorer returns {"score", "acc", "pred"}: the accuracy on 0-1 beside the ±1 score, so that reward/acc and
validation accuracy read as the share solved (the mean score is 2p - 1).

verl scores the data sources `math_dapo`, `math_dapo_reasoning` and `math` this way; `math` is registered in
math.py, where reward.math_match=numeric can switch it to the lenient boxed-answer scorer. Only the last 300
characters of the response are read, as verl does (the longest MATH-500 answer has 159).
"""
import re
from typing import TypedDict

from rl_megatron.rewards import register
from rl_megatron.rewards.numbers import as_text

CLIP_CHARS = 300
ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
NO_ANSWER = "[INVALID]"  # what verl normalises and compares in place of a missing answer line

# Minerva's normalisation, step by step and in this order: replacements, then removed words, units and marks.
REPLACEMENTS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
           "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
           "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
           "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
           ",\\!", "{,}", '"', "\\dots")
# (pattern, replacement), applied in order after the removals.
REWRITES = tuple((re.compile(pattern), replacement) for pattern, replacement in (
    (r"(.*?)\$(.*?)\$(.*)", r"$\2$"),  # text around the first $...$ goes
    (r"\\text\{(.*?)\}", r"\1"),
    (r"\\textbf\{(.*?)\}", r"\1"),
    (r"\\overline\{(.*?)\}", r"\1"),
    (r"\\boxed\{(.*)\}", r"\1"),
    (r"frac([^{])(.)", r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (r"sqrt([^{])", r"sqrt{\1}"),  # \sqrt2 -> \sqrt{2}
))


def normalize(answer: str) -> str:
    """Minerva's canonical form of a final answer: the right side of its last "=", without units, words,
    spacing and `$`; thousands separators go from whole numbers."""
    answer = answer.split("=")[-1]
    for old, new in REPLACEMENTS:
        answer = answer.replace(old, new)
    for removed in REMOVED:
        answer = answer.replace(removed, "")
    for pattern, replacement in REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


class DapoScore(TypedDict):
    """verl's DAPO result: `score` 1.0 or -1.0 (what is trained on), `acc` 1.0 or 0.0, `pred` the normalised answer."""
    score: float
    acc: float
    pred: str


@register("math_dapo", "math_dapo_reasoning")
def compute_score(solution_str, ground_truth) -> DapoScore:
    """Score 1.0 and acc 1.0 when the response's last `Answer: ...` line equals ground_truth after `normalize`, else
    score -1.0 and acc 0.0.

    A ground truth that is a number or bytes is compared as its text; a response or ground truth that is no text
    at all scores -1.0 (verl raises)."""
    expected = as_text(ground_truth)
    answers = ANSWER_LINE.findall(solution_str[-CLIP_CHARS:]) if isinstance(solution_str, str) else []
    pred = normalize(answers[-1] if answers else NO_ANSWER)
    correct = expected is not None and isinstance(solution_str, str) and pred == normalize(expected)
    return DapoScore(score=1.0 if correct else -1.0, acc=1.0 if correct else 0.0, pred=pred)
