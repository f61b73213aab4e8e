"""The gsm8k and MATH scorers give verl's scores by default (reward.gsm8k_match / math_match = exact), so that
reward curves compare with published verl runs. Every expected score below was worked out by hand from the rules
of verl's verl/utils/reward_score/{gsm8k,math_reward,math_dapo}.py and default_compute_score (verl is not
installed here): RIGHT scores 1, WRONG is an extracted but wrong answer (format_score), NONE no answer at all."""
import pytest

from rl_megatron.rewards import REGISTRY, gsm8k, math, math_dapo, score

RIGHT, WRONG, NONE = "right", "wrong", "none"
FORMAT_SCORE = 0.1


def assert_verl_score(scorer, expected: str, *args, **kwargs):
    """verl's score (format_score 0: wrong and none both 0), and with a format score, which of the two it is."""
    assert scorer(*args, **kwargs) == (1.0 if expected == RIGHT else 0.0)
    assert scorer(*args, **kwargs, format_score=FORMAT_SCORE) == {RIGHT: 1.0, WRONG: FORMAT_SCORE, NONE: 0.0}[expected]


@pytest.mark.parametrize("response, ground_truth, expected", [
    ("#### 72", "72", RIGHT),
    ("####72", "72", NONE),  # strict needs "#### " with one space
    ("####3704", "3704", NONE),
    ("####  72", "72", NONE),  # two spaces
    ("####-5", "-5", NONE),
    ("##### 72", "72", RIGHT),  # holds "#### 72"
    ("#### 2718.00", "2718", WRONG),  # compared as text, not as numbers
    ("#### 1239.", "1239", WRONG),  # a full stop after the number is part of it
    ("#### 72.5", "72", WRONG),
    ("#### .5", "0.5", WRONG),
    ("#### 0072", "72", WRONG),
    ("#### 1,000", "1000", RIGHT),  # the answer's commas go
    ("#### 1,2,3", "123", RIGHT),
    ("#### 1000", "1,000", WRONG),  # the ground truth's stay
    ("#### $1,000", "1000", NONE),  # "$" is not a digit
    ("#### +72", "72", NONE),
    ("#### --5", "-5", NONE),
    ("#### -5", "-5", RIGHT),
    ("#### -5", "5", WRONG),
    ("#### 5", "-5", WRONG),
    ("#### 72 dollars", "72", RIGHT),
    ("#### 72", " 72", WRONG),  # the ground truth is not stripped
    ("#### 5\nno, wait\n#### 6", "6", RIGHT),  # the last #### wins
    ("#### 6\nno, wait\n#### 5", "6", WRONG),
    ("#### 3 #### 4", "4", RIGHT),
    ("The answer is 72", "72", NONE),
    ("", "72", NONE),
    ("x" * 1000 + "#### 18", "18", RIGHT),
    ("#### 18\n" + "x" * 400, "18", NONE),  # only the last 300 characters are read
    ("a" * 400 + "#### 7" + "b" * 296, "7", NONE),  # the clip leaves "## 7"
    ("#### 5 " * 50_000, "5", RIGHT),
])
def test_gsm8k_strict_scores_as_verl(response, ground_truth, expected):
    assert_verl_score(gsm8k.compute_score, expected, response, ground_truth)
    assert_verl_score(REGISTRY["openai/gsm8k"], expected, response, ground_truth, method="strict")


@pytest.mark.parametrize("response, ground_truth, expected", [
    ("The answer is 72", "72", RIGHT),
    ("#### 72", "72", RIGHT),
    ("It is -3.5 degrees", "-3.5", RIGHT),
    ("x-5", "-5", RIGHT),
    ("- 5", "5", RIGHT),  # a minus must touch the number
    ("3 + 4 = 7. So 7 apples.", "7", RIGHT),  # a lone "." is passed over
    ("The answer is 72.", "72", WRONG),  # "72." is the last run
    ("I got 72, then stopped", "72", WRONG),  # "72,"
    ("72 apples and 1,234 pears", "1234", WRONG),  # flexible keeps commas
    ("72 apples and 1,234 pears", "1,234", RIGHT),
    ("$1,000", "1000", WRONG),
    ("#### 2718.00", "2718", WRONG),
    ("... and that is all", "72", WRONG),  # "..." is a run, so an answer
    (".", "72", WRONG),  # only lone dots: verl's answer is "."
    ("no numbers here", "72", NONE),
    ("", "72", NONE),
    ("12345" + "z" * 297, "345", RIGHT),  # the clip cuts the number
    ("1 " * 100_000 + "2", "2", RIGHT),
])
def test_gsm8k_flexible_scores_as_verl(response, ground_truth, expected):
    assert_verl_score(gsm8k.compute_score, expected, response, ground_truth, method="flexible")


