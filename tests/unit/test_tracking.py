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
