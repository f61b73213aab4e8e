"""The training command as a user runs it: `python -m rl_megatron.train --config configs/NAME.yaml key=value ...`
from the repository's root, in a process of its own."""
import json
import os
import subprocess
import sys
import time

from rl_megatron.checkpoint.run import LATEST_FILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Wall-clock figures differ between runs; everything else must not.
UNTIMED = ("timing_s/", "perf/", "agent/episode_s", "tool/seconds/", "tool/slot_wait_s/")


def train_command(tmp_path, *overrides, config="demo_cpu") -> list[str]:
    """The command, with its outputs under `tmp_path`."""
    return [sys.executable, "-m", "rl_megatron.train", "--config", f"configs/{config}.yaml",
            f"trainer.log_dir={tmp_path}", "trainer.progress_bar=false", *overrides]


def train(tmp_path, *overrides, timeout=600, config="demo_cpu", env=None):
    """Run it with its outputs under `tmp_path` (`env`: variables added to the environment); it must succeed.
    Returns (stdout, metrics.jsonl rows, run folder)."""
    cmd = train_command(tmp_path, *overrides, config=config)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = os.path.join(tmp_path, os.path.basename(config))  # configs name their run after the file
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return done.stdout, rows, run_dir


def read_rows(log_dir, experiment: str) -> dict[int, dict]:
    """A run's metrics.jsonl by step; each step must be logged once."""
    with open(os.path.join(log_dir, experiment, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len({r["step"] for r in rows}) == len(rows), "a step was logged twice"
    return {r["step"]: r for r in rows}


def read_rows_if_any(log_dir, experiment: str) -> dict[int, dict]:
    """read_rows of a run that may not have logged yet (or is writing a line)."""
    try:
        return read_rows(log_dir, experiment)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def latest_checkpoint(log_dir, experiment: str) -> int | None:
    """The step of a run's newest complete checkpoint, None before its first."""
    path = os.path.join(log_dir, experiment, "checkpoints", LATEST_FILE)
    return int(open(path).read()) if os.path.exists(path) else None


def start_until(cmd: list[str], until, timeout: float = 300, **popen) -> subprocess.Popen:
    """Start `cmd` from the repository's root (`popen`: Popen's options) and return once `until()` holds, the process
    still running; fails with the end of its output if it ends first, or after `timeout` seconds."""
    process = subprocess.Popen(cmd, cwd=REPO, text=True, **popen)
    deadline = time.monotonic() + timeout
    while not until():
        if process.poll() is not None:
            out, err = process.communicate()
            raise AssertionError(f"the run ended (exit code {process.returncode}) first: {(out or '') + (err or '')}"
                                 [-4000:])
        assert time.monotonic() < deadline, f"the run did not get there in {timeout} s"
        time.sleep(0.05)
    return process


def assert_same_metrics(expected: dict, actual: dict, tolerance: float) -> None:
    """Two runs' records of one step agree, timings aside."""
    keys = {k for k in expected if not k.startswith(UNTIMED)}
    assert keys == {k for k in actual if not k.startswith(UNTIMED)}
    assert all(abs(expected[k] - actual[k]) <= tolerance for k in keys), \
        {k: (expected[k], actual[k]) for k in keys if abs(expected[k] - actual[k]) > tolerance}
