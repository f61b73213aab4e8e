"""The run's records, fanned out to the loggers trainer.logger names (verl's names and key)."""
from __future__ import annotations

import importlib.util
import os
from contextlib import ExitStack

from rl_megatron.config.schema import Config
from rl_megatron.errors import ConfigError
from rl_megatron.tracking import jsonl, mlflow_run, tensorboard_events, wandb_run  # noqa: F401 (they register)
from rl_megatron.tracking.backend import BACKENDS, Backend, RunInfo
from rl_megatron.tracking.console import Console, write as write_line


def check_installed(logger: str, modules: tuple[str, ...]) -> None:
    """`modules` (what logger `logger` imports) can be imported; else a ConfigError naming the extra to install."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"trainer.logger names {logger}, whose library is not installed (no module {module!r}): "
                              f"pip install -e .[{logger}], or take {logger} out of trainer.logger.")


def check_loggers_installed(loggers: list[str]) -> None:
    """Every logger of trainer.logger can start: its optional library is installed."""
    for name in loggers:
        if name in BACKENDS:
            check_installed(name, BACKENDS[name].requires)


class Tracker:
    """`purge_after`: the step a resumed run continues from. What the loggers recorded after it (logged by the
    interrupted run after its checkpoint) is dropped where they can (metrics.jsonl, tensorboard), and the run logs
    those steps again. -1: a run that starts over (nothing recorded is kept; wandb and MLflow start a new run);
    None keeps everything. `config`: the resolved config as a plain dict, the run's config in wandb and MLflow."""

    def __init__(self, cfg: Config, config: dict, purge_after: int | None = None):
        trainer = cfg.trainer
        os.makedirs(trainer.run_dir, exist_ok=True)
        names = dict.fromkeys(trainer.logger)  # each once, in order
        self.console = (Console(trainer.progress_bar, cfg.algorithm.adv_estimator.upper(), trainer.total_steps)
                        if "console" in names else None)
        run = RunInfo(trainer.project_name, trainer.experiment_name, trainer.log_dir, trainer.run_dir, config,
                      purge_after)
        self.backends: list[Backend] = []
        with ExitStack() as started:  # a logger that fails to start closes those started before it
            for name in names:
                if name in BACKENDS:
                    backend = BACKENDS[name](run)
                    started.callback(backend.close, True)
                    self.backends.append(backend)
            started.pop_all()

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = {name: float(value) for name, value in metrics.items()}  # tensors too
        for backend in self.backends:
            backend.log(values, step)

    def log_table(self, tag: str, columns: list[str], rows: list[list], step: int) -> None:
        for backend in self.backends:
            backend.log_table(tag, columns, rows, step)

    def start_progress(self, initial_step: int) -> None:
        """The training steps begin after `initial_step`: the console's progress bar appears."""
        if self.console is not None:
            self.console.start(initial_step)

    def show_step(self, step: int, metrics: dict[str, float], reward_window_mean: float) -> None:
        """A step's progress on the console: its reward/mean and timing_s/step, and the mean reward of the trainer's
        window of the last steps."""
        if self.console is not None:
            self.console.show_step(step, metrics, reward_window_mean)

    @staticmethod
    def write(line: str) -> None:
        """A line of the trainer's (checkpoint saved, validation, ...): printed with or without the console
        logger, above its progress bar."""
        write_line(line)

    def close(self, failed: bool = False) -> None:
        """`failed`: the run ends with an exception (wandb and MLflow mark it failed)."""
        if self.console is not None:
            self.console.close()
        for backend in self.backends:
            backend.close(failed)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.close(failed=exc_type is not None)
