"""The controller's side of profiling: which workers record which phase of the steps in trainer.profile_steps (the
workers' side, and where the traces go: `workers/profiling.py`). The pattern of verl's and NeMo-RL's profiler
settings: chosen steps on chosen ranks (trainer.profile_ranks), one trace per worker and phase.

    phase      recorded by the groups of          what runs
    generate   the engines                        the rollout of the step's batch (with trainer.rollout_staleness
                                                  > 0 in the generation thread, while an earlier step trains)
    log_prob   the actor, reference, teacher,     old log-probs, reference and teacher log-probs, values, the
               critic and reward model            reward model's scores
    update     the critic and actor               their PPO updates
    sync       the actor and engines              the policy's weights into the engines
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rl_megatron.roles import Role
from rl_megatron.tracking.console import write
from rl_megatron.workers.worker_group import WorkerGroup

PHASE_ROLES: dict[str, tuple[Role, ...]] = {
    "generate": (Role.ROLLOUT,),
    "log_prob": (Role.ACTOR, Role.REF, Role.TEACHER, Role.CRITIC, Role.REWARD_MODEL),
    "update": (Role.CRITIC, Role.ACTOR),
    "sync": (Role.ACTOR, Role.ROLLOUT),
}

Result = TypeVar("Result")


class StepProfiles:
    """`groups`: the run's worker groups by role (a colocated role maps to the group hosting it)."""

    def __init__(self, steps: list[int], groups: dict[Role, WorkerGroup]):
        self.steps = set(steps)
        self.announced: set[int] = set()  # the steps whose traces the console has named
        # Each group once per phase, however many of the phase's roles it hosts.
        self.phase_groups = {phase: list({id(groups[role]): groups[role] for role in roles if role in groups}.values())
                             for phase, roles in PHASE_ROLES.items()}

    @contextmanager
    def phase(self, step: int, phase: str) -> Iterator[None]:
        """The block, recorded as `phase` by its groups' workers when `step` is profiled. (A block that raises
        leaves its recording unwritten: the run stops.)"""
        if step not in self.steps:
            yield
            return
        groups = self.phase_groups[phase]
        self._on_workers(groups, "start_profile", step, phase)
        yield
        traces = [path for path in self._on_workers(groups, "stop_profile", step, phase) if path is not None]
        if traces and step not in self.announced:  # one line a step: the phases' traces share its folder
            self.announced.add(step)
            write(f"step {step}: profiled; a Chrome trace per phase and rank in {os.path.dirname(traces[0])}")

    def around(self, phase: str, produce: Callable[[int], Result]) -> Callable[[int], Result]:
        """`produce(step)`, each call recorded as `phase` of a profiled `step`."""
        def recorded(step: int) -> Result:
            with self.phase(step, phase):
                return produce(step)

        return recorded

    @staticmethod
    def _on_workers(groups: list[WorkerGroup], method: str, *args) -> list:
        """`method` on every worker of `groups` at once; their results."""
        calls = [(group, group.call_async(method, *args)) for group in groups]
        return [result for group, refs in calls for result in group.get(refs)]
