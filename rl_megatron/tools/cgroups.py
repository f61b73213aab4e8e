"""A memory and pids cgroup per sandboxed call, where this process may make one.

RLIMIT_AS and RLIMIT_NPROC bound one process, and RLIMIT_NPROC not at all for a trainer running as root (the
kernel exempts it): a fork bomb or a swarm of processes each under its own limit needs a limit on the whole call.
A cgroup gives it: `pids.max` processes and `memory` bytes (its pages, the private tmpfs's included) for every
process of the call together. Made under this process's own cgroup, in either layout:
- cgroup v2, where it is delegated: this process's cgroup lists memory and pids in `cgroup.subtree_control` and is
  writable (a systemd unit with Delegate=yes that runs in a leaf of its own, a container given its cgroup);
- cgroup v1: the pids and memory hierarchies' folders of this process, where writable (root in most containers).
Elsewhere `CallCgroup.create` returns None and the rlimits alone apply (docs/sandbox.md says so). The call's first
process joins the cgroup between fork and exec (`join`), so everything it starts is counted from its first instruction.
"""
from __future__ import annotations

import functools
import os
import time
import uuid
from dataclasses import dataclass

ROOT = "/sys/fs/cgroup"
PREFIX = "rl-megatron-call-"  # then the trainer's pid: what a killed trainer left is swept by the next one


@dataclass(frozen=True)
class Layout:
    """Where a call's cgroup goes: the parent folder of each hierarchy, and the file names of its limits."""
    parents: tuple[str, ...]  # v2: one; v1: the pids hierarchy's, then the memory hierarchy's
    pids_file: str
    memory_file: str
    memory_parent: int  # the index of the parent that holds the memory limit


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """/proc/self/cgroup as {controller: path} ("" for v2's unified line)."""
    paths = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def layout(root: str = ROOT, proc_cgroup: str | None = None) -> Layout | None:
    """The layout this process may make call cgroups in, or None."""
    if proc_cgroup is None:
        with open("/proc/self/cgroup") as file:
            proc_cgroup = file.read()
    paths = _own_paths(proc_cgroup)
    if os.path.isfile(os.path.join(root, "cgroup.controllers")) and "" in paths:  # v2, unified at the root
        parent = os.path.join(root, paths[""].lstrip("/"))
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as file:
                delegated = {"memory", "pids"} <= set(file.read().split())
        except OSError:
            return None
        return Layout((parent,), "pids.max", "memory.max", 0) if delegated and os.access(parent, os.W_OK) else None
    parents = tuple(os.path.join(root, controller, paths.get(controller, "/").lstrip("/"))
                    for controller in ("pids", "memory"))
    if all(os.path.isfile(os.path.join(parent, "cgroup.procs")) and os.access(parent, os.W_OK) for parent in parents):
        return Layout(parents, "pids.max", "memory.limit_in_bytes", 1)
    return None


@dataclass(frozen=True)
class CallCgroup:
    folders: tuple[str, ...]

    @classmethod
    def create(cls, max_processes: int, memory_bytes: int) -> CallCgroup | None:
        """A fresh cgroup with these limits, or None where this process cannot make one (`supported`)."""
        found = supported()
        if found is None:
            return None
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        folders = tuple(os.path.join(parent, name) for parent in found.parents)
        made = cls(folders)
        try:
            for folder in folders:
                os.mkdir(folder)
            with open(os.path.join(folders[0], found.pids_file), "w") as file:
                file.write(str(max_processes))
            with open(os.path.join(folders[found.memory_parent], found.memory_file), "w") as file:
                file.write(str(memory_bytes))
        except OSError:
            made.remove()
            raise
        return made

    def join(self) -> None:
        """For the call's first process, between fork and exec: it and all it starts are in this cgroup."""
        for folder in self.folders:
            with open(os.path.join(folder, "cgroup.procs"), "w") as file:
                file.write("0")

    def remove(self) -> None:
        """Once the call's processes have ended (a dying process leaves its cgroup a moment after it is reaped)."""
        for folder in self.folders:
            for _ in range(50):
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def sweep(parents: tuple[str, ...]) -> None:
    """Remove the (empty) call cgroups of trainers that are gone: a trainer killed mid-call cannot remove its own."""
    for parent in parents:
        for name in os.listdir(parent):
            owner = name[len(PREFIX):].split("-")[0]
            if name.startswith(PREFIX) and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:  # still has processes: left alone
                    pass


@functools.cache
def supported() -> Layout | None:
    """This process's layout where a cgroup can really be made and removed there (probed once; the call cgroups of
    trainers that died are swept then)."""
    try:
        found = layout()
        if found is None:
            return None
        sweep(found.parents)
        probe = CallCgroup(tuple(os.path.join(parent, f"rl-megatron-probe-{os.getpid()}") for parent in found.parents))
        try:
            for folder in probe.folders:
                os.mkdir(folder)
        finally:
            probe.remove()
        return found
    except OSError:
        return None
