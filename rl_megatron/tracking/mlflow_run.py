"""trainer.logger's mlflow: an MLflow run (`pip install -e .[mlflow]`).

The tracking store is MLFLOW_TRACKING_URI if set, else a local one shared by the runs of trainer.log_dir:
sqlite:///<log_dir>/mlflow.db, artifacts in <log_dir>/mlartifacts (MLflow 3 refuses its plain file store);
`mlflow ui --backend-store-uri sqlite:///<log_dir>/mlflow.db` shows them. Experiment trainer.project_name, run name
trainer.experiment_name, the resolved config as params with dotted keys, tables as JSON artifacts in MLflow's table
format. A resumed run continues the same MLflow run (its id is kept in <run_dir>/mlflow_run_id). MLflow can neither
drop a recorded value nor change a param: the steps a resumed run logs again are recorded twice, and a changed
config value keeps its first param (new keys are added).
"""
from __future__ import annotations

import logging
import os
import re
import time

from rl_megatron.tracking.backend import BACKENDS, Backend, RunInfo, continued_run_id, store_run_id

ID_FILE = "mlflow_run_id"
PARAM_VALUE_LIMIT = 6000  # MLflow's longest param value, in characters
PARAMS_PER_CALL = 100  # what one MLflow log_batch call takes at most
METRICS_PER_CALL = 1000


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys, values as text cut to PARAM_VALUE_LIMIT."""
    params = {}
    for key, value in config.items():
        if isinstance(value, dict):
            params |= flat_params(value, f"{prefix}{key}.")
        else:
            params[prefix + key] = str(value)[:PARAM_VALUE_LIMIT]
    return params


def metric_name(name: str) -> str:
    """`name` with the characters MLflow refuses in a metric's name (e.g. the @ of val/<source>/pass@4) as _."""
    return re.sub(r"[^\w./\- :]", "_", name)


def batches(items: list, size: int) -> list[list]:
    return [items[start:start + size] for start in range(0, len(items), size)]


@BACKENDS.register("mlflow")
class MlflowRun(Backend):
    requires = ("mlflow", "sqlalchemy", "alembic")  # the local store is SQLite through SQLAlchemy and alembic

    def __init__(self, run: RunInfo):
        import mlflow  # optional: imported only when trainer.logger names it
        from mlflow.entities import Metric, Param

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines (creating tables ...) on the console
        self._metric_type = Metric
        uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI"), None
        if uri is None:
            uri = "sqlite:///" + os.path.abspath(os.path.join(run.log_dir, "mlflow.db"))
            artifacts = os.path.abspath(os.path.join(run.log_dir, "mlartifacts"))
        self._client = mlflow.MlflowClient(uri)
        self._run_id = self._continued_run(run) or self._new_run(run, artifacts)
        store_run_id(run, ID_FILE, self._run_id)
        logged = self._client.get_run(self._run_id).data.params
        params = [Param(key, value) for key, value in flat_params(run.config).items() if key not in logged]
        for batch in batches(params, PARAMS_PER_CALL):
            self._client.log_batch(self._run_id, params=batch)

    def _continued_run(self, run: RunInfo) -> str | None:
        """The stored run, running again; None if there is none, or this store lacks it (MLFLOW_TRACKING_URI
        changed, mlflow.db deleted)."""
        from mlflow.exceptions import MlflowException

        run_id = continued_run_id(run, ID_FILE)
        if run_id is None:
            return None
        try:
            self._client.update_run(run_id, status="RUNNING")
        except MlflowException:
            return None
        return run_id

    def _new_run(self, run: RunInfo, artifacts: str | None) -> str:
        experiment = self._client.get_experiment_by_name(run.project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self._client.create_experiment(run.project, artifact_location=artifacts))
        return self._client.create_run(experiment_id, run_name=run.name).info.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        timestamp = int(time.time() * 1000)
        records = [self._metric_type(metric_name(name), value, timestamp, step) for name, value in metrics.items()]
        for batch in batches(records, METRICS_PER_CALL):
            self._client.log_batch(self._run_id, metrics=batch)

    def log_table(self, tag: str, columns: list[str], rows: list[list], step: int) -> None:
        # mlflow.log_table writes this layout too, but needs pandas.
        self._client.log_dict(self._run_id, {"columns": columns, "data": rows}, f"{tag}/step_{step}.json")

    def close(self, failed: bool) -> None:
        self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")
