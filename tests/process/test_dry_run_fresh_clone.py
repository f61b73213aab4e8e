"""The dry run a new user tries first, run as they run it: `launch/train_3d.sh --dry-run` in a fresh clone (a copy
of the checkout's files, without data/, runs/ or any model folder), for a recipe whose model is not on the machine.
It prints the plan from the shipped config.json and starts nothing. tests/unit/test_dry_run.py plans every recipe the
same way in-process."""
import os
import shutil
import subprocess
import sys

from helpers.runs import REPO

LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "MASTER_ADDR", "GPUS_PER_NODE", "GPU_MEMORY_GIB", "CUDA_VISIBLE_DEVICES",
                    "RAY_DEBUG")


def fresh_clone(destination) -> None:
    """The files a clone of this checkout has once it is committed: tracked ones, and new ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    for path in filter(None, listed.split("\0")):
        if os.path.isfile(os.path.join(REPO, path)):  # a file deleted but not yet committed is listed too
            os.makedirs(destination / os.path.dirname(path), exist_ok=True)
            shutil.copy2(os.path.join(REPO, path), destination / path)


def test_the_first_dry_run_prints_the_plan_without_data_or_weights(tmp_path):
    clone = tmp_path / "rl_megatron"
    fresh_clone(clone)
    assert not (clone / "data").exists() and not os.path.exists("/models/Qwen3-30B-A3B")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
    env.update(NNODES="4", NODE_RANK="0", MASTER_ADDR="node0", GPUS_PER_NODE="8", PYTHON=sys.executable)
    done = subprocess.run(["launch/train_3d.sh", "--dry-run", "configs/moe/grpo_qwen3_30b_a3b.yaml",
                           "model.path=/models/Qwen3-30B-A3B", "model.random_init=true"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert ("Model: /models/Qwen3-30B-A3B (not on this machine: planned with configs/models/Qwen3-30B-A3B/config.json, "
            "shipped with rl_megatron), 30.5 B parameters") in out
    assert "nodes 0-3: actor pool, 4 x 8 = 32 GPUs" in out and "TP=2 PP=2 CP=1 EP=8 ETP=1 DP=8" in out
    assert "the data files, the tokenizer and the weights are checked when the run launches" in out
    assert out.rstrip().endswith("Dry run: nothing was started.") and not (clone / "runs").exists()
