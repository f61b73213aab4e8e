"""The package as pip installs it: setup.py's find_packages takes only folders with an __init__.py, so a folder of
code without one is left out of wheels and editable installs (and then imports only from the repository's root). That
the installed package imports outside the repository, in a process of its own: tests/process/test_installed_package.py."""
from pathlib import Path

from helpers.runs import REPO
from setuptools import find_packages

ROOT = Path(REPO)


def test_every_folder_of_code_is_a_package_that_setup_py_finds():
    folders = {str(path.parent.relative_to(ROOT)).replace("/", ".") for path in (ROOT / "rl_megatron").rglob("*.py")}
    assert folders - set(find_packages(str(ROOT), include=["rl_megatron", "rl_megatron.*"])) == set()
