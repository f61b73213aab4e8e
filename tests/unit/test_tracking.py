import json
import os

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rl_megatron.tracking import Tracker


def read_jsonl(path):
    with open(path) as file:
        return [json.loads(line) for line in file]


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    with Tracker(str(run_dir)) as tracker:
        tracker.log({"reward/mean": 0.25, "pg_loss": torch.tensor(-1.5)}, step=1)
        tracker.log({"reward/mean": 0.75}, step=2)
        # Each line is flushed as it is logged, so it is readable while the run goes on.
        assert len(read_jsonl(run_dir / "metrics.jsonl")) == 2

    records = read_jsonl(run_dir / "metrics.jsonl")
    assert records == [{"step": 1, "reward/mean": 0.25, "pg_loss": -1.5}, {"step": 2, "reward/mean": 0.75}]
    assert isinstance(records[1]["reward/mean"], float)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir))
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [(event.step, event.value) for event in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]


def test_a_second_tracker_appends_to_the_same_run(tmp_path):
    with Tracker(str(tmp_path)) as tracker:
        tracker.log({"loss": 1.0}, step=1)
    with Tracker(str(tmp_path)) as tracker:
        tracker.log({"loss": 0.5}, step=2)
    assert [record["step"] for record in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_resumed_run_drops_the_steps_after_its_checkpoint_and_a_fresh_one_drops_all(tmp_path):
    with Tracker(str(tmp_path)) as tracker:
        for step in (0, 1, 2, 3):
            tracker.log({"loss": float(step)}, step=step)
    with Tracker(str(tmp_path), purge_after=2) as tracker:  # resumed from step 2's checkpoint
        tracker.log({"loss": 30.0}, step=3)
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(0, 0.0), (1, 1.0),
                                                                                       (2, 2.0), (3, 30.0)]
    with Tracker(str(tmp_path), purge_after=-1) as tracker:  # started over: nothing of the old records is kept
        tracker.log({"loss": 10.0}, step=1)
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 10.0}]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(event.step, event.value) for event in events.Scalars("loss")] == [(1, 10.0)]
