"""Runs that die, as users meet them: the controller SIGKILLed before its first checkpoint leaves no process behind,
and the same command then starts the run's records afresh (no step logged twice); a worker killed mid-run stops
the controller with a report (which role, rank and node, why, its log, the checkpoint to resume from) and exit
code 3. Workers killed by Ray's memory monitor are reported as out of memory, with the node's figures."""
import json
import os
import re
import subprocess
import sys

import psutil

from helpers.runs import REPO, start_until as run_until
from rl_megatron.checkpoint.run import LATEST_FILE
from rl_megatron.train import WORKER_DIED

RUN = ("trainer.total_steps=4", "trainer.save_every=3", "trainer.target_reward=null", "trainer.progress_bar=false")


def start_until(log_dir, until) -> subprocess.Popen:
    """The demo's command, returned once `until()` holds (the run still going)."""
    return run_until([sys.executable, "-m", "rl_megatron.train", "--config", "configs/demo_cpu.yaml",
                      f"trainer.log_dir={log_dir}", *RUN], until, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def logged_steps(log_dir) -> list[int]:
    try:
        with open(os.path.join(log_dir, "demo_cpu", "metrics.jsonl")) as f:
            return [json.loads(line)["step"] for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def latest(log_dir) -> int | None:
    path = os.path.join(log_dir, "demo_cpu", "checkpoints", LATEST_FILE)
    return int(open(path).read()) if os.path.exists(path) else None


def test_a_killed_controller_and_a_dead_worker(tmp_path):
    # 1. The controller alone is SIGKILLed after step 1, before the first checkpoint (step 3).
    run = start_until(tmp_path, lambda: 1 in logged_steps(tmp_path))
    tree = psutil.Process(run.pid).children(recursive=True)  # local Ray, its agents, workers, scorers, the reaper
    assert any(p.name().startswith("ray::HybridWorker") for p in tree)
    run.kill()
    run.communicate()
    assert latest(tmp_path) is None
    _, alive = psutil.wait_procs(tree, timeout=20)
    assert not alive, f"still running 20 s after the controller was killed: {alive}"

    # 2. The same command starts over (nothing to resume): its records too. A worker dies after step 3's checkpoint.
    run = start_until(tmp_path, lambda: latest(tmp_path) == 3)
    victim = max((p for p in psutil.Process(run.pid).children(recursive=True)
                  if p.name().startswith("ray::HybridWorker")), key=lambda p: p.pid)
    victim.kill()
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == WORKER_DIED, stderr[-4000:]
    report = stderr[stderr.index("error: "):]
    assert "error: The actor+rollout worker rank" in report and f"pid {victim.pid}) died: its process was killed" \
        in report and "node 0 = " in report, report
    # Its log in the run's folder, named, with its last lines (every worker writes some while it starts).
    assert re.search(r"Last lines of its log \S+/demo_cpu/logs/worker_actor_[01]\.log:\n    \S", report), report
    assert "The last checkpoint is step 3" in report and "the same command resumes from it" in report, report
    assert "Traceback" not in report and "Unhandled error" not in report, report
    # Started afresh: step 1 of the killed run is gone. (The same command then resumes from step 3's checkpoint,
    # logging each step once: test_checkpoint_resume.py's killed run shows that.)
    assert logged_steps(tmp_path) in ([1, 2, 3], [1, 2, 3, 4])  # step 4 may be logged before the worker died


def test_a_worker_killed_for_memory_is_said_so_with_the_figures(tmp_path):
    """Ray's own memory monitor, set to a threshold this machine is already above, kills the workers as they
    start: the report says so plainly, with the node's figures, and the exit code is a dead worker's."""
    env = dict(os.environ, RAY_memory_usage_threshold="0.01", RAY_memory_monitor_refresh_ms="200")
    done = subprocess.run([sys.executable, "-m", "rl_megatron.train", "--config", "configs/demo_cpu.yaml",
                           f"trainer.log_dir={tmp_path}", *RUN], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == WORKER_DIED, done.stderr[-4000:]
    report = done.stderr[done.stderr.index("error: "):]
    assert "error: The actor+rollout worker rank" in report and "died: Ray's memory monitor killed it" in report
    assert re.search(r"the node was running out of memory \(node [\d.]+: [\d.]+GB used / [\d.]+GB limit\)", report)
    assert "No checkpoint was saved yet" in report and "Traceback" not in report, report
