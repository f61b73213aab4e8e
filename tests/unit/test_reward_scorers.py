"""The countdown, gsm8k and math scorers on tricky answers: where the answer is, how it is written, and what
counts as equal. The gsm8k and math cases here are the opt-in match="numeric" modes (the behaviour before verl
parity became the default); test_reward_verl_parity.py has the default's."""
import json

import numpy as np
import pytest

from rl_megatron.rewards import countdown, gsm8k, math, math_numeric

PROMPT = "User: Using the numbers [93, 43, 1], create an equation that equals 51. Assistant: Let me solve this"
TARGET_51 = {"target": 51, "numbers": [93, 43, 1]}


def cd(response: str, ground_truth=TARGET_51, prompt: str = PROMPT, **kwargs) -> float:
    return countdown.compute_score(prompt + response, ground_truth, **kwargs)


@pytest.mark.parametrize("response, expected", [
    ("<think>93-43=50, 50+1=51</think>\n<answer>(93-43)+1</answer>", 1.0),
    ("\n<answer> 93 - 43 + 1 </answer>", 1.0),  # spaces inside the tag
    ("\n<answer>1 + 93 - 43</answer>", 1.0),  # any order of the numbers
    ("\n<answer>93-43</answer>", 0.1),  # 1 is not used
    ("\n<answer>93-43+1+1</answer>", 0.1),  # 1 is used twice
    ("\n<answer>93-42+0</answer>", 0.1),  # numbers that were not given
    ("\n<answer>(93-43)*1</answer>", 0.1),  # valid equation, wrong value
    ("\n<answer>(93-43)+1 = 51</answer>", 0.1),  # "=" is not allowed
    ("\n<answer>93-43+1.0</answer>", 0.1),  # no decimal points
    ("\n<answer>x</answer>", 0.1),
    ("\n<answer></answer>", 0.1),
    ("\n<answer>((93-43)+1</answer>", 0.1),  # unbalanced parentheses
    ("\n<answer>1</answer> then <answer>93-43+1</answer>", 1.0),  # the last tag on the line wins
    ("\n<answer>93-43+1</answer> then <answer>1</answer>", 0.1),
    ("\n<answer>93-43+1</answer>\nDone.", 0.0),  # the answer is not on the last line
    ("\n<answer>93-43+1", 0.0),  # unclosed tag
    ("\nThe answer is 93-43+1", 0.0),  # no tag
])
def test_countdown_answers(response, expected):
    assert cd(response) == expected


