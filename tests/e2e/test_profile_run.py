"""trainer.profile_steps end to end: a demo run records one step's phases with torch.profiler on rank 0 (the default
trainer.profile_ranks), one Chrome trace per phase."""
import json
import os

from helpers.runs import train

# Each phase's trace holds the range of the dispatched calls it recorded (`Phase.label`).
PHASE_RANGES = {"generate": "generate", "log_prob": "forward actor", "update": "train actor", "sync": "sync"}


def check_profile_traces(run_dir: str, step: int) -> None:
    """A demo run's `run_dir` (one worker group, actor+rollout, of two ranks) profiled at `step` alone, on rank 0."""
    profile_dir = os.path.join(run_dir, "profile")
    assert os.listdir(profile_dir) == [f"step_{step}"]
    step_dir = os.path.join(profile_dir, f"step_{step}")
    assert sorted(os.listdir(step_dir)) == sorted(f"actor+rollout_rank0_{phase}.json" for phase in PHASE_RANGES)
    for phase, label in PHASE_RANGES.items():
        with open(os.path.join(step_dir, f"actor+rollout_rank0_{phase}.json")) as f:
            events = json.load(f)["traceEvents"]
        assert any(event.get("name") == label and event.get("dur", 0) > 0 for event in events), phase
        assert sum(event.get("name", "").startswith("aten::") for event in events) > 0, phase


def test_a_profiled_step_leaves_a_trace_per_phase_on_rank_0(tmp_path):
    stdout, rows, run_dir = train(tmp_path, "trainer.total_steps=2", "trainer.profile_steps=[2]",
                                  "trainer.save_every=-1")
    assert [row["step"] for row in rows] == [1, 2]
    check_profile_traces(run_dir, step=2)
    assert "step 2: update profiled in " in stdout
