"""The e2e tier's one run of `make demo` (the session fixture `demo_run` in tests/e2e/conftest.py), with what a user
watching it turns on. Sampling seeds depend on (trainer.seed, purpose, step) only, and neither profiling nor writing
the samples changes the arithmetic, so its trained steps are the plain demo's (tests/e2e/test_train_cli.py compares
them with a recorded trace)."""
from helpers.runs import train

# Every logger, offline.
LOGGERS = "trainer.logger=[console,tensorboard,jsonl,wandb,mlflow]"
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
# Validated and saved every this many steps, and after the last (the demo reaches its target in ~130-250 steps).
VAL_EVERY = 50
# The step traced by torch.profiler.
PROFILED_STEP = 2
# trainer.rollout_data_dir, under the run's log_dir.
ROLLOUT_DATA = "rollouts"


def run_demo(log_dir) -> tuple:
    """The demo to its target with every logger, step PROFILED_STEP profiled, validation and checkpoints every
    VAL_EVERY steps and at the end, every step's samples in <log_dir>/ROLLOUT_DATA. Returns (log_dir, stdout,
    metrics.jsonl records, run folder): a record per step, and one per validation (at the step it followed)."""
    stdout, rows, run_dir = train(log_dir, f"trainer.profile_steps=[{PROFILED_STEP}]", f"trainer.val_every={VAL_EVERY}",
                                  f"trainer.save_every={VAL_EVERY}", LOGGERS,
                                  f"trainer.rollout_data_dir={log_dir}/{ROLLOUT_DATA}", env=OFFLINE)
    return log_dir, stdout, rows, run_dir


def step_rows(rows) -> list[dict]:
    """The records of the trained steps, without the validations'."""
    return [row for row in rows if "reward/mean" in row]


def validated_steps(rows) -> list[int]:
    """The steps the run validated (and saved): every VAL_EVERY, and the last."""
    last = rows[-1]["step"]
    return sorted({*range(VAL_EVERY, last + 1, VAL_EVERY), last})