def test_countdown_needs_the_assistant_marker_and_reads_only_after_the_first():
    answer = "<answer>93-43+1</answer>"
    assert countdown.compute_score(answer, TARGET_51) == 0.0  # no marker: as TinyZero, nothing to score
    assert countdown.compute_score("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + answer, TARGET_51) == 1.0
    # The prompt's own (example) answer tag is before the marker, so it never counts.
    assert countdown.compute_score("Show it as <answer>93-43+1</answer>. Assistant: no idea", TARGET_51) == 0.0


@pytest.mark.parametrize("numbers, target, equation, expected", [
    ([6, 4, 2], 3, "6/4*2", 1.0),  # division with a fractional intermediate
    ([7, 3, 3], 7, "7/3*3", 1.0),  # exact arithmetic: no 6.999999
    ([1, 3], 0, "1/3", 0.1),  # 0.333 is not within 1e-5 of 0
    ([5, 0], 5, "5/0", 0.1),  # division by zero is a wrong answer, not a crash
    ([2, 2, 3], 7, "2*2+3", 1.0),  # a number given twice must be used twice
    ([2, 2, 3], 7, "2+3+2", 1.0),
    ([2, 2, 3], 5, "2+3", 0.1),
    ([1, 3], 2, "-1+3", 1.0),  # a leading minus is an operator, not a new number
    ([2, 3], 8, "2**3", 0.1),  # powers are not one of the four operations
    ([2, 3], 8, "2^3", 0.1),
    ([10, 2], 5, "10 / 2", 1.0),
    ([10, 2], 5, "010/2", 0.1),  # not a number Python (or TinyZero) reads
])
def test_countdown_arithmetic(numbers, target, equation, expected):
    assert cd(f"\n<answer>{equation}</answer>", {"target": target, "numbers": numbers}) == expected


@pytest.mark.parametrize("ground_truth", [
    {"target": 51, "numbers": np.array([93, 43, 1])},  # what pandas gives for a parquet list column
    {"target": np.int64(51), "numbers": np.array([93, 43, 1], dtype=np.int32)},
    {"target": 51.0, "numbers": (93, 43, 1)},
    json.dumps(TARGET_51),
    json.dumps(TARGET_51).encode(),
    {"target": "51", "numbers": "[93, 43, 1]"},
])
def test_countdown_ground_truth_forms(ground_truth):
    assert cd("\n<answer>93-43+1</answer>", ground_truth) == 1.0


@pytest.mark.parametrize("ground_truth", [None, 51, "51", "{not json", {"target": 51}, {"numbers": [1]},
                                          {"target": 51, "numbers": [93.5, 43, 1]}, {"target": True, "numbers": [1]},
                                          {"target": 51, "numbers": None}, [51, [93, 43, 1]]])
def test_countdown_malformed_ground_truth_scores_zero(ground_truth):
    assert cd("\n<answer>93-43+1</answer>", ground_truth) == 0.0


def test_countdown_custom_scores_and_deep_nesting():
    assert cd("\n<answer>93-43+1</answer>", score=2.0) == 2.0
    assert cd("\n<answer>93</answer>", format_score=0.0) == 0.0
    nested = "(" * 5000 + "93-43+1" + ")" * 5000  # past the parser's nesting limit: a wrong answer
    assert cd(f"\n<answer>{nested}</answer>") == 0.1


@pytest.mark.parametrize("response, ground_truth, method, expected", [
    ("3 + 4 = 7.\n#### 7", "7", "strict", 1.0),
    ("#### 1,000", "1000", "strict", 1.0),  # commas are dropped
    ("#### 1000", "1,000", "strict", 1.0),
    ("#### $18", "18", "strict", 1.0),  # and dollar signs
    ("####18.", "18", "strict", 1.0),  # a full stop ends the sentence, not the number
    ("#### -5", "-5", "strict", 1.0),  # negative numbers
    ("#### 5", "-5", "strict", 0.0),
    ("#### -5", "5", "strict", 0.0),
    ("#### 72.00", "72", "strict", 1.0),  # equal values
    ("#### 72.5", "72", "strict", 0.0),
    ("#### 5\nwait, no\n#### 6", "6", "strict", 1.0),  # the last answer wins
    ("#### 6\nwait, no\n#### 5", "6", "strict", 0.0),
    ("The answer is 72", "72", "strict", 0.0),  # strict needs ####
    ("The answer is 72", "72", "flexible", 1.0),
    ("I had 3 apples, then 72.", "72", "flexible", 1.0),  # the last number anywhere
    ("72 apples, and 1,234 pears.", "1234", "flexible", 1.0),
    ("It is -3.5 degrees", "-3.5", "flexible", 1.0),
    ("... and that is all.", "72", "flexible", 0.0),  # dots are not numbers
])
def test_gsm8k_numeric_answers(response, ground_truth, method, expected):
    assert gsm8k.compute_score(response, ground_truth, method=method, match="numeric") == expected


def test_gsm8k_format_score_only_for_an_extracted_wrong_answer():
    for match in ("exact", "numeric"):
        assert gsm8k.compute_score("#### 5", "6", format_score=0.1, match=match) == 0.1
        assert gsm8k.compute_score("no answer", "6", format_score=0.1, match=match) == 0.0
        assert gsm8k.compute_score("#### 6", "6", score=2.0, match=match) == 2.0


@pytest.mark.parametrize("ground_truth", [72, np.int64(72), 72.0, np.float32(72.0), b"72", "72", " 72 "])
def test_gsm8k_numeric_ground_truth_forms(ground_truth):
    assert gsm8k.compute_score("#### 72", ground_truth, match="numeric") == 1.0


def test_gsm8k_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="method='loose'.*strict, flexible"):
        gsm8k.compute_score("#### 1", "1", method="loose")


