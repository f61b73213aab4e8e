"""The installed package imports outside the repository, in a fresh interpreter (what the console script, and Ray
workers started in another directory, rely on; its folders are packages setup.py finds: tests/unit/test_packaging.py)."""
import subprocess
import sys
from pathlib import Path

from helpers.runs import REPO


def test_the_installed_package_imports_outside_the_repository(tmp_path):
    """What the console script, and Ray workers started in another directory, rely on."""
    done = subprocess.run([sys.executable, "-c", "import rl_megatron.train as m; print(m.__file__)"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == Path(REPO) / "rl_megatron" / "train.py"
