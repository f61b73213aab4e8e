"""Ray's debugger for the run's workers (RAY_DEBUG): whether it is on, what it needs, what changes while it is on.

Ray 2.60 reads RAY_DEBUG in a worker when that worker reaches `breakpoint()`: "1" pauses it for the Ray
Distributed Debugger (debugpy; VS Code's extension finds the paused task through Ray's dashboard), "legacy" opens
a remote pdb that `ray debug` attaches to. While it is on:
- every worker gets RAY_DEBUG (and RAY_DEBUG_POST_MORTEM) in its runtime environment (`debugger_env`, through
  `worker_env`): it reaches the workers of any node, whatever environment that node's `ray start` had;
- process groups wait a day (`rl_megatron.platform.debugger.collective_timeout`, beside the check of RAY_DEBUG that
  the engines and the weight sync use too): a rank paused at a breakpoint keeps its peers waiting in their next
  collective;
- the controller waits on the workers without a time limit (`controller_wait_s`).
"""
from __future__ import annotations

import os
from importlib import metadata
from typing import Optional

from packaging.version import Version

from rl_megatron.platform.debugger import DEBUGGER_MODES, ray_debugger

# Unset (Ray's default stops at breakpoint() in debugpy, but the run keeps its timeouts), or a value Ray takes as
# "ignore breakpoint()".
OFF_VALUES = ("", "0")
FORWARDED = ("RAY_DEBUG", "RAY_DEBUG_POST_MORTEM")  # read by Ray inside each worker
MIN_DEBUGPY = Version("1.8.0")  # Ray's Distributed Debugger refuses older ones


def debugger_env() -> dict[str, str]:
    """The debugger's variables of this process's environment, for every worker's."""
    return {name: os.environ[name] for name in FORWARDED if name in os.environ}


def setup_problem(starts_dashboard: bool) -> Optional[str]:
    """What keeps RAY_DEBUG from working with this Python, with the fix; None when nothing does. `starts_dashboard`:
    this process starts the Ray head (a local Ray, the launcher's node 0), whose dashboard VS Code's extension asks
    for the paused tasks."""
    mode = os.environ.get("RAY_DEBUG", "")
    if mode not in DEBUGGER_MODES + OFF_VALUES:
        return (f"RAY_DEBUG={mode!r}: Ray 2.60 knows RAY_DEBUG=1 (the Ray Distributed Debugger, VS Code) and "
                "RAY_DEBUG=legacy (`ray debug`); with any other value a worker's breakpoint() does nothing. Set one "
                "of them, or unset RAY_DEBUG.")
    if mode != "1":  # the legacy debugger is Ray's own pdb: nothing to install
        return None
    try:
        installed = Version(metadata.version("debugpy"))
    except metadata.PackageNotFoundError:
        installed = None
    if installed is None or installed < MIN_DEBUGPY:
        found = "is not installed" if installed is None else f"is {installed}"
        return (f"RAY_DEBUG=1 stops workers in debugpy, which {found} here (Ray needs debugpy>={MIN_DEBUGPY}): "
                "`pip install -e .[debug]` on every node (debugpy and Ray's dashboard packages), or use "
                "RAY_DEBUG=legacy (`ray debug`), which needs nothing more.")
    if starts_dashboard:
        from ray._private.utils import get_dashboard_dependency_error

        missing = get_dashboard_dependency_error()
        if missing is not None:
            return (f"RAY_DEBUG=1: VS Code's Ray Distributed Debugger finds paused workers through Ray's dashboard, "
                    f"which needs Ray's dashboard packages (ray[default]); this Python lacks them ({missing}). "
                    "`pip install -e .[debug]` installs them, or use RAY_DEBUG=legacy (`ray debug`).")
    return None


def attach_hint(dashboard_url: str, gcs_address: str) -> str:
    """The console line saying how to attach to a worker paused at a breakpoint (the debugger is on)."""
    waits = "the run waits as long as a worker stays paused"
    if ray_debugger() == "legacy":
        return (f"Ray debugger on (RAY_DEBUG=legacy): a worker reaching breakpoint() waits for `ray debug --address "
                f"{gcs_address}`, run in another terminal on that worker's node; {waits}.")
    if dashboard_url:
        port = dashboard_url.rpartition(":")[2]
        where = f"add the cluster {dashboard_url} (from another machine: ssh -L {port}:localhost:{port} to this one)"
    else:
        where = ("Ray reports no dashboard for this cluster: start its head with `ray start --head` where ray[default] "
                 "is installed, and add the head's dashboard address")
    return (f"Ray debugger on (RAY_DEBUG=1): a worker reaching breakpoint() waits for VS Code's Ray Distributed "
            f"Debugger extension: {where}, then click the paused task; {waits}.")


def controller_wait_s(usual: float) -> Optional[float]:
    """How long the controller waits on a worker's call: `usual` seconds, or without limit (None) while the
    debugger is on (a worker paused at a breakpoint answers when its session ends)."""
    return None if ray_debugger() else usual