@pytest.mark.parametrize("response, ground_truth", [
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}"),  # \dfrac and unbraced arguments
    ("\\boxed{\\tfrac{1}2}", "\\frac12"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),  # equal values
    ("\\boxed{1/2}", "\\frac{1}{2}"),  # a/b reads as a fraction
    ("\\boxed{-1/2}", "-\\frac{1}{2}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}"),  # nested braces; \sqrt3
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"),  # \left, \right and spaces
    ("\\boxed{10\\text{ cm}}", "10"),  # units
    ("\\boxed{10 \\text{cm}^2}", "10\\text{cm}^2"),
    ("\\boxed{90^\\circ}", "90"),  # degrees
    ("\\boxed{90^{\\circ}}", "90"),
    ("\\boxed{50\\%}", "50"),  # percent
    ("\\boxed{\\$5}", "5"),  # dollars
    ("\\boxed{x = 3}", "3"),  # a leading variable
    ("\\boxed{5.0}", "5"),  # trailing zeros
    ("\\boxed{2.50}", "2.5"),
    ("\\boxed{10,\\!000}", "10000"),  # thousands separators
    ("\\boxed{10,000}", "10,000"),
    ("\\boxed{.5}", "0.5"),
    ("\\boxed{\\text{(B)}}", "\\text{(B)}"),
    ("\\boxed{\\text{Monday}}", "Monday"),
    ("\\boxed 5$ is it", "5"),  # \boxed with a space
    ("\\fbox{7}", "7"),
    ("First \\boxed{1}, then \\boxed{2}", "2"),  # the last box wins
    ("\\boxed{5}", "The sum is $2+3=\\boxed{5}$."),  # a reference solution as ground truth
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces stay balanced
])
def test_math_numeric_equivalent_answers(response, ground_truth):
    assert math.compute_score(response, ground_truth, match="numeric") == 1.0


@pytest.mark.parametrize("response, ground_truth", [
    ("\\boxed{3}", "4"),
    ("\\boxed{(1,2)}", "(2,1)"),
    ("\\boxed{-\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{0.333}", "\\frac{1}{3}"),  # close is not equal
    ("\\boxed{2}, no, \\boxed{1}", "2"),
    ("\\boxed{1,2}", "12"),  # a list, not a thousands separator
    ("\\boxed{\\leftarrow}", "arrow"),  # \left is removed, \leftarrow is not
])
def test_math_numeric_different_answers(response, ground_truth):
    assert math.compute_score(response, ground_truth, match="numeric") == 0.0
    assert math.compute_score(response, ground_truth, format_score=0.1, match="numeric") == 0.1  # an answer was given


@pytest.mark.parametrize("response", ["The answer is 5", "\\boxed{}", "\\boxed{\\frac{1}{2}", "\\boxed5"])
def test_math_numeric_without_a_boxed_answer_scores_zero(response):
    assert math.compute_score(response, "5", format_score=0.1, match="numeric") == 0.0


def test_math_numeric_last_boxed_answer_extraction():
    text = "\\boxed{a{b{c}}d} and \\boxed{\\frac{1}{\\sqrt{2}}}"
    assert math_numeric.last_boxed_answer(text) == math.last_boxed_answer(text) == "\\frac{1}{\\sqrt{2}}"
    assert math_numeric.last_boxed_answer("\\boxed{1} \\fbox{2}") == "2"
    assert math.last_boxed_answer("\\boxed{1} \\fbox{2}") == "1"  # verl reads \fbox only without a \boxed
    assert math_numeric.last_boxed_answer("$\\boxed 42$") == math.last_boxed_answer("$\\boxed 42$") == "42"
    assert math_numeric.last_boxed_answer(None) is math.last_boxed_answer(None) is None


def test_math_numeric_bad_ground_truth_scores_zero():
    for ground_truth in (None, "", "   ", {"answer": 5}, [5], "\\boxed{"):
        assert math.compute_score("\\boxed{5}", ground_truth, format_score=0.1, match="numeric") == 0.0
    assert math.compute_score("\\boxed{5}", 5, match="numeric") == 1.0
    assert math.compute_score("\\boxed{5}", np.int64(5), match="numeric") == 1.0


def test_data_source_math_numeric_is_the_lenient_boxed_scorer():
    """reward.math_match=numeric: data_source "math" scores as before verl parity (0/1 on the last box), not
    with DAPO's "Answer:" line (1/-1)."""
    assert math.compute_score_math_source("\\boxed{0.50}", "\\frac12", match="numeric") == 1.0
    assert math.compute_score_math_source("Answer: 5", "5", match="numeric") == 0.0
    # exact: DAPO's scorer, whose boxed fallback (verl 0.9.1) compares the box as written
    assert math.compute_score_math_source("\\boxed{0.50}", "\\frac12") == {"score": -1.0, "acc": 0.0, "pred": "0.50"}
