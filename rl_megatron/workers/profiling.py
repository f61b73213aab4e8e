"""A worker's side of profiling: recording the phases of chosen steps with torch.profiler (trainer.profile_steps on
trainer.profile_ranks), and each dispatched call's phase as a named range.

The controller (`trainer/profiling.py`) starts and stops every worker's `StepProfiler` around the phases of a
profiled step; each recording becomes one Chrome trace,

    <run_dir>/profile/step_<step>/<roles>_rank<rank>_<phase>.json     e.g. step_3/actor+rollout_rank0_update.json

named by the roles the worker hosts, so that the workers of different groups (and nodes) never share a file.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch.profiler import ProfilerActivity

from rl_megatron import platform
from rl_megatron.workers.phases import Phase


def trace_path(profile_dir: str, step: int, worker: str, phase: str) -> str:
    """The Chrome trace of `worker` (e.g. "actor+rollout_rank0") recording `phase` of `step`."""
    return os.path.join(profile_dir, f"step_{step}", f"{worker}_{phase}.json")


class StepProfiler:
    """One per worker process (torch.profiler records one session at a time). `records`: this rank is one of
    trainer.profile_ranks; the others answer at once."""

    def __init__(self, profile_dir: str, worker: str, records: bool):
        self.profile_dir, self.worker, self.records = profile_dir, worker, records
        self.session: torch.profiler.profile | None = None
        self.recording: tuple[int, str] | None = None  # the (step, phase) of the session

    def start(self, step: int, phase: str) -> None:
        """Record `phase` of `step` from now. Phases that overlap in one worker (a weight sync in the middle of a
        partial rollout's generation) go into the recording started first."""
        if not self.records or self.session is not None:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if platform.has_cuda() else [])
        self.session = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        self.session.start()
        self.recording = (step, phase)

    def stop(self, step: int, phase: str) -> str | None:
        """End the recording of `phase` of `step` and write its trace; its path, or None when this worker did not
        record that phase."""
        if self.recording != (step, phase):
            return None
        self.session.stop()
        path = trace_path(self.profile_dir, step, self.worker, phase)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.session.export_chrome_trace(path)
        self.session = self.recording = None
        return path


@contextmanager
def phase_range(phase: Phase) -> Iterator[None]:
    """A dispatched call in `phase`, as a range named by its label: in a torch.profiler trace, and on GPU in nsys's
    timeline (NVTX; `nsys profile -t cuda,nvtx`)."""
    nvtx = torch.cuda.nvtx.range(phase.label) if platform.has_cuda() else nullcontext()
    with torch.profiler.record_function(phase.label), nvtx:
        yield
