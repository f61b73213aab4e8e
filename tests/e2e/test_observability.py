"""Watching and debugging a run, end to end on the demo's run (helpers/demo_run.py: every logger, a profiled step,
validation and checkpoints, every step's samples), then a validation-only run of its last checkpoint. (Each
logger's records are read back in detail by tests/unit/test_trackers.py; here they must come from a real run.)"""
import json
import os
import re

import mlflow
import pytest

from helpers.demo_run import PROFILED_STEP, ROLLOUT_DATA, VAL_EVERY, step_rows, validated_steps
from helpers.runs import train

# Each phase's trace holds the range of the dispatched calls it recorded (`Phase.label`).
PHASE_RANGES = {"generate": "generate", "log_prob": "forward actor", "update": "train actor", "sync": "sync"}
# What the console may show: the plan, the progress lines, validation, checkpoint and profiling lines, the summary.
CONSOLE_LINE = re.compile(r"(data \((train|val)\): |Cluster plan: |Model: |Memory per device|  |step \d+/\d+: reward=|"
                          r"step \d+ validation: |step \d+: checkpoint saved to |step \d+: profiled; |Done: |Target |"
                          r"Metrics: |Validation only \(trainer.val_only\): |Validated |"
                          r"Every sample with its score: |$)")


def test_the_console_shows_only_what_a_user_acts_on(demo_run):
    _, stdout, rows, run_dir = demo_run
    lines = stdout.splitlines()
    assert [line for line in lines if not CONSOLE_LINE.match(line)] == []
    assert re.search(rf"^Done: {len(step_rows(rows))} steps in \d+ s, after \d+ s of start-up\. Mean reward", stdout, re.M), stdout
    for step in validated_steps(rows):
        assert re.search(rf"^step {step} validation: val/arithmetic/reward_mean=", stdout, re.M), step
        assert re.search(rf"^step {step}: checkpoint saved to ", stdout, re.M), step
    # The workers' output (their libraries' notices too) is in their log files.
    for rank in (0, 1):
        with open(os.path.join(run_dir, "logs", f"worker_actor_{rank}.log")) as f:
            assert f.read().strip()


def test_a_profiled_step_leaves_a_chrome_trace_per_phase_on_rank_0(demo_run):
    _, stdout, _, run_dir = demo_run
    step_dir = os.path.join(run_dir, "profile", f"step_{PROFILED_STEP}")
    assert os.listdir(os.path.join(run_dir, "profile")) == [f"step_{PROFILED_STEP}"]
    assert sorted(os.listdir(step_dir)) == sorted(f"actor+rollout_rank0_{phase}.json" for phase in PHASE_RANGES)
    for phase, label in PHASE_RANGES.items():
        with open(os.path.join(step_dir, f"actor+rollout_rank0_{phase}.json")) as f:
            events = json.load(f)["traceEvents"]
        assert any(event.get("name") == label and event.get("dur", 0) > 0 for event in events), phase
        assert any(event.get("name", "").startswith("aten::") for event in events), phase
    assert f"step {PROFILED_STEP}: profiled; a Chrome trace per phase and rank in {step_dir}" in stdout


def test_every_logger_records_the_run(demo_run):
    log_dir, stdout, rows, run_dir = demo_run
    steps = [row["step"] for row in step_rows(rows)]
    assert steps == list(range(1, len(steps) + 1))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir))
    assert [name for name in os.listdir(os.path.join(run_dir, "wandb")) if name.startswith("offline-run-")]
    client = mlflow.MlflowClient(f"sqlite:///{log_dir}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("rl_megatron").experiment_id])
    assert run.info.run_name == "demo_cpu" and run.data.params["trainer.val_every"] == str(VAL_EVERY)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == steps
    tables = client.list_artifacts(run.info.run_id, "val/generations")
    assert sorted(table.path for table in tables) == sorted(f"val/generations/step_{step}.json"
                                                            for step in validated_steps(rows))
    assert "wandb (project rl_megatron, run demo_cpu); mlflow (experiment rl_megatron, run demo_cpu)" in stdout


def last_validation(run_dir, rows) -> str:
    with open(os.path.join(run_dir, "validation", f"step_{rows[-1]['step']}.jsonl")) as f:
        return f.read()


def test_validation_writes_every_sample_with_its_score(demo_run):
    _, _, rows, run_dir = demo_run
    validations = [row for row in rows if "val/arithmetic/reward_mean" in row]
    assert [row["step"] for row in validations] == validated_steps(rows)
    assert sorted(os.listdir(os.path.join(run_dir, "validation"))) == sorted(
        f"step_{step}.jsonl" for step in validated_steps(rows))
    samples = [json.loads(line) for line in last_validation(run_dir, rows).splitlines()]
    assert len(samples) == 55 and {s["data_source"] for s in samples} == {"arithmetic"}
    assert validations[-1]["val/arithmetic/reward_mean"] == pytest.approx(sum(s["score"] for s in samples) / 55)


def test_every_step_writes_its_samples(demo_run):
    """trainer.rollout_data_dir: a file per trained step, a line per sample (32 prompts x rollout.n=8), prompt-major,
    each with the reward the step's reward/mean averages."""
    log_dir, _, rows, _ = demo_run
    steps = [row["step"] for row in step_rows(rows)]
    folder = os.path.join(log_dir, ROLLOUT_DATA)
    assert sorted(os.listdir(folder)) == sorted(f"{step}.jsonl" for step in steps)
    keys = ["step", "data_source", "prompt", "response", "score", "ground_truth", "acc", "advantage", "status",
            "model_tokens", "policy_version", "turns"]
    for row in step_rows(rows):
        with open(os.path.join(folder, f"{row['step']}.jsonl")) as f:
            samples = [json.loads(line) for line in f]
        assert len(samples) == 256 and all(list(sample) == keys for sample in samples)
        assert {(s["step"], s["data_source"], s["policy_version"]) for s in samples} == {(row["step"], "arithmetic",
                                                                                         row["step"] - 1)}
        assert all(len({s["prompt"] for s in samples[i:i + 8]}) == 1 for i in range(0, 256, 8))
        assert row["reward/mean"] == pytest.approx(sum(s["score"] for s in samples) / 256)


def test_val_only_validates_the_checkpoint_and_changes_nothing_else(demo_run):
    """The same greedy validation of the same weights (the last step's checkpoint), without training: the same
    samples."""
    log_dir, _, trained_rows, run_dir = demo_run
    last = trained_rows[-1]["step"]
    validated = last_validation(run_dir, trained_rows)
    stdout, rows, _ = train(log_dir, "trainer.val_only=true", "trainer.logger=[console,jsonl]")
    checkpoint = os.path.join(run_dir, "checkpoints", f"global_step_{last}")
    assert f"Validation only (trainer.val_only): the weights of the checkpoint {checkpoint} (step {last})" in stdout
    assert re.search(r"^Validated 55 samples in \d+ s, after \d+ s of start-up: val/arithmetic/reward_mean=", stdout,
                     re.M), stdout
    assert last_validation(run_dir, trained_rows) == validated
    # The run's records are kept; the validation is appended at the checkpoint's step.
    assert rows[:-1] == trained_rows and set(rows[-1]) == {"step", "val/arithmetic/reward_mean",
                                                       "val/arithmetic/acc"}
    assert rows[-1]["step"] == last
    assert not any(line.startswith(("step 1/", "Done:")) for line in stdout.splitlines())