@pytest.mark.parametrize("response, ground_truth, expected", [
    ("\\boxed{5}", "5", RIGHT),
    ("So it is $\\boxed{\\frac{1}{2}}$.", "\\frac12", RIGHT),  # \frac12 -> \frac{1}{2}
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", RIGHT),
    ("\\boxed{\\tfrac12}", "\\frac{1}{2}", RIGHT),
    ("\\boxed{\\frac{1}2}", "\\frac{1}{2}", WRONG),  # a braced first argument keeps the second as written
    ("\\boxed{\\dfrac{3}{4}}", "3/4", RIGHT),  # a/b -> \frac{a}{b}
    ("\\boxed{1/2}", "\\frac{1}{2}", RIGHT),
    ("\\boxed{01/2}", "\\frac{1}{2}", WRONG),
    ("\\boxed{-1/2}", "-\\frac{1}{2}", WRONG),  # \frac{-1}{2}
    ("\\boxed{0.5}", "\\frac{1}{2}", RIGHT),  # the one decimal rewritten
    ("\\boxed{.5}", "\\frac{1}{2}", RIGHT),
    ("\\boxed{0.50}", "\\frac{1}{2}", WRONG),  # no numeric equality
    ("\\boxed{2.5}", "\\frac{5}{2}", WRONG),
    ("\\boxed{5.0}", "5", WRONG),
    ("\\boxed{10,000}", "10000", WRONG),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", RIGHT),
    ("\\boxed{\\left[0,1\\right)}", "[0,1)", RIGHT),
    ("\\boxed{\\leftarrow}", "arrow", RIGHT),  # \left goes wherever it is
    ("\\boxed{10\\text{ cm}}", "10", RIGHT),  # a unit as "\text{ ...}"
    ("\\boxed{5 \\text{ dollars}}", "5", RIGHT),
    ("\\boxed{10\\text{cm}}", "10", WRONG),  # without the space it is no unit
    ("\\boxed{3\\text{ cm}\\text{ wide}}", "3", WRONG),  # two: not normalised, compared as written
    ("\\boxed{90^\\circ}", "90", RIGHT),
    ("\\boxed{90^{\\circ}}", "90", RIGHT),
    ("\\boxed{90°}", "90", WRONG),
    ("\\boxed{50\\%}", "50", RIGHT),
    ("\\boxed{50%}", "50", WRONG),  # a bare % stays
    ("\\boxed{\\$5}", "5", RIGHT),
    ("\\boxed{\\$\\,5}", "5", WRONG),  # \, is not removed
    ("\\boxed{x = 5}", "5", RIGHT),  # a left side of at most two characters goes
    ("\\boxed{k=5}", "5", RIGHT),
    ("\\boxed{x_1 = 5}", "5", WRONG),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", RIGHT),
    ("\\boxed{\\sqrt 3}", "\\sqrt{3}", WRONG),  # "\sqrt{}3"
    ("\\boxed{\\sqrt}", "\\sqrt", RIGHT),  # not normalised, equal as written
    ("\\boxed{a{b{c}}d}", "a{b{c}}d", RIGHT),  # nested braces
    ("\\boxed{\\boxed{5}}", "5", RIGHT),  # the innermost \boxed is the last
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", RIGHT),
    ("\\boxed{\\text{(B)}}", "\\text{(B)}", RIGHT),
    ("\\boxed{\\text{Monday}}", "Monday", WRONG),
    ("\\boxed{1,2}", "12", WRONG),
    ("First \\boxed{1}, then \\boxed{2}", "2", RIGHT),  # the last box wins
    ("\\boxed{5}\\fbox{6}", "5", RIGHT),  # \fbox only counts without any \boxed
    ("\\fbox{7}", "7", NONE),  # and then it fails verl's box check
    ("\\boxed 5$ is it", "5", RIGHT),  # "\boxed ": up to the next $
    ("\\boxed 5\nnext line", "5", WRONG),  # ... or the end: "5nextline"
    ("\\boxed 1 and later \\boxed{2}", "2", WRONG),  # "\boxed " wins over a later braced box
    ("\\boxed5", "5", NONE),
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", NONE),  # unclosed
    ("The answer is 5", "5", NONE),
    ("", "5", NONE),
    ("\\boxed{}", "5", WRONG),  # an empty answer is an answer
    ("\\boxed{}", "", RIGHT),
    ("\\boxed{5}", "The sum is $\\boxed{5}$.", WRONG),  # the ground truth is taken as written
    ("x" * 100_000 + "\\boxed{7}", "7", RIGHT),  # no clip
    ("\\boxed{" + "{" * 100_000, "5", NONE),
])
def test_math_scores_as_verl(response, ground_truth, expected):
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert score(source, response, ground_truth) == (1.0 if expected == RIGHT else 0.0)
    assert_verl_score(math.compute_score, expected, response, ground_truth)


