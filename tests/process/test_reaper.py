"""The reaper: whatever a controller started is ended once the controller dies, also by SIGKILL, even the processes
that left its tree (reparented to init) and ignore SIGTERM for a while, as Ray's agents do."""
import os
import signal
import subprocess
import sys
import textwrap

import psutil

from rl_megatron.workers.reaper import GRACE_S, POLL_S

# A controller: starts its reaper, then a child that starts a grandchild in a session of its own and exits a few
# polls later (orphaning it, as a dead raylet orphans Ray's agents), and a child that shrugs off SIGTERM.
CONTROLLER = textwrap.dedent("""
    import subprocess, sys, time
    from rl_megatron.workers.reaper import start_reaper
    start_reaper()
    sleeper = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"]
    stubborn = subprocess.Popen(sleeper)
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess; print(subprocess.Popen({sleeper!r}, start_new_session=True, stdout=subprocess.DEVNULL).pid); import time; time.sleep(3)"],
                              stdout=subprocess.PIPE, text=True)
    orphan = int(parent.communicate()[0])
    print(stubborn.pid, orphan, flush=True)
    time.sleep(300)
""")


def test_a_sigkilled_controller_leaves_nothing_behind():
    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True)
    started = []
    try:
        started = [psutil.Process(int(pid)) for pid in controller.stdout.readline().split()]
        stubborn, orphan = started
        reaper, = [p for p in psutil.Process(controller.pid).children() if "rl_megatron.workers.reaper" in p.cmdline()]
        assert orphan.ppid() != controller.pid  # it has left the controller's tree, recorded while in it
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait()
        _, alive = psutil.wait_procs(started, timeout=POLL_S + 3 * GRACE_S)
        assert not alive, f"still running after the controller died: {alive}"
        reaper.wait(timeout=POLL_S + 3 * GRACE_S)  # and the reaper itself ends
    finally:
        controller.kill()
        for process in started:
            if process.is_running():
                process.kill()
