import pytest

from rl_megatron.errors import ConfigError
from rl_megatron.rewards import SCORERS, register, score
from rl_megatron.rewards.arithmetic import compute_score
from rl_megatron.rewards.worker import as_reward, score_chunk


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
    assert SCORERS["arithmetic"] is compute_score
    assert score("arithmetic", " 7", "7") == 1.0


def test_register_adds_a_source():
    @register("test_exact_match")
    def exact_match(solution_str, ground_truth):
        return float(solution_str == ground_truth)

    try:
        assert score("test_exact_match", "a", "a") == 1.0
    finally:
        SCORERS.remove("test_exact_match")


def test_unknown_data_source_names_the_known_ones():
    with pytest.raises(ConfigError, match="data_source='no_such_task' is not a registered reward scorer .*arithmetic"):
        score("no_such_task", "3", "3")


def test_builtin_scorers_are_registered_under_verl_and_tinyzero_data_source_names():
    from rl_megatron.rewards import countdown, gsm8k, lookup, math, math_dapo

    expected = {"countdown": countdown.compute_score, "openai/gsm8k": gsm8k.compute_score,
                "gsm8k": gsm8k.compute_score, "lighteval/MATH": math.compute_score,
                "DigitalLearningGmbH/MATH-lighteval": math.compute_score,
                "HuggingFaceH4/MATH-500": math.compute_score, "math": math.compute_score_math_source,
                "math_dapo": math_dapo.compute_score, "math_dapo_reasoning": math_dapo.compute_score,
                "lookup": lookup.compute_score}
    for name, scorer in expected.items():
        assert SCORERS[name] is scorer, name
    # only TinyZero's countdown reads the prompt's "Assistant:" marker
    assert SCORERS.with_trait("reads_prompt") == {"countdown"}
    # the tool-calling demo's reads the rollout's tool calls
    assert SCORERS.with_trait("reads_extra_info") == {"lookup"}
    # The match modes come from the reward config.
    from_config = {name: SCORERS.trait(name, "from_config") for name in SCORERS.with_trait("from_config")}
    assert from_config == {"openai/gsm8k": {"match": "gsm8k_match"}, "gsm8k": {"match": "gsm8k_match"},
                           **{name: {"match": "math_match"} for name in ("lighteval/MATH", "math",
                              "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")}}


def test_keywords_from_config_follow_the_registrations():
    """The built-in scorers get their match modes from the reward config; a scorer registered again under a
    built-in's name (a user's own) gets only the keywords it asks for."""
    from rl_megatron.config.schema import RewardConfig
    from rl_megatron.rewards import keywords_from_config

    cfg = RewardConfig(gsm8k_match="numeric")
    keywords = keywords_from_config(cfg)
    assert keywords["openai/gsm8k"] == {"match": "numeric"}
    assert keywords["lighteval/MATH"] == keywords["math"] == {"match": "exact"}
    builtin = SCORERS["openai/gsm8k"]
    try:
        register("openai/gsm8k")(lambda solution_str, ground_truth: 0.5)
        assert "openai/gsm8k" not in keywords_from_config(cfg)
    finally:
        register("openai/gsm8k", from_config={"match": "gsm8k_match"})(builtin)
    assert SCORERS.trait("openai/gsm8k", "from_config") == {"match": "gsm8k_match"}


def test_scorer_processes_call_the_scorers_with_their_keywords():
    samples = [("openai/gsm8k", "#### 72.00", "72", None), ("arithmetic", "7", "7", None)]
    progress = [0.0, 0.0]
    assert score_chunk(samples, None, {}, progress) == ([(0.0, 0.0), (1.0, 1.0)], [])
    assert score_chunk(samples, None, {"openai/gsm8k": {"match": "numeric"}}, progress) == \
        ([(1.0, 1.0), (1.0, 1.0)], [])


@pytest.mark.parametrize("raw, expected", [
    (0.5, (0.5, 0.5)),  # a number is its own accuracy
    (True, (1.0, 1.0)),
    ({"score": -1.0, "acc": False, "pred": "7"}, (-1.0, 0.0)),  # DAPO's scorer: score -1, acc False
    ({"score": 0.5, "acc": 1}, (0.5, 1.0)),
    ({"score": 0.25}, (0.25, 0.25)),
])
def test_as_reward_reads_the_score_and_the_accuracy(raw, expected):
    assert as_reward(raw) == expected


@pytest.mark.parametrize("raw, error, words", [
    ({"score": 1.0, "acc": "yes"}, TypeError, "the scorer returned an 'acc' of str 'yes', not a number"),
    ({"score": 1.0, "acc": float("nan")}, ValueError, "the scorer returned an 'acc' of nan, which would poison"),
    ({"score": None, "acc": 1}, TypeError, "the scorer returned NoneType 'None', not a number"),
    ({"acc": 1}, TypeError, "without a 'score' entry"),
])
def test_as_reward_refuses_a_bad_score_or_accuracy(raw, error, words):
    with pytest.raises(error, match=words):
        as_reward(raw)


def test_register_takes_several_names_and_the_prompt_flag():
    @register("test_a", "test_b", reads_prompt=True)
    def constant(solution_str, ground_truth):
        return 0.5

    try:
        assert score("test_a", "", "") == score("test_b", "", "") == 0.5
        assert {"test_a", "test_b"} <= SCORERS.with_trait("reads_prompt")
    finally:
        for name in ("test_a", "test_b"):
            SCORERS.remove(name)


MALFORMED = [None, 0, 7, 3.5, b"Assistant: <answer>1+2</answer>", {"answer": 3}, ["#### 3"], object(),
             "", "\x00\xff", "Assistant: " + "<answer>" * 200_000, "\\boxed{" + "{" * 200_000,
             "#### " + "1," * 300_000, "." * 1_000_000, "(" * 100_000]


@pytest.mark.parametrize("data_source", SCORERS.names())
@pytest.mark.parametrize("solution", MALFORMED, ids=lambda value: f"{type(value).__name__}{len(repr(value))}")
def test_every_scorer_returns_a_reward_for_malformed_input(data_source, solution):
    """A float, or (DAPO) verl's dict whose score and accuracy are floats."""
    for ground_truth in (None, 3, "3", b"3", {"target": 3, "numbers": [1, 2]}, [1, 2], "\\boxed{"):
        result = score(data_source, solution, ground_truth)
        values = (result["score"], result["acc"]) if isinstance(result, dict) else (result,)
        assert all(isinstance(value, float) for value in values)
