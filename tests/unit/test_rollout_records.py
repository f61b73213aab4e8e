"""trainer.rollout_data_dir (rl_megatron/trainer/rollout_records.py): hand-built samples of a step, trained in
another order than generated, come out as exact JSON lines, prompt-major; a resumed run's folder loses the steps
after its checkpoint."""
import json
import os

import pytest
import torch
from helpers.runs import REPO

from rl_megatron.batch import AgentStats, Sample, SampleStatus, ToolStats, TrainBatch
from rl_megatron.models.tokenizer import load_tokenizer
from rl_megatron.trainer.rewards import Rewards
from rl_megatron.trainer.rollout_records import RolloutRecords, step_file

DIGITS = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")  # <pad> 0, <bos> 1, <eos> 2, "0".."9" 4..13
ANSWER_MESSAGES = [{"role": "user", "content": "3+5="}, {"role": "assistant", "content": "8"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DIGITS)


def samples_as_generated(tokenizer) -> list[Sample]:
    """Two prompts' two samples each: a plain answer, a partial rollout's, a multi-turn episode of a user's agent,
    one too stale to train."""
    def ids(text):
        return tokenizer.encode(text)

    first, second = ids("3+4="), ids("3+5=")
    return [
        Sample(first, [11, 2], [-0.1, -0.2], "arithmetic", "7", policy_version=2),  # "7" then <eos>
        Sample(first, [12, 5], [-0.5, -0.5], "arithmetic", "7", status=SampleStatus.TRUNCATED, token_versions=[1, 2]),
        Sample(second, [12, 17, 12, 2], [-0.1, 0.0, 0.0, -0.2], "arithmetic", "8", loss_mask=[1, 0, 0, 1], turns=2,
               policy_version=2, messages=ANSWER_MESSAGES, tool_stats=ToolStats(calls=1, tokens=2, by_tool={"calc": 1}),
               agent_reward=1.0, agent_stats=AgentStats(calls=2, seconds=0.5)),
        Sample(second, [4], [-0.3], "arithmetic", "8", loss_mask=[0], status=SampleStatus.ABORTED,
               error="3 policy versions old, past trainer.rollout_staleness=1"),
    ]


def test_a_steps_samples_as_json_lines_in_the_order_generated(tokenizer, tmp_path):
    generated = samples_as_generated(tokenizer)
    order = [3, 0, 2, 1]  # trained row i is generated sample order[i] (trainer.balance_batch)
    samples = [generated[i] for i in order]
    rewards = Rewards(scores=torch.tensor([0.0, 1.0, 0.75, -0.25]), acc=torch.tensor([0.0, 1.0, 1.0, 0.0]),
                      penalty=torch.tensor([0.0, 0.0, -0.25, -0.25]), stats={})
    for sample, score in zip(samples, rewards.scores.tolist()):
        sample.reward = score  # as the trainer sets it
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    # Per token, 0 outside the mask; the episode's vary over its two trained tokens (a token-level estimator's).
    per_token = {0: [9.0], 1: [0.5, 0.5], 2: [2.0, 9.0, 9.0, 1.0], 3: [-0.5, -0.5]}
    batch.advantages = torch.zeros_like(batch.response_mask)
    for row, values in per_token.items():
        start = len(samples[row].prompt_ids) - 1
        batch.advantages[row, start:start + len(values)] = torch.tensor(values) * batch.response_mask[
            row, start:start + len(values)]

    with RolloutRecords(str(tmp_path), tokenizer, purge_after=-1) as records:
        records.write(7, samples, order, rewards, batch)
    common = {"step": 7, "data_source": "arithmetic"}
    expected = [
        {**common, "prompt": "3+4=", "response": "7", "score": 1.0, "ground_truth": "7", "acc": 1.0,
         "overlong_penalty": 0.0, "advantage": 0.5, "status": "ok", "model_tokens": 2, "policy_version": 2,
         "turns": 1},
        {**common, "prompt": "3+4=", "response": "81", "score": -0.25, "ground_truth": "7", "acc": 0.0,
         "overlong_penalty": -0.25, "advantage": -0.5, "status": "truncated", "model_tokens": 2, "policy_version": 1,
         "token_versions": [1, 2], "turns": 1},
        {**common, "prompt": "3+5=", "response": "8 8", "score": 0.75, "ground_truth": "8", "acc": 1.0,
         "overlong_penalty": -0.25, "agent_reward": 1.0, "advantage": 1.5, "status": "ok", "model_tokens": 2,
         "policy_version": 2, "turns": 2, "messages": ANSWER_MESSAGES,
         "tool_stats": {"calls": 1, "errors": 0, "timeouts": 0, "tokens": 2, "seconds": 0.0, "slot_wait_seconds": 0.0,
                        "by_tool": {"calc": 1}},
         "agent_stats": {"calls": 2, "prefix_breaks": 0, "segments": 1, "seconds": 0.5,
                         "failed": False, "metrics": {}}},
        {**common, "prompt": "3+5=", "response": "0", "score": 0.0, "ground_truth": "8", "acc": 0.0,
         "overlong_penalty": 0.0, "advantage": None, "status": "aborted", "model_tokens": 0, "policy_version": 0,
         "turns": 1, "error": "3 policy versions old, past trainer.rollout_staleness=1"},
    ]
    with open(step_file(str(tmp_path), 7)) as f:
        assert f.read().splitlines() == [json.dumps(record) for record in expected]
    assert os.listdir(tmp_path) == ["7.jsonl"]  # no temporary file left


def test_without_reward_shaping_a_record_has_no_penalty(tokenizer, tmp_path):
    samples = samples_as_generated(tokenizer)[:1]
    samples[0].reward = 1.0
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    batch.advantages = batch.response_mask.clone()
    with RolloutRecords(str(tmp_path), tokenizer, purge_after=-1) as records:
        records.write(1, samples, [0], Rewards(torch.tensor([1.0]), torch.tensor([1.0]), None, {}), batch)
    with open(step_file(str(tmp_path), 1)) as f:
        [record] = [json.loads(line) for line in f]
    assert "overlong_penalty" not in record and record["advantage"] == 1.0


@pytest.mark.parametrize("purge_after, kept", [
    (-1, []),  # a run that starts over
    (2, ["1.jsonl", "2.jsonl"]),  # resumed from the checkpoint at step 2: steps 3 and 10 are written again
    (None, ["1.jsonl", "10.jsonl", "2.jsonl", "3.jsonl"]),  # a validation-only run
])
def test_the_steps_after_the_resumed_checkpoint_go(tmp_path, purge_after, kept):
    for name in ("1.jsonl", "2.jsonl", "3.jsonl", "10.jsonl", "notes.txt", "3.jsonl.tmp"):
        (tmp_path / name).write_text("{}\n")
    with RolloutRecords(str(tmp_path), None, purge_after):
        pass
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "notes.txt", "3.jsonl.tmp"])


def test_without_a_folder_nothing_is_decoded_or_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with RolloutRecords(None, None, purge_after=-1) as records:
        records.write(1, [], [], None, None)
    assert os.listdir(tmp_path) == []
