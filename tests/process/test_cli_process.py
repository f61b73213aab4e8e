"""`python -m rl_megatron.train` in a process of its own, for what only a fresh process shows (every other bad input
is checked in-process, tests/unit/test_cli_errors.py): the exit code the shell gets, and that Ray never started for
bad input found as late as reading the data."""
import json
import subprocess
import sys
import time

from helpers.runs import REPO

DEMO = "configs/demo_cpu.yaml"
FAIL_FAST_S = 20  # a config error must be reported well before Ray (or Megatron, or vLLM) could start

# The entry point in a fresh interpreter, then what it left running: whether Ray is up in this process, and the
# processes it started (a local Ray's, the reaper). Written to the file named first, as stdout is the CLI's.
NEVER_STARTED = """import json, sys
import psutil
from rl_megatron.train import main
code = main(sys.argv[2:])
ray = sys.modules.get("ray")
with open(sys.argv[1], "w") as f:
    json.dump({"ray_initialized": bool(ray and ray.is_initialized()),
               "children": [p.name() for p in psutil.Process().children(recursive=True)]}, f)
sys.exit(code)
"""


def test_the_exit_code_of_bad_input_found_once_ray_runs():
    """ray.num_cpus=1: the local Ray starts with one CPU slot, too few for the actor's two; the process exits with
    code 2, the reason as its last line."""
    proc = subprocess.run([sys.executable, "-m", "rl_megatron.train", "--config", DEMO, "ray.num_cpus=1"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: The actor needs 2 CPU slots") and "ray.num_cpus" in last, proc.stderr


def test_a_data_source_without_a_scorer_fails_before_ray_starts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data, report = str(tmp_path / "odd.parquet"), tmp_path / "report.json"
    pq.write_table(pa.table({"data_source": ["my/odd_task"], "prompt": ["1+1="],
                             "reward_model": [{"ground_truth": "2"}], "extra_info": [{"index": 0}]}), data)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", NEVER_STARTED, str(report), "--config", DEMO, "data.task=null",
                           f"data.train_files=[{data}]"], cwd=REPO, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - start
    # Found once the data is read (its line is printed), before Ray or any worker starts.
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and seconds < FAIL_FAST_S, proc.stderr
    error, = proc.stderr.strip().splitlines()
    assert all(word in error for word in ("error: ", "'my/odd_task'", "reward.custom_fn", "countdown")), error
    assert proc.stdout.startswith("data (train): 1 prompts") and "Ray" not in proc.stdout + proc.stderr
    left = json.loads(report.read_text())
    assert left == {"ray_initialized": False, "children": []}, left
