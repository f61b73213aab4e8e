"""The CPU seconds each test costs, its whole process tree counted (Ray's workers and engines, the ranks it forks):
the measure of what the suite's time is made of, where wall-clock time only says how the two workers shared the
cores. A pytest plugin, which tests/conftest.py loads when RL_MEGATRON_CPU_TIME names a file:

    RL_MEGATRON_CPU_TIME=/tmp/cpu.jsonl make test

Each pytest process (each xdist worker) moves itself into a control group of its own, which every process it starts
inherits, however deep (Ray's raylet starts the workers; nothing reaps them into rusage), and appends one line per
test to the file: {"test": nodeid, "cpu": seconds, "wall": seconds}, setup and teardown included (a module's shared
run counts in its first test). Needs a writable cgroup hierarchy (root on a machine with cgroup v1's cpuacct or
cgroup v2): otherwise pytest stops at start and says so."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

V1 = Path("/sys/fs/cgroup/cpuacct")  # cpuacct.usage: nanoseconds
V2 = Path("/sys/fs/cgroup")  # cpu.stat's usage_usec: microseconds, in every group of a v2 hierarchy
_group: Path | None = None


def _join_own_group() -> Path:
    """A control group of this process's own (named by its xdist worker), with this process in it."""
    name = f"rl_megatron_cpu_time_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}_{os.getpid()}"
    root = V1 if (V1 / "cpuacct.usage").exists() else V2
    group = root / name
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as err:
        raise pytest.UsageError(f"helpers.cpu_time needs a writable cgroup hierarchy ({group}: {err}); run as root "
                                "on a machine with cgroup v1's cpuacct or cgroup v2, or "
                                "unset RL_MEGATRON_CPU_TIME") from None
    return group


def cpu_seconds(group: Path) -> float:
    """The CPU time of every process that ever ran in `group`."""
    if (group / "cpuacct.usage").exists():
        return int((group / "cpuacct.usage").read_text()) / 1e9
    stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    return int(stat["usage_usec"]) / 1e6


def pytest_configure(config):
    global _group
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        return  # xdist's controller runs no test: each worker measures its own
    _group = _join_own_group()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = cpu_seconds(_group), time.monotonic()
    yield
    record = {"test": item.nodeid, "cpu": round(cpu_seconds(_group) - cpu, 2),
              "wall": round(time.monotonic() - wall, 2)}
    with open(os.environ["RL_MEGATRON_CPU_TIME"], "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_unconfigure(config):
    """Leave the group (back to the one above it) and remove it, once nothing runs there any more."""
    if _group is None:
        return
    try:
        (_group.parent / "cgroup.procs").write_text(str(os.getpid()))
        _group.rmdir()
    except OSError:
        pass  # a process the tests started still runs in it: the group stays, empty once that ends
