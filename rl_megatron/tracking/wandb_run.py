"""trainer.logger's wandb: a Weights & Biases run (`pip install -e .[wandb]`).

Project trainer.project_name, run name trainer.experiment_name, the resolved config as the run's config, files in
<run_dir>/wandb. WANDB_MODE=offline keeps the run on disk (`wandb sync <run_dir>/wandb/offline-run-*` uploads it);
WANDB_API_KEY or `wandb login` for the online mode. A resumed run continues the same W&B run (its id is kept in
<run_dir>/wandb_run_id). W&B cannot rewrite history: of the steps a resumed run logs again (those after its
checkpoint), W&B keeps the first values, as its steps only go up.
"""
from __future__ import annotations

import uuid

from rl_megatron.tracking.backend import BACKENDS, Backend, RunInfo, continued_run_id, store_run_id

ID_FILE = "wandb_run_id"


@BACKENDS.register("wandb")
class WandbRun(Backend):
    requires = ("wandb",)

    def __init__(self, run: RunInfo):
        import wandb  # optional: imported only when trainer.logger names it

        self._table_type = wandb.Table
        run_id = continued_run_id(run, ID_FILE) or uuid.uuid4().hex[:16]
        store_run_id(run, ID_FILE, run_id)
        self._run = wandb.init(project=run.project, name=run.name, config=run.config, dir=run.run_dir, id=run_id,
                               resume="allow")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_table(self, tag: str, columns: list[str], rows: list[list], step: int) -> None:
        self._run.log({tag: self._table_type(columns=columns, data=rows)}, step=step)

    def close(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)
