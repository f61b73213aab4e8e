import pytest

from rl_megatron.rewards import REGISTRY, register, score
from rl_megatron.rewards.arithmetic import compute_score


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("3", "3", 1.0),
        (" 3", "3", 1.0),
        ("   3<eos>", "3", 1.0),
        ("3+", "3", 1.0),
        ("3 4", "3", 1.0),
        ("35", "3", 0.0),  # a longer number is a different answer
        ("13", "3", 0.0),
        ("4", "3", 0.0),
        ("", "3", 0.0),
        (" ", "3", 0.0),
        ("\n3", "3", 0.0),  # only leading spaces are stripped
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ("-3", "3", 0.0),
        ("10", "10", 1.0),
        ("1", "10", 0.0),
    ],
)
def test_arithmetic_score(response, ground_truth, expected):
    assert compute_score(response, ground_truth) == expected


@pytest.mark.parametrize("response", [None, 3, 3.0, b"3", ["3"]])
def test_arithmetic_score_is_zero_for_non_string_responses(response):
    assert compute_score(response, "3") == 0.0


def test_arithmetic_score_is_zero_for_bad_ground_truth():
    assert compute_score("3", None) == 0.0
    assert compute_score("3", "") == 0.0


def test_arithmetic_custom_score_value():
    assert compute_score("7", "7", score=0.5) == 0.5


def test_registry_dispatches_by_data_source():
    assert REGISTRY["arithmetic"] is compute_score
    assert score("arithmetic", " 7", "7") == 1.0


def test_register_adds_a_source():
    @register("test_exact_match")
    def exact_match(solution_str, ground_truth):
        return float(solution_str == ground_truth)

    try:
        assert score("test_exact_match", "a", "a") == 1.0
    finally:
        del REGISTRY["test_exact_match"]


def test_unknown_data_source_names_the_known_ones():
    with pytest.raises(KeyError, match="no_such_task.*arithmetic"):
        score("no_such_task", "3", "3")
