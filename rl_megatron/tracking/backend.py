"""What every record-keeping logger of trainer.logger is given and does: one `Backend` per name (console aside)."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

from rl_megatron.registry import Registry


@dataclass(frozen=True)
class RunInfo:
    """The run a backend records."""

    project: str  # trainer.project_name: the wandb project, the MLflow experiment
    name: str  # trainer.experiment_name: the run's name
    log_dir: str  # trainer.log_dir: the parent of the run folders (the local MLflow store is shared by them)
    run_dir: str  # <log_dir>/<name>: this run's files
    config: dict  # the resolved config, a plain nested dict
    # The step a resumed run continues from: what was recorded after it is logged again. -1: the run starts over
    # (nothing recorded is kept); None: records are kept and appended to.
    purge_after: int | None


class Backend(ABC):
    """One logger of trainer.logger: records the run's metrics and tables somewhere."""

    requires: tuple[str, ...] = ()  # the optional modules it imports (setup.py's extra of its name installs them)

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """One record of `step` (validation's and the step's own come as two records of the same step)."""

    @abstractmethod
    def log_table(self, tag: str, columns: list[str], rows: list[list], step: int) -> None:
        """A table (e.g. validation's generations) of `step`."""

    @abstractmethod
    def close(self, failed: bool) -> None:
        """The run's end; `failed`: it ends with an exception."""


# The backends by their name in trainer.logger, each registered by its module (`@BACKENDS.register(name)`); the names
# are the fixed choices of `config.choices.LOGGERS` (with console, which shows the run on the terminal).
BACKENDS: Registry[type[Backend]] = Registry("logger", "trainer.logger")


def continued_run_id(run: RunInfo, file_name: str) -> str | None:
    """The id of the external run (wandb, MLflow) that `file_name` in the run folder names, when this run goes on
    with it: a resumed run continues the same external run, one that starts over (purge_after=-1) gets a new one.
    None: start a new one."""
    path = os.path.join(run.run_dir, file_name)
    if run.purge_after == -1 or not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def store_run_id(run: RunInfo, file_name: str, run_id: str) -> None:
    """Remembers the external run's id in the run folder, for a resumed run to continue it."""
    with open(os.path.join(run.run_dir, file_name), "w") as f:
        f.write(run_id + "\n")
