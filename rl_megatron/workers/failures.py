"""A worker that died, explained: which role and rank, on which node, why (as far as Ray and the kernel tell), and
the last lines of its log, instead of Ray's raw "The actor is dead because its worker process has died"."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import psutil
import ray

LOG_LINES = 12  # of the worker's log
GIB = 1 << 30
# The first line of a RayTaskError: "ray::HybridWorker.update() (pid=25091, ip=10.0.0.5, actor_id=...)".
RAY_TASK_PID = re.compile(r"\(pid=(?P<pid>\d+), ip=")
# In Ray's OOM message: "Memory on the node (IP: 10.0.0.5, ID: 1f6d...) was 22.1GB used / 23.5GB limit (0.94)".
RAY_MEMORY_FIGURES = re.compile(r"Memory on the node \(IP: (?P<ip>[^,]+),[^)]*\) was (?P<used>[^(]+)")


class WorkerDied(RuntimeError):
    """A worker process of the run ended; the message says which, where, why and what it printed last."""


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one rank runs, as its worker reports it."""
    rank: int
    pool_node: int  # the pool's node index (ResourcePool.node_of)
    node_id: str  # Ray's node id
    node_ip: str
    pid: int
    log_files: tuple[str, ...]  # what Ray redirected the worker's stdout and stderr to (paths on its node)
    ray_debug: str  # RAY_DEBUG as the worker sees it ("" when unset): whether Ray's debugger reached it


def where_am_i(worker) -> tuple[str, str, int, tuple[str, ...], str]:
    """Run inside a worker (through Ray's `__ray_call__`): its Ray node id, address, pid, log files and RAY_DEBUG."""
    logs = tuple(dict.fromkeys(os.path.realpath(f"/proc/self/fd/{fd}") for fd in (1, 2)))
    return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid(),
            tuple(path for path in logs if os.path.isfile(path)), os.environ.get("RAY_DEBUG", ""))


def oom_kills() -> int | None:
    """The kernel's count of processes its OOM killer ended since boot (this node); None where it is not told."""
    try:
        with open("/proc/vmstat") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), None)
    except OSError:
        return None


def memory_now() -> str:
    memory = psutil.virtual_memory()
    return f"{(memory.total - memory.available) / GIB:.1f} GiB of {memory.total / GIB:.1f} GiB in use now"


def cause_of_death(ray_message: str, local: bool, oom_kills_before: int | None) -> str:
    """Why the worker died, in plain words, from Ray's message and (on this node) the kernel's OOM count."""
    if "low on memory" in ray_message:  # Ray's memory monitor: its message carries the node's figures
        figures = RAY_MEMORY_FIGURES.search(ray_message)
        used = f" (node {figures['ip']}: {figures['used'].strip()})" if figures else ""
        return (f"Ray's memory monitor killed it: the node was running out of memory{used}. Lower the memory the "
                "run needs (smaller rollout.max_tokens, micro-batches, or rollout.gpu_memory_utilization) or give "
                "the node more (Ray kills workers above RAY_memory_usage_threshold of it, 0.95 by default).")
    if local:
        after = oom_kills()
        if None not in (after, oom_kills_before) and after > oom_kills_before:
            return (f"the kernel's OOM killer ended {after - oom_kills_before} process(es) on this node since the "
                    f"run started, most likely this one: the node ran out of memory ({memory_now()}).")
        return f"its process was killed (a signal such as SIGKILL, or a crash); node memory: {memory_now()}."
    return ("its process was killed (a signal such as SIGKILL, the kernel's OOM killer, or a crash); `dmesg` on "
            "that node tells whether the OOM killer acted.")


def log_tail(path: str, lines: int = LOG_LINES) -> list[str]:
    """The last `lines` of a worker's log, without Ray's markers (":job_id:...", ":actor_name:...")."""
    try:
        with open(path, errors="replace") as f:
            text = [line.rstrip("\n") for line in f if not line.startswith(":")]
    except OSError:
        return []
    return text[-lines:]


def log_report(where: WorkerPlacement, this_node: str) -> list[str]:
    """The worker's log files: their last lines when they are on `this_node` (the controller's), else where they are."""
    lines = []
    for path in where.log_files:
        if where.node_id != this_node:
            lines.append(f"Its log: {path} on {where.node_ip}.")
        elif tail := log_tail(path):
            lines += [f"Last lines of its log {path}:"] + ["    " + line for line in tail]
        else:
            lines.append(f"Its log {path} is empty.")
    return lines


def describe_raise(group: str, world_size: int, placement: list[WorkerPlacement], ray_message: str,
                   this_node: str) -> str | None:
    """Where an exception raised in a worker came from (the pid in Ray's RayTaskError message: the instance the
    controller gets is also of the original exception's class, without Ray's own attributes), and the end of that
    worker's log; None when no worker of the group has that pid."""
    found = RAY_TASK_PID.search(ray_message)
    pid = int(found["pid"]) if found else None
    where = next((w for w in placement if w.pid == pid), None)
    if where is None:
        return None
    return "\n".join([f"Raised in the {group} worker rank {where.rank} of {world_size} (node {where.pool_node} = "
                      f"{where.node_ip}, pid {pid})."] + log_report(where, this_node))


def describe_death(group: str, rank: int, world_size: int, where: WorkerPlacement | None, ray_message: str,
                   this_node: str, oom_kills_before: int | None) -> str:
    """The report of one dead worker: who, where, why, and the end of its logs (read here when it ran on
    `this_node`, the controller's Ray node). `where` is None for a worker that died before reporting it."""
    local = where is not None and where.node_id == this_node
    node = f"node {where.pool_node} = {where.node_ip}, pid {where.pid}" if where else "before it reported its node"
    lines = [f"The {group} worker rank {rank} of {world_size} ({node}) died: "
             f"{cause_of_death(ray_message, local, oom_kills_before)}"]
    return "\n".join(lines + (log_report(where, this_node) if where else []))
