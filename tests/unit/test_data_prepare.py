"""`python -m rl_megatron.data.prepare` (its entry point, `main(argv)`, called here): solvable countdown problems,
GSM8K / MATH conversion, --help and argparse's errors."""
import itertools
import json
import os
import re
from fractions import Fraction

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.runs import REPO
from transformers import AutoTokenizer

from rl_megatron import rewards
from rl_megatron.config.schema import DataConfig
from rl_megatron.data.build import build_prompt_loader
from rl_megatron.data.countdown import generate_countdown_problems
from rl_megatron.data.prepare import main

TINY_MODEL_DIR = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")
OPENING = "Let me solve this step by step.\n<think>"


def reachable_values(numbers):
    """Every value of an expression using each number exactly once with + - * / and any parentheses."""
    if len(numbers) == 1:
        return {numbers[0]}
    values = set()
    for i, j in itertools.combinations(range(len(numbers)), 2):
        rest = [n for k, n in enumerate(numbers) if k not in (i, j)]
        a, b = numbers[i], numbers[j]
        combined = {a + b, a - b, b - a, a * b}
        combined.update(x / y for x, y in ((a, b), (b, a)) if y != 0)
        for value in combined:
            values |= reachable_values(rest + [value])
    return values


def solvable(numbers, target):
    return any(abs(value - target) < 1e-5 for value in reachable_values([Fraction(n) for n in numbers]))


def test_brute_force_finds_unsolvable_problems():  # the checker below can fail
    assert solvable([2, 3, 4], 20) and not solvable([1, 1, 1], 7) and not solvable([2, 3], 7)


def run_prepare(*argv):
    return main([str(arg) for arg in argv])


def read_rows(path):
    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def countdown_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("countdown")
    assert run_prepare("countdown", "--out", out, "--num-samples", 300, "--test-size", 60, "--seed", 5) == 0
    return out


def test_countdown_files_hold_distinct_solvable_problems_in_verl_layout(countdown_dir):
    train, test = read_rows(countdown_dir / "train.parquet"), read_rows(countdown_dir / "test.parquet")
    assert len(train) == 300 and len(test) == 60
    keys = [(tuple(sorted(r["reward_model"]["ground_truth"]["numbers"])), r["reward_model"]["ground_truth"]["target"])
            for r in train + test]
    assert len(set(keys)) == 360  # no duplicates, so none shared between the splits
    for split, rows in (("train", train), ("test", test)):
        for index, row in enumerate(rows):
            truth = row["reward_model"]["ground_truth"]
            assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            assert row["data_source"] == "countdown" and row["reward_model"]["style"] == "rule"
            assert isinstance(truth["target"], int) and 1 <= truth["target"] <= 100
            assert 3 <= len(truth["numbers"]) <= 4 and all(1 <= n <= 99 for n in truth["numbers"])
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == index
            assert f"numbers {truth['numbers']}" in row["prompt"] and f"equals {truth['target']}" in row["prompt"]
    assert {len(r["reward_model"]["ground_truth"]["numbers"]) for r in train} == {3, 4}
    for row in train[:40] + test[:20]:  # a sample, searched exhaustively (4 numbers: a few thousand expressions)
        assert solvable(row["reward_model"]["ground_truth"]["numbers"], row["reward_model"]["ground_truth"]["target"])


def test_generated_expressions_reach_their_targets_and_earn_full_reward(countdown_dir):
    for row in read_rows(countdown_dir / "train.parquet")[:50]:
        truth, expression = row["reward_model"]["ground_truth"], row["extra_info"]["reference_expression"]
        assert sorted(int(n) for n in expression.replace("(", " ").replace(")", " ").split() if n.isdigit()) \
            == sorted(truth["numbers"])
        assert re.fullmatch(r"[\d+\-*/() ]+", expression)  # safe to eval
        assert eval(expression) == pytest.approx(truth["target"], abs=1e-5)
        # What the countdown reward reads: the prompt (with its "Assistant:" marker) followed by a response.
        response = f" I combine them.</think>\n<answer>{expression}</answer>"
        assert rewards.score("countdown", row["prompt"] + response, truth) == 1.0


def test_countdown_templates_seeds_and_operand_counts(tmp_path):
    base, instruct, other_seed = tmp_path / "base", tmp_path / "instruct", tmp_path / "other"
    common = ["--num-samples", 20, "--test-size", 0, "--num-operands", 4]
    assert run_prepare("countdown", "--out", base, *common) == 0
    assert run_prepare("countdown", "--out", instruct, *common, "--template", "qwen-instruct") == 0
    assert run_prepare("countdown", "--out", other_seed, *common, "--seed", 1) == 0
    assert not (base / "test.parquet").exists()
    base_rows, instruct_rows = read_rows(base / "train.parquet"), read_rows(instruct / "train.parquet")
    assert [r["reward_model"] for r in base_rows] == [r["reward_model"] for r in instruct_rows]  # same seed
    other_rows = read_rows(other_seed / "train.parquet")
    assert [r["reward_model"] for r in base_rows] != [r["reward_model"] for r in other_rows]
    assert all(len(r["reward_model"]["ground_truth"]["numbers"]) == 4 for r in base_rows)
    prompt = base_rows[0]["prompt"]
    assert prompt.startswith("A conversation between User and Assistant.") and "\nUser: " in prompt
    assert prompt.endswith("\nAssistant: " + OPENING) and "<answer>" in prompt and "</answer>" in prompt
    prompt = instruct_rows[0]["prompt"]
    assert prompt.startswith("<|im_start|>system\n") and "<|im_end|>\n<|im_start|>user\n" in prompt
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n" + OPENING)
    truth = instruct_rows[0]["reward_model"]["ground_truth"]
    response = f"</think>\n<answer>{instruct_rows[0]['extra_info']['reference_expression']}</answer>"
    assert rewards.score("countdown", prompt + response, truth) == 1.0  # the reward finds the assistant marker