@pytest.mark.parametrize("response, ground_truth, expected", [
    ("Answer: 5", "5", 1.0),
    ("ANSWER :\n7", "7", 1.0),  # any case; the space after the colon may hold a line break
    ("The answer is \\boxed{5}", "5", -1.0),  # DAPO reads "Answer:", not boxes
    ("answer: 1,000", "1000", 1.0),
    ("Answer: x = 5", "5", 1.0),  # the right side of the last "="
    ("Answer: $\\frac{1}{2}$", "\\frac12", 1.0),
    ("Answer: 5 cm", "5", 1.0),  # units and spaces go
    ("Answer: 5\nAnswer: 6", "5", -1.0),  # the last answer line
    ("Answer: 0.5", "\\frac{1}{2}", -1.0),
    ("", "5", -1.0),
    ("Answer: 5" + " " * 400, "5", -1.0),  # only the last 300 characters are read
])
def test_data_source_math_scores_as_verl_dapo(response, ground_truth, expected):
    for source in ("math", "math_dapo", "math_dapo_reasoning"):
        assert score(source, response, ground_truth)["score"] == expected
    result = math_dapo.compute_score(response, ground_truth)
    assert (result["score"], result["acc"]) == (expected, 1.0 if expected == 1.0 else 0.0)


@pytest.mark.parametrize("response, ground_truth, expected", [
    ("x = 3\nAnswer: $x = 12$ cm", "12", {"score": 1.0, "acc": 1.0, "pred": "12"}),
    ("Answer: 1,000", "999", {"score": -1.0, "acc": 0.0, "pred": "1000"}),
    ("no answer line", "5", {"score": -1.0, "acc": 0.0, "pred": "[INVALID]"}),
    ("Answer: 5", None, {"score": -1.0, "acc": 0.0, "pred": "5"}),
])
def test_dapo_returns_verls_dict_with_the_accuracy_on_0_1(response, ground_truth, expected):
    """verl's math_dapo returns {"score": ±1, "acc": correct, "pred": the normalised answer}: the accuracy is what
    reward/acc and validation average, so that they read p (the share solved), not 2p - 1."""
    assert math_dapo.compute_score(response, ground_truth) == expected


@pytest.mark.parametrize("scorer", [gsm8k.compute_score, math.compute_score, math.compute_score_math_source])
def test_an_unknown_match_mode_is_refused(scorer):
    with pytest.raises(ValueError, match="match='loose' is unknown: use one of exact, numeric"):
        scorer("#### 1", "1", match="loose")


def test_numbers_as_ground_truth_compare_as_their_text():
    """verl's parquet files hold text; a number (a user's own file) is compared as its text, where verl would
    score every sample 0 (gsm8k, MATH) or -1 (DAPO)."""
    assert gsm8k.compute_score("#### 72", 72) == 1.0
    assert gsm8k.compute_score("#### 72", 72.0) == 0.0  # "72.0"
    assert math.compute_score("\\boxed{5}", 5) == 1.0
    assert math_dapo.compute_score("Answer: 5", 5)["score"] == 1.0
    assert math_dapo.compute_score("Answer: 5", None)["score"] == -1.0
