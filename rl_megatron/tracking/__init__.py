"""The run's records: the loggers of trainer.logger behind one `Tracker` (verl's key and names).

  tracker.py             Tracker, the check that the optional loggers are installed
  backend.py             what a logger is given (RunInfo) and does (Backend); the backends by logger name (BACKENDS)
  console.py             console: the progress bar, or one line per step
  jsonl.py               jsonl: metrics.jsonl, one JSON object per record
  tensorboard_events.py  tensorboard: scalars, tables as markdown text panels
  wandb_run.py           wandb: a Weights & Biases run (pip install -e .[wandb])
  mlflow_run.py          mlflow: an MLflow run (pip install -e .[mlflow])
"""
from rl_megatron.tracking.tracker import Tracker, check_installed, check_loggers_installed

__all__ = ["Tracker", "check_installed", "check_loggers_installed"]
