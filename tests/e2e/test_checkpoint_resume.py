"""Checkpoints and runs that die, through the user's command, on the PPO demo with a critic, a reference (saved: it is
randomly initialised) and an adaptive in-reward KL coefficient: a run that finds only the records of one killed
before its first checkpoint starts them afresh; a controller SIGKILLed mid-run leaves no process behind (the reaper),
and the same command continues exactly as if never stopped; a run resumed at another parallel layout reproduces the
next steps; a worker killed mid-run stops the controller with a report (which role, rank and node, why, its log,
the checkpoint to resume from) and exit code 3; SIGTERM stops a run cleanly with a checkpoint; damaged checkpoints
are refused, and `resume=auto` falls back past them. (Workers killed by Ray's memory monitor:
tests/e2e/test_memory_killed_worker.py.)"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

from helpers import runs
from helpers.runs import REPO, assert_same_metrics, start_until as run_until, train
from rl_megatron.checkpoint import CheckpointError
from rl_megatron.checkpoint.run import (LATEST_FILE, CheckpointWarning, choose_resume, finish_save, saved_steps,
                                        start_save, step_dir)
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.train import WORKER_DIED

CONFIG = "demo_cpu_ppo"
RUN = ("trainer.target_reward=null", "trainer.save_every=2", "algorithm.use_kl_in_reward=true",
       "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_ctrl.target_kl=0.01",
       "algorithm.kl_ctrl.horizon=1000", "actor.use_kl_loss=true", "trainer.progress_bar=false")
ROLES = ("actor", "critic", "ref")


def command(log_dir, *overrides) -> list[str]:
    return [sys.executable, "-m", "rl_megatron.train", "--config", f"configs/{CONFIG}.yaml",
            f"trainer.log_dir={log_dir}", *RUN, *overrides]


def read_rows(log_dir) -> dict[int, dict]:
    return runs.read_rows(log_dir, CONFIG)


def read_rows_if_any(log_dir) -> dict[int, dict]:
    return runs.read_rows_if_any(log_dir, CONFIG)


def start_until(log_dir, until, *overrides) -> subprocess.Popen:
    """The trainer in its own process group, returned once `until()` holds (the process still runs)."""
    return run_until(command(log_dir, *overrides), until, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     start_new_session=True)


def latest(log_dir) -> int | None:
    return runs.latest_checkpoint(log_dir, CONFIG)


def worker_processes(controller_pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(controller_pid).children(recursive=True)
            if p.name().startswith("ray::HybridWorker")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Four steps without interruption, saved at steps 2 and 4, started where a run killed before its first
    checkpoint left its records (steps 1-3, no checkpoint): nothing to resume, so they are started afresh."""
    log_dir = tmp_path_factory.mktemp("uninterrupted")
    os.makedirs(os.path.join(log_dir, CONFIG))
    with open(os.path.join(log_dir, CONFIG, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": step, "left_by_the_killed_run": 1.0}) + "\n" for step in (1, 2, 3))
    train(log_dir, *RUN, "trainer.total_steps=4", config=CONFIG)
    return log_dir


def test_a_killed_controller_is_reaped_and_the_same_command_continues_exactly(uninterrupted, tmp_path):
    expected = read_rows(uninterrupted)
    # The stale records of the run killed before its first checkpoint are gone: each step logged once, afresh.
    assert sorted(expected) == [1, 2, 3, 4] and not any("left_by_the_killed_run" in r for r in expected.values())
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

    # The controller alone is SIGKILLed once step 3 is logged (after step 2's checkpoint): its reaper takes down
    # the local Ray, its agents, the workers and the scorers.
    killed = start_until(tmp_path, lambda: 3 in read_rows_if_any(tmp_path), "trainer.total_steps=4")
    tree = psutil.Process(killed.pid).children(recursive=True)
    assert worker_processes(killed.pid)
    killed.kill()
    killed.communicate()
    assert latest(tmp_path) == 2
    _, alive = psutil.wait_procs(tree, timeout=20)
    assert not alive, f"still running 20 s after the controller was killed: {alive}"
    # The same command again: step 3's record (after the checkpoint) is dropped and logged again.
    stdout, rows, _ = train(tmp_path, *RUN, "trainer.total_steps=4", config=CONFIG)
    assert f"Resumed from {step_dir(os.path.join(tmp_path, CONFIG, 'checkpoints'), 2)} (step 2)" in stdout
    rows = read_rows(tmp_path)
    assert sorted(rows) == [1, 2, 3, 4]
    for step in (3, 4):
        assert_same_metrics(expected[step], rows[step], tolerance=1e-6)


def test_resumed_at_another_layout_a_dead_worker_is_reported_and_sigterm_saves(uninterrupted, tmp_path):
    """Saved at TP=2 in two workers, resumed at TP=1 x PP=2: the next step is reproduced. Once it has saved step 4
    (at the new layout), a worker is killed: the controller stops with a report. The same command then resumes from
    that checkpoint and is stopped by SIGTERM once step 5 is logged."""
    expected = read_rows(uninterrupted)
    resume = step_dir(os.path.join(uninterrupted, CONFIG, "checkpoints"), 2)
    layout = ("actor.tensor_model_parallel_size=1", "actor.pipeline_model_parallel_size=2", "trainer.total_steps=50")
    running = start_until(tmp_path, lambda: latest(tmp_path) == 4, f"trainer.resume={resume}", *layout)
    victim = max(worker_processes(running.pid), key=lambda p: p.pid)
    victim.kill()
    output = running.communicate(timeout=120)[0]
    assert running.returncode == WORKER_DIED, output[-4000:]
    assert "saved under another parallel layout" in output
    # Step 3 within rounding of another summation order (later steps drift further: clip fractions jump).
    assert_same_metrics(expected[3], read_rows(tmp_path)[3], tolerance=1e-5)
    report = output[output.index("error: "):]
    assert "error: The actor+rollout+ref+critic worker rank" in report and f"pid {victim.pid}) died: its process was " \
        "killed" in report and "node 0 = " in report, report
    # Its log in the run's folder, named, with its last lines (every worker writes some while it starts).
    assert re.search(rf"Last lines of its log \S+/{CONFIG}/logs/worker_actor_[01]\.log:\n    \S", report), report
    assert "The last checkpoint is step 4" in report and "the same command resumes from it" in report, report
    assert "Traceback" not in report and "Unhandled error" not in report, report

    running = start_until(tmp_path, lambda: 5 in read_rows_if_any(tmp_path), *layout)
    running.send_signal(signal.SIGTERM)  # to the trainer only, as a scheduler's preemption notice
    output = running.communicate(timeout=300)[0]
    assert running.returncode == 0, output[-4000:]
    assert f"Resumed from {step_dir(os.path.join(tmp_path, CONFIG, 'checkpoints'), 4)} (step 4)" in output
    last = max(read_rows(tmp_path))
    assert f"Stopped by SIGTERM after step {last}" in output
    assert latest(tmp_path) == last and saved_steps(os.path.join(tmp_path, CONFIG, "checkpoints"))[0] == last


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
