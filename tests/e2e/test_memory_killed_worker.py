"""Workers killed by Ray's memory monitor are reported as out of memory, with the node's figures. (A killed controller,
its reaper and a worker killed mid-run: tests/e2e/test_checkpoint_resume.py.)"""
import os
import re
import subprocess
import sys

from helpers.runs import REPO
from rl_megatron.train import WORKER_DIED

RUN = ("trainer.total_steps=4", "trainer.save_every=3", "trainer.target_reward=null", "trainer.progress_bar=false")


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
