"""DAPO's math scorer, as verl 0.9.1's `math_dapo` scores: the last `Answer: ...` line against the answer, equal
after Minerva's normalisation; a response without an Answer line falls back to its last `\\boxed{...}` (in its last
100 characters), which must equal the answer exactly, as written. Score 1.0 when right, -1.0 otherwise (no answer
included). Like verl's, the scorer returns {"score", "acc", "pred"}: the accuracy on 0-1 beside the ±1 score, so that
reward/acc and validation accuracy read as the share solved (the mean score is 2p - 1).

verl 0.9.0 and earlier read the Answer line only: `compute_score(..., boxed_fallback=False)` scores as they did
(docs/tasks-and-rewards.md says how to register it). tests/unit/test_reward_verl_parity.py holds both to verl's code.

verl scores the data sources `math_dapo`, `math_dapo_reasoning` and `math` this way; `math` is registered in
math.py, where reward.math_match=numeric can switch it to the lenient boxed-answer scorer. Only the last 300
characters of the response are read, as verl does (the longest MATH-500 answer has 159).
"""
import re
from typing import TypedDict

from rl_megatron.rewards import register
from rl_megatron.rewards.math_numeric import braced_group
from rl_megatron.rewards.numbers import as_text

CLIP_CHARS = 300
BOX_CHARS = 100  # the boxed fallback reads the last 100 of those 300 characters, as verl's is_correct_strict_box
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


def last_boxed(text: str) -> str | None:
    """The argument of the last `\\boxed{` with its braces balanced (verl's math_dapo.last_boxed_only_string), or
    None when there is none or it does not close."""
    start = text.rfind("\\boxed{")
    return None if start < 0 else braced_group(text[start + len("\\boxed"):])[0]


@register("math_dapo", "math_dapo_reasoning")
def compute_score(solution_str, ground_truth, boxed_fallback: bool = True) -> DapoScore:
    """Score 1.0 and acc 1.0 when the response's last `Answer: ...` line equals ground_truth after `normalize`, or,
    when it has no Answer line (and `boxed_fallback`), its last `\\boxed{...}` equals ground_truth as written; else
    score -1.0 and acc 0.0.

    A ground truth that is a number or bytes is compared as its text; a response or ground truth that is no text
    at all scores -1.0 (verl raises)."""
    expected = as_text(ground_truth)
    tail = solution_str[-CLIP_CHARS:] if isinstance(solution_str, str) else ""
    answers = ANSWER_LINE.findall(tail)
    pred = normalize(answers[-1] if answers else NO_ANSWER)
    if pred == NO_ANSWER and boxed_fallback:
        boxed = last_boxed(tail[-BOX_CHARS:])
        if boxed is not None:
            return _scored(expected is not None and boxed == expected, boxed)
    return _scored(expected is not None and isinstance(solution_str, str) and pred == normalize(expected), pred)


def _scored(correct: bool, pred: str) -> DapoScore:
    return DapoScore(score=1.0 if correct else -1.0, acc=1.0 if correct else 0.0, pred=pred)
