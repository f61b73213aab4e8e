"""`python -m rl_megatron.data.prepare` as a user starts it, in a process of its own: --help and argparse's errors
(the conversions themselves run in-process in tests/unit/test_data_prepare.py)."""
import subprocess
import sys

from helpers.runs import REPO


def test_help_and_argument_errors_from_the_command_line():
    command = [sys.executable, "-m", "rl_megatron.data.prepare"]
    helped = subprocess.run(command + ["countdown", "--help"], capture_output=True, text=True, cwd=REPO)
    assert helped.returncode == 0 and "--num-operands" in helped.stdout and "qwen-instruct" in helped.stdout
    bad = subprocess.run(command + ["countdown", "--out", "x", "--num-operands", "1..4"], capture_output=True,
                         text=True, cwd=REPO)
    assert bad.returncode == 2 and "need 2 <= LOW <= HIGH" in bad.stderr