def test_countdown_files_load_for_training(countdown_dir):
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)  # every letter is <unk>: lengths are what count
    cfg = DataConfig(train_files=[str(countdown_dir / "train.parquet")],
                     val_files=[str(countdown_dir / "test.parquet")], train_batch_size=8, max_prompt_length=1024)
    batch = build_prompt_loader(cfg, tokenizer, seed=0).next_batch()
    assert all(set(truth) == {"target", "numbers"} for truth in (p.ground_truth for p in batch))
    assert all(p.extra_info["split"] == "train" for p in batch)
    assert len(build_prompt_loader(cfg, tokenizer, seed=0, split="val").next_batch()) == 60


def test_impossible_request_is_reported():
    with pytest.raises(ValueError, match="found only .* distinct countdown problems"):
        generate_countdown_problems(50, [2], seed=0, max_number=2, max_target=3)


GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A car costs $1,200 more than 30. How much?", "answer": "1200 + 30 = 1230\n#### 1,230"},
]
MATH = [
    {"problem": "What is 1/2 + 0?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
    {"problem": "Simplify.", "solution": "First \\boxed{2}, then $\\boxed{\\{x \\mid x^{2} > 1\\}}$ at last."},
    {"problem": "No boxed answer here.", "solution": "The answer is 3."},
]


def test_gsm8k_jsonl_becomes_chat_prompts_with_the_final_answer(tmp_path, capsys):
    source = tmp_path / "gsm8k_test.jsonl"
    source.write_text("\n".join(json.dumps(record) for record in GSM8K) + "\n")
    assert run_prepare("gsm8k", "--input", source, "--out", tmp_path / "out") == 0
    rows = read_rows(tmp_path / "out" / "test.parquet")  # the split comes from the file name
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["7", "1230"]
    assert rows[0]["data_source"] == "openai/gsm8k"
    assert rows[0]["prompt"] == [{"role": "user", "content": GSM8K[0]["question"] + ' Let\'s think step by step, '
                                  'and write the final answer after "####".'}]
    assert rows[1]["extra_info"] == {"split": "test", "index": 1, "question": GSM8K[1]["question"],
                                     "answer": GSM8K[1]["answer"]}
    assert "wrote" in capsys.readouterr().out


def test_math_parquet_takes_the_last_balanced_boxed_answer(tmp_path, capsys):
    source = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(MATH), source)
    assert run_prepare("math", "--input", source, "--out", tmp_path / "out", "--split", "train") == 0
    rows = read_rows(tmp_path / "out" / "train.parquet")
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["\\frac{1}{2}", "\\{x \\mid x^{2} > 1\\}"]
    assert rows[0]["prompt"][0]["content"].endswith("final answer within \\boxed{}.")
    assert rewards.score(rows[0]["data_source"], "so \\boxed{0.5}", rows[0]["reward_model"]["ground_truth"]) == 1.0
    assert "skipped 1 records whose solution has no final answer" in capsys.readouterr().out


@pytest.mark.parametrize("command, content, expected", [
    ("gsm8k", '{"question": "q", "answer": "#### 1"}\n{"question": "q2"}\n', "row 1 (0-based), column 'answer'"),
    ("gsm8k", '{"question": "q", "answer": "#### 1"}\nnot json\n', "line 2 is not JSON"),
    ("math", '{"problem": 5, "solution": "\\\\boxed{1}"}\n', "row 0 (0-based), column 'problem'"),
    ("math", '{"problem": "p", "solution": "no box"}\n', "no record has a final answer"),
])
def test_bad_input_records_are_named(tmp_path, capsys, command, content, expected):
    source = tmp_path / "train.jsonl"
    source.write_text(content)
    assert run_prepare(command, "--input", source, "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --input: file '{source}'") and expected in err


def test_split_must_be_given_when_the_file_name_does_not_tell(tmp_path, capsys):
    source = tmp_path / "gsm8k.jsonl"
    source.write_text(json.dumps(GSM8K[0]) + "\n")
    assert run_prepare("gsm8k", "--input", source, "--out", tmp_path / "out") == 2
    assert "--split train or --split test" in capsys.readouterr().err
    assert run_prepare("gsm8k", "--input", tmp_path / "absent.jsonl", "--out", tmp_path / "out") == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_and_argument_errors_from_the_command_line(capsys):
    """argparse ends the command (SystemExit) with its exit code: 0 after --help, 2 for a bad argument."""
    with pytest.raises(SystemExit) as helped:
        main(["countdown", "--help"])
    out = capsys.readouterr().out
    assert helped.value.code == 0 and "--num-operands" in out and "qwen-instruct" in out
    with pytest.raises(SystemExit) as bad:
        main(["countdown", "--out", "x", "--num-operands", "1..4"])
    assert bad.value.code == 2 and "need 2 <= LOW <= HIGH" in capsys.readouterr().err
