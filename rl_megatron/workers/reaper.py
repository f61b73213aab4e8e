"""Nothing of a run outlives its controller, however the controller ends (SIGKILL and the OOM killer included).

A local Ray's processes are the controller's descendants, and most of them follow it when it dies; but Ray's
dashboard and runtime-env agents wait for their dead raylet's GCS for about a minute before they exit, so
repeated kills pile them up. The controller starts a reaper: a small process in a session of its own (a Ctrl-C
or a job's signal to the controller's group does not reach it) that records the controller's process tree every
`POLL_S` while the controller lives. When the controller's end of the pipe closes, which the kernel does at any
death, the reaper ends what is left of that tree: SIGTERM, then SIGKILL after `GRACE_S`.

    python -m rl_megatron.workers.reaper PID     # reads its stdin until EOF, then reaps PID's recorded tree
"""
from __future__ import annotations

import functools
import select
import subprocess
import sys

import psutil

POLL_S = 1.0  # how often the tree is recorded: a process started and orphaned within it can escape
GRACE_S = 3.0  # between SIGTERM and SIGKILL


@functools.cache
def start_reaper() -> subprocess.Popen:
    """The reaper of this process's tree, started once; the cache keeps its pipe open until this process ends."""
    return subprocess.Popen([sys.executable, "-m", "rl_megatron.workers.reaper", str(psutil.Process().pid)],
                            stdin=subprocess.PIPE, start_new_session=True)


def reap(processes: list[psutil.Process]) -> list[psutil.Process]:
    """End `processes` (and what they started since) that still run; returns those that resisted SIGKILL."""
    alive = {p for p in processes if p.is_running()}  # is_running compares start times: a reused PID is not ours
    for process in list(alive):
        try:
            alive.update(process.children(recursive=True))
        except psutil.NoSuchProcess:
            alive.discard(process)
    for process in alive:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, stubborn = psutil.wait_procs(alive, timeout=GRACE_S)
    for process in stubborn:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return psutil.wait_procs(stubborn, timeout=GRACE_S)[1]


def watch(pid: int) -> None:
    """Record `pid`'s descendants until stdin closes, then reap them."""
    try:
        controller = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    recorded: dict[int, psutil.Process] = {}
    own = psutil.Process().pid
    while True:
        try:
            current = {p.pid: p for p in controller.children(recursive=True) if p.pid != own}
        except psutil.NoSuchProcess:
            break
        # Orphans stay recorded (they still run); what has ended is dropped, so the record stays small.
        recorded = {pid: p for pid, p in recorded.items() if p.is_running()} | current
        readable, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if readable and not sys.stdin.buffer.read1(4096):  # EOF: the controller has ended
            break
    reap(list(recorded.values()))


if __name__ == "__main__":
    watch(int(sys.argv[1]))
