"""The run's log files, `<run_dir>/logs/`: every worker's whole output (Python, C++ and the libraries' own prints)
in `worker_<role>_<rank>.log`, and the controller's records (`logging`, INFO and up) in `controller.log`, instead of
the console. The console keeps what a user can act on (see `workers/cluster.py`, which stops Ray from forwarding
worker output; warnings still show there), and a failed worker's report quotes the end of its file
(`workers/failures.py`)."""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rl_megatron.roles import Role


def logs_dir(run_dir: str) -> str:
    """Where a run's workers write their logs, as an absolute path (a worker's working folder may differ)."""
    return os.path.join(os.path.abspath(run_dir), "logs")


def worker_log_path(logs: str, role: Role, rank: int) -> str:
    """The log file of rank `rank` of the pool whose first role is `role` (e.g. actor for actor+rollout+ref)."""
    return os.path.join(logs, f"worker_{role}_{rank}.log")


def redirect_output(path: str) -> None:
    """From now on this process's stdout and stderr (file descriptors 1 and 2, so output written by C++ or by child
    processes too) append to `path`, a line at a time. A restarted or resumed run appends to the same file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)


@contextmanager
def controller_log(logs: str) -> Iterator[None]:
    """While open, the project's log records (its `rl_megatron.*` loggers) at INFO and up go to `logs`/controller.log
    with their time, and warnings also to the console as before."""
    os.makedirs(logs, exist_ok=True)
    project = logging.getLogger("rl_megatron")
    to_file = logging.FileHandler(os.path.join(logs, "controller.log"))
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_console = logging.StreamHandler()  # what Python shows without handlers: the message alone, on stderr
    to_console.setLevel(logging.WARNING)
    level = project.level
    project.setLevel(logging.INFO)
    project.addHandler(to_file)
    project.addHandler(to_console)
    try:
        yield
    finally:
        project.removeHandler(to_file)
        project.removeHandler(to_console)
        project.setLevel(level)
        to_file.close()
