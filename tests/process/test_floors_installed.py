"""A dependency floor above what is installed here is installed into a temporary folder (pip --target, never torch)
that loads the demo config in a fresh interpreter (the floors and where they are declared:
tests/unit/test_dependency_floors.py)."""
import os
import subprocess
import sys

import pytest
from helpers.floors import ROOT, setup_py_floor

NO_TORCH = "torch<0\n"  # a constraint: pip fails rather than pull a (CUDA) torch into the temporary folder


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


LOAD_DEMO = ("from rl_megatron.preflight import load_config\n"
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
