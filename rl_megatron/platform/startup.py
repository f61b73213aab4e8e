"""A process's start-up without Python's automatic garbage collection. Start-up is mostly imports and building
objects that live for the whole run (torch, Megatron, vLLM, the models): the collector's passes over that growing
heap find nothing to free and cost about a sixth of the start-up's CPU time (measured on the demo's workers:
7.7 s -> 6.3 s to import Megatron and start a vLLM engine). Each process that starts the run's parts (the
controller, each worker) defers collection first and calls `startup_done` once they are built."""
from __future__ import annotations

import gc


def defer_garbage_collection() -> None:
    """No automatic collection from now until `startup_done` (explicit `gc.collect()` calls still run)."""
    gc.disable()


def startup_done() -> None:
    """What start-up built is frozen (later collections do not scan it again) and automatic collection resumes."""
    gc.freeze()
    gc.enable()
