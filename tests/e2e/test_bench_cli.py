"""Every hot-path benchmark runs and reports its figure against a limit measured in the same run."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name", ["generate", "log_probs", "update", "sync"])
def test_bench_prints_one_json_line(name):
    cmd = [sys.executable, "-m", "rl_megatron.bench", name, "--json", "--hidden", "128", "--layers", "1",
           "--vocab", "256", "--batch", "4", "--seq", "32", "--threads", "1"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == name
    assert result["value"] > 0 and result["limit"] > 0
    assert result["ratio"] == pytest.approx(result["value"] / result["limit"])
