"""A process starts without automatic garbage collection and resumes it, its start-up heap frozen, once built."""
import subprocess
import sys

PROBE = """
import gc
from rl_megatron.platform.startup import defer_garbage_collection, startup_done
defer_garbage_collection()
paused = gc.isenabled()
built = [[i] for i in range(1000)]  # what start-up builds, kept for the run
startup_done()
print(paused, gc.isenabled(), gc.get_freeze_count() >= 1000)
"""


def test_collection_is_paused_during_start_up_and_resumes_with_the_start_up_heap_frozen():
    # In a process of its own: freezing the test process's heap would keep its garbage for the whole session.
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True", "True"]
