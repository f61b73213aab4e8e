"""Validation summaries: rewards and pass@n per data source, and the table of samples the loggers show."""
import json

import torch

from rl_megatron.trainer.validation import Generation, Validation, validation_metrics


def test_reward_mean_accuracy_and_pass_at_n_per_data_source():
    # Three prompts x 2 samples: gsm8k prompt 0 solved once, countdown prompt 1 only format credit (0.1),
    # gsm8k prompt 2 never solved. A scorer returning a number: its accuracy is its score.
    scores = torch.tensor([1.0, 0.0, 0.1, 0.1, 0.0, 0.0])
    metrics = validation_metrics(["gsm8k", "countdown", "gsm8k"], scores, scores, n=2)
    assert metrics == {"val/countdown/reward_mean": torch.tensor(0.1).item(), "val/countdown/acc": 0.0,
                       "val/countdown/pass@2": 0.0,
                       "val/gsm8k/reward_mean": 0.25, "val/gsm8k/acc": 0.25, "val/gsm8k/pass@2": 0.5}


def test_dapo_validation_accuracy_is_the_share_solved():
    """DAPO scores ±1 with acc 0/1: 3 of 4 solved is reward_mean 0.5 (2p - 1) and acc 0.75 (p)."""
    scores, acc = torch.tensor([1.0, 1.0, -1.0, 1.0]), torch.tensor([1.0, 1.0, 0.0, 1.0])
    metrics = validation_metrics(["math_dapo", "math_dapo"], scores, acc, n=2)
    assert metrics == {"val/math_dapo/reward_mean": 0.5, "val/math_dapo/acc": 0.75, "val/math_dapo/pass@2": 1.0}


def test_greedy_validation_has_no_pass_at_k():
    values = torch.tensor([1.0, 0.0])
    assert validation_metrics(["a", "a"], values, values, n=1) == {"val/a/reward_mean": 0.5, "val/a/acc": 0.5}


def test_the_table_keeps_the_first_samples_and_the_jsonl_every_sample(tmp_path):
    validation = Validation(3, {"val/s/reward_mean": 0.625}, [Generation("s", "a", "x\ny", 1.0),
                                                               Generation("s", "b", "z", 0.25)])
    assert validation.table_rows(1) == [["a", "x\ny", 1.0]]
    path = tmp_path / "validation" / "step_3.jsonl"
    validation.write_jsonl(str(path))
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"data_source": "s", "prompt": "a", "response": "x\ny", "score": 1.0},
        {"data_source": "s", "prompt": "b", "response": "z", "score": 0.25}]
