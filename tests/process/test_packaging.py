"""The package as pip installs it: setup.py's find_packages takes only folders with an __init__.py, so a folder of
code without one is left out of wheels and editable installs (and then imports only from the repository's root)."""
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def test_every_folder_of_code_is_a_package_that_setup_py_finds():
    folders = {str(path.parent.relative_to(ROOT)).replace("/", ".") for path in (ROOT / "rl_megatron").rglob("*.py")}
    assert folders - set(find_packages(str(ROOT), include=["rl_megatron", "rl_megatron.*"])) == set()


def test_the_installed_package_imports_outside_the_repository(tmp_path):
    """What the console script, and Ray workers started in another directory, rely on."""
    done = subprocess.run([sys.executable, "-c", "import rl_megatron.train as m; print(m.__file__)"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == ROOT / "rl_megatron" / "train.py"
