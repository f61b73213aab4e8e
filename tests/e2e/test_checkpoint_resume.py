"""Checkpoints through the user's command, on the PPO demo with a critic, a reference (saved: it is randomly
initialised) and an adaptive in-reward KL coefficient: a run killed with SIGKILL and started again continues
exactly as if never stopped; a run resumed at another parallel layout reproduces the next step; SIGTERM stops a
run cleanly with a checkpoint; damaged checkpoints are refused, and `resume=auto` falls back past them."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from helpers.runs import REPO, assert_same_metrics, start_until as run_until, train
from rl_megatron.checkpoint import CheckpointError
from rl_megatron.checkpoint.run import (LATEST_FILE, CheckpointWarning, choose_resume, finish_save, saved_steps,
                                        start_save, step_dir)
from rl_megatron.models.hf_config import read_hf_config

CONFIG = "demo_cpu_ppo"
RUN = ("trainer.target_reward=null", "trainer.save_every=2", "algorithm.use_kl_in_reward=true",
       "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_ctrl.target_kl=0.01",
       "algorithm.kl_ctrl.horizon=1000", "actor.use_kl_loss=true", "trainer.progress_bar=false")
ROLES = ("actor", "critic", "ref")


def command(log_dir, *overrides) -> list[str]:
    return [sys.executable, "-m", "rl_megatron.train", "--config", f"configs/{CONFIG}.yaml",
            f"trainer.log_dir={log_dir}", *RUN, *overrides]


def read_rows(log_dir) -> dict[int, dict]:
    with open(os.path.join(log_dir, CONFIG, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len({r["step"] for r in rows}) == len(rows), "a step was logged twice"
    return {r["step"]: r for r in rows}


def start_until(log_dir, until, *overrides) -> subprocess.Popen:
    """The trainer in its own process group, returned once `until()` holds (the process still runs)."""
    return run_until(command(log_dir, *overrides), until, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     start_new_session=True)


def latest(log_dir) -> int | None:
    path = os.path.join(log_dir, CONFIG, "checkpoints", LATEST_FILE)
    return int(open(path).read()) if os.path.exists(path) else None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Four steps without interruption, saved at steps 2 and 4."""
    log_dir = tmp_path_factory.mktemp("uninterrupted")
    train(log_dir, *RUN, "trainer.total_steps=4", config=CONFIG)
    return log_dir


def test_a_killed_run_continues_exactly_where_it_stopped(uninterrupted, tmp_path):
    expected = read_rows(uninterrupted)
    # Every PPO stage ran and reported, and the trainer and vLLM computed the same distribution.
    assert all(r["critic/vf_loss"] > 0 and r["critic/grad_norm"] > 0 and r["actor/grad_norm"] > 0
               for r in expected.values())
    assert max(r["mismatch/token_mult_prob_error"] for r in expected.values()) <= 1.001
    # The in-reward KL penalty: zero before the policy moves (the reference is the initial policy), then positive;
    # its adaptive coefficient shrinks while the KL is below target (by at most 20% a step).
    assert expected[1]["actor/reward_kl_penalty"] == 0.0 and expected[3]["actor/reward_kl_penalty"] > 0
    coefs = [expected[step]["actor/reward_kl_penalty_coeff"] for step in sorted(expected)]
    assert coefs[0] == 0.1 and 0.08 <= coefs[1] < coefs[0]
    checkpoints = os.path.join(uninterrupted, CONFIG, "checkpoints")
    assert saved_steps(checkpoints) == [4, 2] and latest(uninterrupted) == 4
    assert sorted(os.listdir(step_dir(checkpoints, 2))) == ["actor", "config.yaml", "critic", "ref", "rng",
                                                            "trainer_state.json"]

    # Killed (the whole process tree, like a lost node) once step 2's checkpoint is complete.
    killed = start_until(tmp_path, lambda: latest(tmp_path) == 2, "trainer.total_steps=4")
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    # The same command again.
    stdout, rows, _ = train(tmp_path, *RUN, "trainer.total_steps=4", config=CONFIG)
    assert f"Resumed from {step_dir(os.path.join(tmp_path, CONFIG, 'checkpoints'), 2)} (step 2)" in stdout
    rows = read_rows(tmp_path)
    assert sorted(rows) == [1, 2, 3, 4]
    for step in (3, 4):
        assert_same_metrics(expected[step], rows[step], tolerance=1e-6)


