"""The python tool's per-call cgroup (rl_megatron/tools/cgroups.py): where one can be made (v2 delegated, v1
writable, else none), its limits and members, and that a killed trainer's leftovers are swept."""
import os
import subprocess
import sys

import pytest

from rl_megatron.tools import cgroups


def tree(root, files: dict[str, str]):
    for path, text in files.items():
        os.makedirs(os.path.dirname(root / path), exist_ok=True)
        (root / path).write_text(text)
    return str(root)


def test_v2_only_where_memory_and_pids_are_delegated(tmp_path):
    root = tree(tmp_path, {"cgroup.controllers": "cpu memory pids", "job/cgroup.subtree_control": "memory pids",
                           "other/cgroup.subtree_control": "cpu"})
    assert cgroups.layout(root, "0::/job\n") == cgroups.Layout((f"{root}/job",), "pids.max", "memory.max", 0)
    assert cgroups.layout(root, "0::/other\n") is None  # not delegated: its children would get no limits
    assert cgroups.layout(root, "0::/missing\n") is None


def test_v1_where_the_pids_and_memory_hierarchies_are_writable(tmp_path):
    root = tree(tmp_path, {"pids/cgroup.procs": "", "memory/jobs/a/cgroup.procs": ""})
    found = cgroups.layout(root, "8:pids:/\n4:memory:/jobs/a\n1:cpu,cpuacct:/\n0::/\n")
    assert found == cgroups.Layout((f"{root}/pids/", f"{root}/memory/jobs/a"), "pids.max",
                                   "memory.limit_in_bytes", 1)
    assert cgroups.layout(str(tmp_path / "nothing"), "8:pids:/\n4:memory:/\n") is None


@pytest.mark.skipif(cgroups.supported() is None, reason="this process cannot make cgroups here (no writable v1 "
                                                         "hierarchy, no delegated v2)")
def test_a_call_cgroup_has_its_limits_and_its_members_and_goes_away():
    made = cgroups.CallCgroup.create(20, 64 * 2**20)
    found = cgroups.supported()
    try:
        assert open(os.path.join(made.folders[0], found.pids_file)).read().strip() == "20"
        assert int(open(os.path.join(made.folders[found.memory_parent], found.memory_file)).read()) == 64 * 2**20
        member = subprocess.run([sys.executable, "-c", "print(open('/proc/self/cgroup').read())"], capture_output=True,
                                text=True, preexec_fn=made.join)
        name = os.path.basename(made.folders[0])
        assert name.startswith(f"rl-megatron-call-{os.getpid()}-") and member.stdout.count(name) == len(made.folders)
    finally:
        made.remove()
    assert not any(os.path.exists(folder) for folder in made.folders)


@pytest.mark.skipif(cgroups.supported() is None, reason="this process cannot make cgroups here")
def test_the_cgroups_of_a_trainer_that_died_are_swept():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    parents = cgroups.supported().parents
    left = [os.path.join(parent, f"rl-megatron-call-{dead.stdout.strip()}-0123456789ab") for parent in parents]
    for folder in left:
        os.mkdir(folder)
    cgroups.sweep(parents)
    assert not any(os.path.exists(folder) for folder in left)
