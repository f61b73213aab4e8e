"""A real task end to end: countdown problems prepared as parquet (`python -m rl_megatron.data.prepare`), then
data -> chat prompt -> generate -> score (the countdown rules, in the reward pool) -> update -> validate, with
the tiny model given a text tokenizer. The reward need not rise in two steps; every stage must run. The vLLM
engine runs in a worker of its own here (rollout.placement=separate: weights broadcast from the actor's rank 0),
and the advantages are REINFORCE++'s."""
import os
import subprocess
import sys

import pytest

from helpers.runs import REPO, train


@pytest.fixture(scope="module")
def countdown_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("countdown")
    cmd = [sys.executable, "-m", "rl_megatron.data.prepare", "countdown", "--out", str(out), "--num-samples", "32",
           "--test-size", "4", "--template", "base"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return str(out)


def test_countdown_trains_and_validates(tmp_path, countdown_data):
    model = str(tmp_path / "tiny-text")
    subprocess.run([sys.executable, "-m", "rl_megatron.models.tiny", model, "--text"], cwd=REPO, check=True,
                   capture_output=True)
    stdout, rows, run_dir = train(
        tmp_path, f"model.path={model}", "data.task=null", f"data.train_files=[{countdown_data}/train.parquet]",
        f"data.val_files=[{countdown_data}/test.parquet]", "data.max_prompt_length=640", "rollout.max_tokens=16",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4", "rollout.n=2",
        "trainer.total_steps=2", "trainer.target_reward=null", "trainer.val_every=2", "trainer.val_before_train=true",
        "rollout.val_n=2", "rollout.placement=separate", "ray.num_cpus=3",
        "algorithm.adv_estimator=reinforce_plus_plus")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["reward/errors"] == 0 and r["reward/timeouts"] == 0 for r in steps)
    # Responses cut off at rollout.max_tokens=16 (a random model rarely samples its stop token) are 16 tokens long.
    for r in steps:
        clipped = r["response_length/clip_ratio"]
        assert r["response_length/max"] <= 16 and (clipped == 0 or r["response_length/max"] == 16)
        assert clipped < 1 or r["response_length/min"] == 16
    validations = [r for r in rows if "val/countdown/reward_mean" in r]
    assert [r["step"] for r in validations] == [0, 2]  # before training, and at the last step
    # pass@2 is the share of the 4 test prompts with a solved sample (not a share of their 8 samples)
    assert all(r["val/countdown/pass@2"] * 4 in (0, 1, 2, 3, 4) for r in validations)
    assert "data (train): 32 prompts" in stdout and "step 2 validation: val/countdown/reward_mean=" in stdout
    events = [f for f in os.listdir(run_dir) if f.startswith("events.out.tfevents")]
    with open(os.path.join(run_dir, events[0]), "rb") as f:
        assert b"val/generations" in f.read()  # the table of sample generations