def test_resuming_at_another_layout_reproduces_the_next_step_and_sigterm_saves(uninterrupted, tmp_path):
    """Saved at TP=2 in two workers, resumed at TP=1 x PP=2; stopped by SIGTERM once step 3 is logged."""
    expected = read_rows(uninterrupted)
    resume = step_dir(os.path.join(uninterrupted, CONFIG, "checkpoints"), 2)
    running = start_until(tmp_path, lambda: 3 in read_rows_if_any(tmp_path), "trainer.total_steps=50",
                          f"trainer.resume={resume}", "actor.tensor_model_parallel_size=1",
                          "actor.pipeline_model_parallel_size=2")
    running.send_signal(signal.SIGTERM)  # to the trainer only, as a scheduler's preemption notice
    output = running.communicate(timeout=300)[0]
    assert running.returncode == 0, output[-4000:]
    assert "saved under another parallel layout" in output
    last = max(read_rows(tmp_path))
    assert f"Stopped by SIGTERM after step {last}" in output
    assert latest(tmp_path) == last and saved_steps(os.path.join(tmp_path, CONFIG, "checkpoints")) == [last]
    assert_same_metrics(expected[3], read_rows(tmp_path)[3], tolerance=1e-5)


def read_rows_if_any(log_dir) -> dict[int, dict]:
    try:
        return read_rows(log_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@pytest.fixture
def checkpoints(uninterrupted, tmp_path):
    """A copy of the uninterrupted run's checkpoints (steps 2 and 4) to damage, and the model's config."""
    root = shutil.copytree(os.path.join(uninterrupted, CONFIG, "checkpoints"), tmp_path / "checkpoints")
    return str(root), read_hf_config(os.path.join(REPO, "configs", "models", "tiny-qwen2-digits"))


def truncate_a_shard(folder):
    shard = os.path.join(folder, "critic", "__0_0.distcp")
    os.truncate(shard, os.path.getsize(shard) // 2)
    return shard


@pytest.mark.parametrize("damage", ["truncated shard", "missing shard", "missing trainer state", "no pointer target"])
def test_auto_resume_falls_back_past_a_damaged_checkpoint(checkpoints, damage):
    root, hf = checkpoints
    newest = step_dir(root, 4)
    if damage == "truncated shard":
        what = truncate_a_shard(newest)
    elif damage == "missing shard":
        what = os.path.join(newest, "actor", "__1_0.distcp")
        os.remove(what)
    elif damage == "missing trainer state":
        what = os.path.join(newest, "trainer_state.json")
        os.remove(what)
    else:  # a crash between the step folder's removal and the pointer's update cannot happen; a hand edit can
        shutil.rmtree(newest)
        what = "names step 4"
    with pytest.warns(CheckpointWarning, match="older checkpoint") as warned:
        folder, state = choose_resume(root, "auto", hf, ROLES)
    assert folder == step_dir(root, 2) and state["step"] == 2
    message = next(str(w.message) for w in warned if w.category is CheckpointWarning)
    assert what in message


def test_a_damaged_or_foreign_checkpoint_is_refused_naming_path_and_problem(checkpoints):
    root, hf = checkpoints
    shard = truncate_a_shard(step_dir(root, 2))
    with pytest.raises(CheckpointError, match=f"'{shard}' is truncated"):
        choose_resume(root, step_dir(root, 2), hf, ROLES)  # an explicit path: no fallback
    with pytest.raises(CheckpointError, match="vocab_size: checkpoint 18, model 20.*trainer.resume=off"):
        choose_resume(root, "auto", dict(hf, vocab_size=20), ROLES)  # no step fits: nothing is deleted
    assert saved_steps(root) == [4, 2]
    with pytest.raises(CheckpointError, match="saved at actor.expert_model_parallel_size=1.*model.checkpoint="):
        choose_resume(root, step_dir(root, 4), hf, ROLES, expert_parallel=2)
    with pytest.raises(CheckpointError, match="holds weights only"):
        metadata = os.path.join(step_dir(root, 4), "critic", "rl_megatron_checkpoint.json")
        with open(metadata) as f:
            edited = dict(json.load(f), training_state=False)
        with open(metadata, "w") as f:
            json.dump(edited, f)
        choose_resume(root, step_dir(root, 4), hf, ROLES)
    assert choose_resume(root, "off", hf, ROLES) is None


def test_saves_are_atomic_and_only_the_newest_are_kept(tmp_path):
    """Folders without workers' parts: the controller's side of a save (rename, pointer, pruning)."""
    root = str(tmp_path)
    for step in (1, 2, 3):
        start_save(root, step)
        finish_save(root, step, {"data_loader": {}}, "trainer: {}\n", keep_last=2)
    assert saved_steps(root) == [3, 2]
    assert open(os.path.join(root, LATEST_FILE)).read() == "3\n"
    start_save(root, 4)  # a save interrupted here leaves a partial folder that nothing reads...
    assert saved_steps(root) == [3, 2] and os.path.isdir(step_dir(root, 4) + ".incomplete")
    start_save(root, 5)
    finish_save(root, 5, {}, "", keep_last=0)  # ...and the next save removes
    assert saved_steps(root) == [5, 3, 2] and not os.path.exists(step_dir(root, 4) + ".incomplete")
