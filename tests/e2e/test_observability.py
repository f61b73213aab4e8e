"""Watching and debugging a run, end to end on the demo: one short run with every logger, a profiled step and a
validation, then a validation-only run of its checkpoint. (Each logger's records are read back in detail by
tests/unit/test_trackers.py; here they must come from a real run.)"""
import json
import os
import re

import mlflow
import pytest

from helpers.runs import train

# Each phase's trace holds the range of the dispatched calls it recorded (`Phase.label`).
PHASE_RANGES = {"generate": "generate", "log_prob": "forward actor", "update": "train actor", "sync": "sync"}
LOGGERS = "trainer.logger=[console,tensorboard,jsonl,wandb,mlflow]"
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
# What the console may show: the plan, the progress lines, validation, checkpoint and profiling lines, the summary.
CONSOLE_LINE = re.compile(r"(data \((train|val)\): |Cluster plan: |Model: |Memory per device|  |step \d+/\d+: reward=|"
                          r"step \d+ validation: |step \d+: checkpoint saved to |step \d+: profiled; |Done: |Target |"
                          r"Metrics: |Validation only \(trainer.val_only\): |Validated |"
                          r"Every sample with its score: |$)")


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """The demo for two steps: step 2 profiled and validated, then a checkpoint."""
    log_dir = tmp_path_factory.mktemp("observed")
    stdout, rows, run_dir = train(log_dir, "trainer.total_steps=2", "trainer.profile_steps=[2]", "trainer.val_every=2",
                                  LOGGERS, env=OFFLINE)
    with open(os.path.join(run_dir, "validation", "step_2.jsonl")) as f:
        validated = f.read()
    return log_dir, stdout, rows, run_dir, validated


def test_the_console_shows_only_what_a_user_acts_on(observed):
    _, stdout, _, run_dir, _ = observed
    lines = stdout.splitlines()
    assert [line for line in lines if not CONSOLE_LINE.match(line)] == []
    assert re.search(r"^Done: 2 steps in \d+ s, after \d+ s of start-up\. Mean reward", stdout, re.M), stdout
    # The workers' output (their libraries' notices too) is in their log files.
    for rank in (0, 1):
        with open(os.path.join(run_dir, "logs", f"worker_actor_{rank}.log")) as f:
            assert f.read().strip()


def test_a_profiled_step_leaves_a_chrome_trace_per_phase_on_rank_0(observed):
    _, stdout, _, run_dir, _ = observed
    step_dir = os.path.join(run_dir, "profile", "step_2")
    assert os.listdir(os.path.join(run_dir, "profile")) == ["step_2"]
    assert sorted(os.listdir(step_dir)) == sorted(f"actor+rollout_rank0_{phase}.json" for phase in PHASE_RANGES)
    for phase, label in PHASE_RANGES.items():
        with open(os.path.join(step_dir, f"actor+rollout_rank0_{phase}.json")) as f:
            events = json.load(f)["traceEvents"]
        assert any(event.get("name") == label and event.get("dur", 0) > 0 for event in events), phase
        assert any(event.get("name", "").startswith("aten::") for event in events), phase
    assert f"step 2: profiled; a Chrome trace per phase and rank in {step_dir}" in stdout


def test_every_logger_records_the_run(observed):
    log_dir, stdout, rows, run_dir, _ = observed
    assert [row["step"] for row in rows if "reward/mean" in row] == [1, 2]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir))
    assert [name for name in os.listdir(os.path.join(run_dir, "wandb")) if name.startswith("offline-run-")]
    client = mlflow.MlflowClient(f"sqlite:///{log_dir}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("rl_megatron").experiment_id])
    assert run.info.run_name == "demo_cpu" and run.data.params["trainer.total_steps"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2]
    tables = client.list_artifacts(run.info.run_id, "val/generations")
    assert [table.path for table in tables] == ["val/generations/step_2.json"]
    assert "wandb (project rl_megatron, run demo_cpu); mlflow (experiment rl_megatron, run demo_cpu)" in stdout


def test_validation_writes_every_sample_with_its_score(observed):
    _, stdout, rows, _, validated = observed
    samples = [json.loads(line) for line in validated.splitlines()]
    assert len(samples) == 55 and {s["data_source"] for s in samples} == {"arithmetic"}
    [validation] = [row for row in rows if "val/arithmetic/reward_mean" in row]
    assert validation["step"] == 2
    assert validation["val/arithmetic/reward_mean"] == pytest.approx(sum(s["score"] for s in samples) / 55)


def test_val_only_validates_the_checkpoint_and_changes_nothing_else(observed):
    """The same greedy validation of the same weights (step 2's checkpoint), without training: the same samples."""
    log_dir, _, trained_rows, run_dir, validated = observed
    stdout, rows, _ = train(log_dir, "trainer.val_only=true", "trainer.logger=[console,jsonl]")
    checkpoint = os.path.join(run_dir, "checkpoints", "global_step_2")
    assert f"Validation only (trainer.val_only): the weights of the checkpoint {checkpoint} (step 2)" in stdout
    assert re.search(r"^Validated 55 samples in \d+ s, after \d+ s of start-up: val/arithmetic/reward_mean=", stdout,
                     re.M), stdout
    with open(os.path.join(run_dir, "validation", "step_2.jsonl")) as f:
        assert f.read() == validated
    # The run's records are kept; the validation is appended at the checkpoint's step.
    assert rows[:-1] == trained_rows and set(rows[-1]) == {"step", "val/arithmetic/reward_mean",
                                                       "val/arithmetic/acc"}
    assert rows[-1]["step"] == 2
    assert not any(line.startswith(("step 1/", "Done:")) for line in stdout.splitlines())
