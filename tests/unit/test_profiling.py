"""Profiling chosen steps (trainer.profile_steps on trainer.profile_ranks): a worker's recorder and its Chrome
traces, the phase ranges of dispatched calls (NVTX on GPU), which groups the controller asks to record each phase,
and the config's checks. (A whole run's traces: tests/e2e/test_profile_run.py.)"""
import json
import os
from contextlib import contextmanager

import pytest
import torch
from helpers.runs import REPO

from rl_megatron import platform
from rl_megatron.config import ConfigError
from rl_megatron.preflight import load_config
from rl_megatron.roles import Role
from rl_megatron.trainer.profiling import StepProfiles
from rl_megatron.workers.phases import GENERATE, SYNC, forward, train
from rl_megatron.workers.profiling import StepProfiler, phase_range, trace_path
from rl_megatron.workers.worker_group import dispatch

DEMO = os.path.join(REPO, "configs", "demo_cpu.yaml")
DEMO_MODEL = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")


def trace_events(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def some_compute() -> None:
    torch.ones(8, 8) @ torch.ones(8, 8)


def test_a_recorded_phase_becomes_a_chrome_trace_named_by_step_worker_and_phase(tmp_path):
    profiler = StepProfiler(str(tmp_path), "actor+rollout_rank0", records=True)
    profiler.start(3, "update")
    with phase_range(train(Role.ACTOR)):
        some_compute()
    path = profiler.stop(3, "update")
    assert path == os.path.join(tmp_path, "step_3", "actor+rollout_rank0_update.json")
    assert path == trace_path(str(tmp_path), 3, "actor+rollout_rank0", "update")
    names = {event.get("name") for event in trace_events(path)}
    assert {"train actor", "aten::mm"} <= names  # the phase's range around the work it did
    # The profiler is free again: the next phase gets a trace of its own.
    profiler.start(3, "sync")
    some_compute()
    assert os.path.isfile(profiler.stop(3, "sync"))


def test_ranks_not_chosen_record_nothing(tmp_path):
    profiler = StepProfiler(str(tmp_path), "rollout_rank1", records=False)
    profiler.start(1, "generate")
    some_compute()
    assert profiler.stop(1, "generate") is None
    assert os.listdir(tmp_path) == []


def test_overlapping_phases_go_into_the_recording_started_first(tmp_path):
    """A weight sync in the middle of a partial rollout's generation: one worker, one torch.profiler session."""
    profiler = StepProfiler(str(tmp_path), "rollout_rank0", records=True)
    profiler.start(4, "generate")
    profiler.start(3, "sync")  # no second session, no error
    with phase_range(SYNC):
        some_compute()
    assert profiler.stop(3, "sync") is None
    path = profiler.stop(4, "generate")
    assert "sync" in {event.get("name") for event in trace_events(path)}
    assert os.listdir(tmp_path) == ["step_4"]
    assert profiler.stop(4, "generate") is None  # stopped once


def test_phase_labels_name_the_kind_and_the_role():
    assert [GENERATE.label, SYNC.label, forward(Role.REF).label, train(Role.CRITIC).label] == [
        "generate", "sync", "forward ref", "train critic"]


class Worker:
    """A worker with one dispatched method, called in process: what it sees of its phase."""

    def __init__(self):
        self.events = []

    def enter(self, phase):
        self.events.append(f"enter {phase.label}")

    def leave(self, phase):
        self.events.append(f"leave {phase.label}")

    @dispatch(axis="dp", phase=forward(Role.ACTOR))
    def log_probs(self):
        self.events.append("compute")


@pytest.mark.parametrize("cuda", [True, False])
def test_a_dispatched_call_is_an_nvtx_range_named_by_its_phase_on_gpu_only(monkeypatch, cuda):
    worker = Worker()

    @contextmanager
    def nvtx_range(name):
        worker.events.append(f"push {name}")
        yield
        worker.events.append("pop")

    monkeypatch.setattr(platform, "has_cuda", lambda: cuda)
    monkeypatch.setattr(torch.cuda.nvtx, "range", nvtx_range)
    worker.log_probs()
    inner = ["enter forward actor", "compute", "leave forward actor"]  # the phase's moves are in its range
    assert worker.events == (["push forward actor", *inner, "pop"] if cuda else inner)


class Group:
    """A worker group's calls, recorded (the profiler's start returns nothing, its stop the trace's path)."""

    def __init__(self, name: str):
        self.name, self.calls = name, []

    def call_async(self, method: str, *args) -> list:
        self.calls.append((method, *args))
        return [None] if method == "start_profile" else [f"{self.name}_{args[1]}.json"]

    def get(self, refs: list) -> list:
        return refs


def test_each_phase_of_a_profiled_step_is_recorded_by_the_groups_that_run_it_each_once():
    actor, ref, critic = Group("actor+rollout"), Group("ref"), Group("critic")  # the engines in the actor's group
    profiles = StepProfiles([2], {Role.ACTOR: actor, Role.ROLLOUT: actor, Role.REF: ref, Role.CRITIC: critic})
    for step in (1, 2):
        for phase in ("log_prob", "update", "sync"):
            with profiles.phase(step, phase):
                pass
    assert profiles.around("generate", lambda step: step * 10)(2) == 20
    assert actor.calls == [(method, 2, phase) for phase in ("log_prob", "update", "sync", "generate")
                           for method in ("start_profile", "stop_profile")]
    assert ref.calls == [("start_profile", 2, "log_prob"), ("stop_profile", 2, "log_prob")]
    assert [call[2] for call in critic.calls] == ["log_prob", "log_prob", "update", "update"]


def config_error(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, [f"model.path={DEMO_MODEL}", "trainer.total_steps=4", *overrides])
    return str(info.value)


@pytest.mark.parametrize("steps", ["[0]", "[2,5]"])
def test_profile_steps_must_be_steps_of_the_run(steps):
    assert "trainer.profile_steps" in config_error(f"trainer.profile_steps={steps}")


def test_profile_ranks_must_be_in_some_worker_group():
    # The demo's only group has two workers: ranks 0 and 1.
    assert load_config(DEMO, [f"model.path={DEMO_MODEL}", "trainer.profile_steps=[1]",
                              "trainer.profile_ranks=[0,1]"]).trainer.profile_ranks == [0, 1]
    message = config_error("trainer.profile_steps=[1]", "trainer.profile_ranks=[2]")
    assert "trainer.profile_ranks=[2]" in message and "actor+rollout: 2" in message
    assert "trainer.profile_ranks" in config_error("trainer.profile_steps=[1]", "trainer.profile_ranks=[]")
