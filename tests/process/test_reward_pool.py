"""RewardScorer: the process pool the trainer scores with. Scorers that hang, raise, crash or return junk
cost their sample (0, counted, logged), never the run; a custom scorer loads from a module of the user's."""
import logging
import os
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch
from helpers.runs import REPO

from rl_megatron.config import ConfigError
from rl_megatron.rewards import SCORERS
from rl_megatron.rewards.scorer import RewardScorer
from rl_megatron.trainer.rewards import Rewards

# The user's reward module: the solution text says how to misbehave.
USER_MODULE = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "hang":
        with open(extra_info["pid_file"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
    if solution_str.startswith("sleep:"):
        time.sleep(float(solution_str[len("sleep:"):]))
    if solution_str == "raise":
        raise RuntimeError("bug in the user's scorer")
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "nan":
        return float("nan")
    if solution_str == "text":
        return "high"
    if solution_str == "dict_wrong":  # verl-style dicts, as DAPO's scorer returns them
        return {"score": -1.0, "acc": False}
    if solution_str == "dict_right":
        return {"score": 0.5, "acc": 1}
    if solution_str == "acc_text":
        return {"score": 1.0, "acc": "high"}
    if solution_str == "extra":
        return float(extra_info["weight"])
    return 1.0 if solution_str == ground_truth else 0.0
'''


def reward_cfg(custom_fn=None, num_workers=2, timeout_s=10.0, gsm8k_match="exact", math_match="exact"):
    return SimpleNamespace(custom_fn=custom_fn, num_workers=num_workers, timeout_s=timeout_s,
                           gsm8k_match=gsm8k_match, math_match=math_match)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`user_rewards_for_test:compute_score`, importable from a folder that is only on this process's sys.path."""
    (tmp_path / "user_rewards_for_test.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards_for_test:compute_score"


def user_score(scorer, solutions, ground_truths=None, extra_infos=None):
    n = len(solutions)
    return scorer.score(["user_task"] * n, solutions, ground_truths or ["ok"] * n, extra_infos)


def test_builtin_scorers_through_the_pool():
    countdown_truth = {"target": 3, "numbers": [1, 2]}
    samples = [  # (data_source, response, ground_truth, prompt, expected)
        ("arithmetic", " 7", "7", "3+4=", 1.0),
        ("arithmetic", "8", "7", "3+4=", 0.0),
        ("countdown", " <answer>1+2</answer>", countdown_truth, "1, 2 make 3. Assistant:", 1.0),
        ("countdown", " <answer>2-1</answer>", countdown_truth, "1, 2 make 3. Assistant:", 0.1),
        ("openai/gsm8k", "so #### 1,200", "1200", "q", 1.0),
        ("lighteval/MATH", "$\\boxed{\\dfrac12}$", "0.5", "q", 1.0),
    ]
    with RewardScorer(reward_cfg()) as scorer:
        scored = scorer.score(*([s[i] for s in samples] for i in range(3)), prompts=[s[3] for s in samples])
    assert scored.scores.dtype == scored.acc.dtype == torch.float32
    assert scored.scores.tolist() == pytest.approx([s[4] for s in samples])
    assert torch.equal(scored.acc, scored.scores)  # a scorer returning a number: its accuracy is its score
    assert scored.stats == {"reward/timeouts": 0, "reward/errors": 0}


@pytest.mark.parametrize("match, expected", [("exact", [0.0, 0.0, -1.0]), ("numeric", [1.0, 1.0, 1.0])])
def test_the_match_modes_reach_the_scorer_processes(match, expected):
    """reward.gsm8k_match / math_match: verl's scores (exact), or equal values match (numeric)."""
    samples = [("openai/gsm8k", "#### 72.00", "72"), ("lighteval/MATH", "\\boxed{0.50}", "\\frac{1}{2}"),
               ("math", "\\boxed{0.50}", "\\frac{1}{2}")]  # verl scores data_source math with DAPO's 1 / -1
    with RewardScorer(reward_cfg(num_workers=1, gsm8k_match=match, math_match=match)) as scorer:
        scores = scorer.score(*([s[i] for s in samples] for i in range(3))).scores
    assert scores.tolist() == expected


def test_reward_acc_of_a_dapo_batch_is_the_share_solved():
    """DAPO scores ±1; with 3 of 4 solved reward/score is 2p - 1 = 0.5 and reward/acc (and dynamic sampling's
    filter/generated_acc/mean, the same accuracies) is p = 0.75."""
    responses = ["Answer: 7", "so 7.\nAnswer: 7", "Answer: 8", "Answer: $7$"]
    with RewardScorer(reward_cfg(num_workers=1)) as scorer:
        scored = scorer.score(["math_dapo"] * 4, responses, ["7"] * 4)
    rewards = Rewards.of(scored, [], SimpleNamespace(overlong_buffer=SimpleNamespace(enable=False)), max_tokens=8)
    assert rewards.metrics() == {"reward/score": 0.5, "reward/acc": 0.75, "reward/timeouts": 0, "reward/errors": 0}


def test_large_batches_keep_sample_order_across_chunks():
    n = 256  # the demo's step: many chunks over the processes
    solutions = [str(i) if i % 3 else "wrong" for i in range(n)]
    with RewardScorer(reward_cfg(num_workers=3)) as scorer:
        for _ in range(2):  # the pool is reused across steps
            scores = scorer.score(["arithmetic"] * n, solutions, [str(i) for i in range(n)]).scores
            assert scores.tolist() == [float(i % 3 != 0) for i in range(n)]
        empty = scorer.score([], [], [])
        assert empty.scores.shape == empty.acc.shape == (0,)


def test_a_hung_scorer_is_killed_and_counted_as_a_timeout(user_module, tmp_path, caplog):
    pid_file = tmp_path / "hung.pid"
    solutions = ["ok", "hang", "ok", "no", "ok"]
    extra_infos = [{"pid_file": str(pid_file)}] * len(solutions)
    with RewardScorer(reward_cfg(user_module, timeout_s=0.5)) as scorer:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rl_megatron.rewards.scorer"):
            scored = user_score(scorer, solutions, extra_infos=extra_infos)
        assert time.monotonic() - started < 3.0
        assert scored.scores.tolist() == scored.acc.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert scored.stats == {"reward/timeouts": 1, "reward/errors": 0}
        assert "1 timed out after reward.timeout_s=0.5s" in caplog.text
        with pytest.raises(ProcessLookupError):  # the hung process is gone, not left running
            os.kill(int(pid_file.read_text()), 0)
        scored = user_score(scorer, ["ok"] * 6)  # the replaced pool scores the next batch
        assert scored.scores.tolist() == [1.0] * 6 and scored.stats == {"reward/timeouts": 0, "reward/errors": 0}


def test_the_timeout_is_per_sample_not_per_chunk(user_module):
    # One process gets chunks of 12 samples of 0.05 s (48 in CHUNKS_PER_WORKER chunks): a chunk takes longer than the
    # timeout, no sample nearly does (9x margin: a busy machine delays a sample by far less than 0.4 s).
    with RewardScorer(reward_cfg(user_module, num_workers=1, timeout_s=0.45)) as scorer:
        scored = user_score(scorer, ["sleep:0.05"] * 48, ["sleep:0.05"] * 48)
    assert scored.scores.tolist() == [1.0] * 48 and scored.stats["reward/timeouts"] == 0


@pytest.mark.parametrize("failure, message", [
    ("raise", "RuntimeError: bug in the user's scorer"),
    ("exit", "its scorer process died (exit code 3)"),  # os._exit in a scorer: the process is replaced
    ("nan", "would poison the advantages"),
    ("text", "not a number"),
])
def test_a_failing_scorer_scores_zero_and_is_counted(user_module, caplog, failure, message):
    with RewardScorer(reward_cfg(user_module)) as scorer:
        with caplog.at_level(logging.WARNING, logger="rl_megatron.rewards.scorer"):
            scored = user_score(scorer, ["ok", failure, "ok", "ok"])
        assert scored.scores.tolist() == scored.acc.tolist() == [1.0, 0.0, 1.0, 1.0]
        assert scored.stats == {"reward/timeouts": 0, "reward/errors": 1}
        assert message in caplog.text and "data_source='user_task'" in caplog.text
        assert user_score(scorer, ["ok", "ok"]).stats == {"reward/timeouts": 0, "reward/errors": 0}


def test_custom_fn_gets_extra_info_and_may_return_verl_style_dicts_with_an_accuracy(user_module, caplog):
    with RewardScorer(reward_cfg(user_module)) as scorer:
        scored = user_score(scorer, ["dict_wrong", "dict_right", "extra"], extra_infos=[None, None, {"weight": 0.75}])
        assert scored.scores.tolist() == [-1.0, 0.5, 0.75]
        assert scored.acc.tolist() == [0.0, 1.0, 0.75]  # the dicts' "acc" (bool or number), else the score
        assert scored.stats == {"reward/timeouts": 0, "reward/errors": 0}
        with caplog.at_level(logging.WARNING, logger="rl_megatron.rewards.scorer"):
            scored = user_score(scorer, ["acc_text", "dict_right"])
    assert scored.scores.tolist() == [0.0, 0.5] and scored.acc.tolist() == [0.0, 1.0]  # a bad "acc" fails its sample
    assert scored.stats == {"reward/timeouts": 0, "reward/errors": 1}
    assert "the scorer returned an 'acc' of str 'high', not a number" in caplog.text


def test_custom_fn_from_a_file_path(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def length_reward(data_source, solution_str, ground_truth, extra_info):\n"
                    "    return len(solution_str) / 10\n")
    with RewardScorer(reward_cfg(f"{path}:length_reward")) as scorer:
        assert user_score(scorer, ["abc", "abcde"]).scores.tolist() == pytest.approx([0.3, 0.5])


@pytest.mark.parametrize("spec, message", [
    ("no_such_package_xyz.rewards:score", "module 'no_such_package_xyz' was not found"),
    ("user_rewards_for_test:no_such_function", "has no attribute 'no_such_function'"),
    ("user_rewards_for_test", "must be 'package.module:function'"),
    ("/nonexistent/reward.py:score", "file '/nonexistent/reward.py' was not found"),
])
def test_a_bad_custom_fn_fails_at_start_naming_the_key(user_module, spec, message):
    with pytest.raises(ConfigError, match="reward.custom_fn") as info:
        RewardScorer(reward_cfg(spec))
    assert message in str(info.value)


def test_unknown_sources_and_missing_prompts_fail_before_scoring():
    with RewardScorer(reward_cfg(num_workers=1)) as scorer:
        with pytest.raises(ConfigError, match="data_source='no_such_task' is not a registered .*arithmetic"):
            scorer.score(["no_such_task"], ["1"], ["1"])
        with pytest.raises(ValueError, match="'countdown'.*pass prompts="):
            scorer.score(["countdown"], ["<answer>1</answer>"], [{"target": 1, "numbers": [1]}])
        with pytest.raises(ValueError, match="1 solutions for 2 data_sources"):
            scorer.score(["arithmetic"] * 2, ["1"], ["1", "2"])


def test_submit_returns_at_once_and_close_stops_the_processes(user_module):
    scorer = RewardScorer(reward_cfg(user_module))
    started = time.monotonic()
    pending = scorer.submit(["user_task"] * 2, ["sleep:0.3"] * 2, ["sleep:0.3"] * 2)
    assert time.monotonic() - started < 0.2  # the trainer can go on while the pool scores
    assert pending.result().scores.tolist() == [1.0, 1.0]
    processes = [p.process for p in scorer._processes]
    scorer.close()
    assert all(p.returncode is not None for p in processes)
    with pytest.raises(RuntimeError, match="closed"):
        scorer.submit(["arithmetic"], ["1"], ["1"])


def test_a_batch_that_cannot_be_sent_fails_alone(user_module):
    # A ground truth that cannot be pickled fails its batch; the chunks already sent must not leak into the next.
    n = 8
    with RewardScorer(reward_cfg(user_module, num_workers=2)) as scorer:
        truths = ["ok"] * (n - 1) + [lambda: "ok"]
        with pytest.raises(Exception, match="pickle"):
            user_score(scorer, ["sleep:0.05"] * n, truths)
        scored = user_score(scorer, ["ok", "no", "ok"])
    assert scored.scores.tolist() == [1.0, 0.0, 1.0] and scored.stats["reward/errors"] == 0


@pytest.mark.parametrize("override, message", [
    ("reward.custom_fn=no_such_package_xyz.rewards:score", "reward.custom_fn='no_such_package_xyz.rewards:score': "
                                                            "module 'no_such_package_xyz' was not found"),
    ("reward.timeout_s=0", "reward.timeout_s=0.0 must be > 0"),
    ("reward.num_workers=0", "reward.num_workers=0 must be at least 1"),
])
def test_config_validation_of_the_reward_keys(override, message):
    from rl_megatron.preflight import load_config

    model = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")
    with pytest.raises(ConfigError) as info:
        load_config(os.path.join(REPO, "configs", "demo_cpu.yaml"), [f"model.path={model}", override])
    assert message in str(info.value)


def test_config_accepts_a_custom_fn_that_imports(user_module):
    from rl_megatron.preflight import load_config

    model = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")
    cfg = load_config(os.path.join(REPO, "configs", "demo_cpu.yaml"), [f"model.path={model}",
                                                                       f"reward.custom_fn={user_module}"])
    assert cfg.reward.custom_fn == user_module and cfg.reward.timeout_s == 10.0


REGISTERING_MODULE = '''
from rl_megatron.rewards import register

@register("shouting_task")
def score_shouting(solution_str, ground_truth):
    return 1.0 if solution_str == ground_truth.upper() else 0.0
'''


@pytest.fixture
def registering_module(tmp_path, monkeypatch):
    """A user module that registers a scorer for data_source 'shouting_task' when imported."""
    (tmp_path / "user_registry_for_test.py").write_text(textwrap.dedent(REGISTERING_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_registry_for_test"
    SCORERS.remove("shouting_task")
    sys.modules.pop("user_registry_for_test", None)


def test_a_scorer_registered_by_a_module_of_trainer_imports_scores_in_the_processes(registering_module):
    with RewardScorer(reward_cfg(num_workers=2), imports=[registering_module]) as scorer:
        scored = scorer.score(["shouting_task"] * 3, ["HI", "hi", "YO"], ["hi", "hi", "yo"])
    assert scored.scores.tolist() == [1.0, 0.0, 1.0] and scored.stats == {"reward/timeouts": 0, "reward/errors": 0}


def test_a_scorer_registered_only_in_the_controller_names_trainer_imports(registering_module):
    import importlib

    importlib.import_module(registering_module)  # registered here, but the processes never import it
    with RewardScorer(reward_cfg(num_workers=1)) as scorer:
        with pytest.raises(KeyError, match="'shouting_task' has a scorer registered in this process.*trainer.imports"):
            scorer.score(["shouting_task"], ["HI"], ["hi"])


def test_a_bad_import_fails_at_start_naming_the_key():
    with pytest.raises(ConfigError, match="trainer.imports entry 'no_such_module_xyz': module 'no_such_module_xyz'"):
        RewardScorer(reward_cfg(num_workers=1), imports=["no_such_module_xyz"])
