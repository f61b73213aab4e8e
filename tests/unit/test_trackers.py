"""trainer.logger: the Tracker fanned out to console, tensorboard, jsonl, wandb and mlflow, each read back from what
the real library wrote (wandb offline, MLflow's local SQLite store); a resumed run continues the same wandb and
MLflow runs. One shared run of all five keeps the file at a few seconds."""
import glob
import json
import os
import struct

import mlflow
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from rl_megatron.config import Config, ConfigError, load, to_dict
from rl_megatron.config.fields import check_fields
from rl_megatron.config.schema import RULES
from rl_megatron.tracking import Tracker, check_installed, check_loggers_installed
from rl_megatron.tracking.mlflow_run import PARAM_VALUE_LIMIT
from rl_megatron.tracking.tensorboard_events import markdown_table

ALL = ["console", "tensorboard", "jsonl", "wandb", "mlflow"]
COLUMNS = ["prompt", "response", "score"]
ROWS = [["1+1=", "2", 1.0], ["2|3", "a\nb", 0.25]]
LONG_VALUE = "x" * (PARAM_VALUE_LIMIT + 100)


def run_config(log_dir, loggers, **trainer) -> Config:
    cfg = Config()
    cfg.trainer.log_dir, cfg.trainer.logger, cfg.trainer.experiment_name = str(log_dir), loggers, "loggers"
    cfg.trainer.project_name, cfg.trainer.total_steps = "tests", 4
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def tracker(cfg: Config, purge_after=None) -> Tracker:
    return Tracker(cfg, to_dict(cfg), purge_after)


def log_steps(tracker_: Tracker, steps, reward_offset=0.0) -> None:
    for step in steps:
        tracker_.log({"reward/mean": step / 4 + reward_offset, "timing_s/step": 0.5}, step)  # exact in float32


def stored_run_id(cfg: Config, logger: str) -> str:
    """The id of the wandb or MLflow run that the run folder names (a resumed run continues it)."""
    with open(os.path.join(cfg.trainer.run_dir, f"{logger}_run_id")) as f:
        return f.read().strip()


def mlflow_client(cfg: Config):
    return mlflow.MlflowClient(f"sqlite:///{cfg.trainer.log_dir}/mlflow.db")


def read_jsonl(path):
    with open(path) as file:
        return [json.loads(line) for line in file]


def scalars(run_dir, tag):
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


# ------------------------------------------------------------------------------------- all five loggers, resumed


def offline(env: pytest.MonkeyPatch, log_dir) -> None:
    """wandb offline and quiet, MLflow in the local store: nothing leaves `log_dir`."""
    env.setenv("WANDB_MODE", "offline")
    env.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env.setenv(variable, os.path.join(log_dir, "wandb-home"))
    env.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A run of all five loggers: steps 1-3 with a validation record and table at step 2, killed after step 3; then
    resumed from step 2's checkpoint, logging steps 3 and 4 again (other values)."""
    log_dir = tmp_path_factory.mktemp("loggers")
    with pytest.MonkeyPatch.context() as env:
        offline(env, log_dir)
        cfg = run_config(log_dir, ALL)
        cfg.data.train_files = [LONG_VALUE]  # a param longer than MLflow takes
        with tracker(cfg, purge_after=-1) as first:
            log_steps(first, [1, 2])
            first.log({"val/arithmetic/pass@4": 0.5}, 2)
            first.log_table("val/generations", COLUMNS, ROWS, 2)
            log_steps(first, [3])
        with tracker(cfg, purge_after=2) as resumed:
            log_steps(resumed, [3, 4], reward_offset=1.0)
    return cfg


def test_jsonl_keeps_the_records_up_to_the_checkpoint_and_the_resumed_ones(logged):
    records = read_jsonl(os.path.join(logged.trainer.run_dir, "metrics.jsonl"))
    assert [(r["step"], r["reward/mean"]) for r in records if "reward/mean" in r] == [
        (1, 0.25), (2, 0.5), (3, 1.75), (4, 2.0)]
    assert {"step": 2, "val/arithmetic/pass@4": 0.5} in records  # tables are not kept: numbers only


def test_tensorboard_purges_the_steps_after_the_checkpoint_and_shows_the_table_as_markdown(logged):
    assert scalars(logged.trainer.run_dir, "reward/mean") == [(1, 0.25), (2, 0.5), (3, 1.75), (4, 2.0)]
    events = EventAccumulator(logged.trainer.run_dir, size_guidance={"tensors": 0})
    events.Reload()
    [text] = events.Tensors("val/generations/text_summary")
    assert text.step == 2 and text.tensor_proto.string_val[0].decode() == markdown_table(COLUMNS, ROWS)


def wandb_records(path: str):
    """The records of a wandb transaction log (run-<id>.wandb): a 7-byte header (":W&B", magic, version), then
    LevelDB's log format, 32 KiB blocks of chunks (4-byte checksum, 2-byte length, 1-byte type: 1 full, 2 first, 3
    middle, 4 last) each holding (a piece of) a protobuf Record."""
    with open(path, "rb") as f:
        data = f.read()
    block, position, pieces = 32 * 1024, 7, b""
    while position + 7 <= len(data):
        room = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if room < 7 or kind == 0:  # the zero padding at a block's end
            position += room
            continue
        pieces += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(pieces)
            pieces = b""


def wandb_history(path: str) -> list[dict]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in wandb_records(path) if record.WhichOneof("record_type") == "history"]


def test_wandb_writes_an_offline_run_with_the_config_and_the_resumed_run_continues_it(logged):
    run_dir, run_id = logged.trainer.run_dir, stored_run_id(logged, "wandb")
    first, resumed = sorted(glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}*")))
    [header] = [r.run for r in wandb_records(os.path.join(first, f"run-{run_id}.wandb")) if r.HasField("run")]
    assert (header.run_id, header.project, header.display_name) == (run_id, "tests", "loggers")
    config = {item.key: json.loads(item.value_json) for item in header.config.update}
    assert config["trainer"]["logger"] == ALL and config["algorithm"]["adv_estimator"] == "grpo"
    history = wandb_history(os.path.join(first, f"run-{run_id}.wandb"))
    assert [(row["_step"], row.get("reward/mean")) for row in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert history[1]["val/arithmetic/pass@4"] == 0.5 and history[1]["val/generations/nrows"] == 2
    [table] = glob.glob(os.path.join(first, "files", "media", "table", "val", "generations_2_*.table.json"))
    with open(table) as f:
        assert json.load(f) == {"columns": COLUMNS, "data": ROWS}
    resumed_history = wandb_history(os.path.join(resumed, f"run-{run_id}.wandb"))
    assert [(row["_step"], row["reward/mean"]) for row in resumed_history] == [(3, 1.75), (4, 2.0)]


def test_mlflow_records_one_run_with_params_metrics_and_the_table_and_the_resumed_run_continues_it(logged):
    client = mlflow_client(logged)
    experiment = client.get_experiment_by_name("tests")
    [run] = client.search_runs([experiment.experiment_id], "attributes.run_name = 'loggers'")
    assert run.info.run_id == stored_run_id(logged, "mlflow")
    assert (run.info.run_name, run.info.status) == ("loggers", "FINISHED")
    assert experiment.artifact_location == os.path.join(logged.trainer.log_dir, "mlartifacts")
    params = run.data.params
    assert len(params) > 100  # logged in batches of at most 100
    assert params["trainer.experiment_name"] == "loggers" and params["actor.optim.lr"] == "1e-06"
    assert params["trainer.logger"] == str(ALL) and len(params["data.train_files"]) == PARAM_VALUE_LIMIT
    # MLflow keeps what it recorded: the steps after the checkpoint twice, the interrupted run's first.
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75), (3, 1.75), (4, 2.0)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "val/arithmetic/pass_4")] == [0.5]
    path = client.download_artifacts(run.info.run_id, "val/generations/step_2.json", logged.trainer.run_dir)
    with open(path) as f:
        assert json.load(f) == {"columns": COLUMNS, "data": ROWS}


def test_a_run_that_starts_over_gets_new_wandb_and_mlflow_runs(logged, monkeypatch):
    offline(monkeypatch, logged.trainer.log_dir)
    cfg = run_config(logged.trainer.log_dir, ["wandb", "mlflow"], experiment_name="started-over")

    def run_ids() -> list[str]:
        with tracker(cfg, purge_after=-1) as tracker_:
            log_steps(tracker_, [1])
        return [stored_run_id(cfg, "wandb"), stored_run_id(cfg, "mlflow")]

    first, second = run_ids(), run_ids()
    assert first[0] != second[0] and first[1] != second[1]


def test_a_run_ending_in_an_exception_is_marked_failed(logged, monkeypatch):
    offline(monkeypatch, logged.trainer.log_dir)
    cfg = run_config(logged.trainer.log_dir, ["mlflow"], experiment_name="interrupted")
    with pytest.raises(KeyboardInterrupt), tracker(cfg):
        raise KeyboardInterrupt  # a second Ctrl-C
    assert mlflow_client(cfg).get_run(stored_run_id(cfg, "mlflow")).info.status == "FAILED"


# ----------------------------------------------------------------------------------- jsonl and tensorboard alone


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    cfg = run_config(tmp_path, ["tensorboard", "jsonl"])
    path = os.path.join(cfg.trainer.run_dir, "metrics.jsonl")
    with tracker(cfg) as tracker_:
        tracker_.log({"reward/mean": 0.25, "pg_loss": torch.tensor(-1.5)}, step=1)
        tracker_.log({"reward/mean": 0.75}, step=2)
        # Each line is flushed as it is logged, so it is readable while the run goes on.
        assert len(read_jsonl(path)) == 2
    records = read_jsonl(path)
    assert records == [{"step": 1, "reward/mean": 0.25, "pg_loss": -1.5}, {"step": 2, "reward/mean": 0.75}]
    assert isinstance(records[1]["reward/mean"], float)
    assert scalars(cfg.trainer.run_dir, "reward/mean") == [(1, 0.25), (2, 0.75)]


def test_a_second_tracker_appends_to_the_same_run(tmp_path):
    cfg = run_config(tmp_path, ["jsonl"])
    with tracker(cfg) as tracker_:
        tracker_.log({"loss": 1.0}, step=1)
    with tracker(cfg) as tracker_:
        tracker_.log({"loss": 0.5}, step=2)
    assert [record["step"] for record in read_jsonl(os.path.join(cfg.trainer.run_dir, "metrics.jsonl"))] == [1, 2]


def test_a_fresh_run_drops_every_old_record(tmp_path):
    cfg = run_config(tmp_path, ["tensorboard", "jsonl"])
    with tracker(cfg) as tracker_:
        log_steps(tracker_, [0, 1, 2, 3])
    with tracker(cfg, purge_after=-1) as tracker_:  # started over: nothing of the old records is kept
        tracker_.log({"loss": 10.0}, step=1)
    assert read_jsonl(os.path.join(cfg.trainer.run_dir, "metrics.jsonl")) == [{"step": 1, "loss": 10.0}]
    assert scalars(cfg.trainer.run_dir, "loss") == [(1, 10.0)]


def test_the_table_in_markdown_escapes_pipes_and_newlines():
    assert markdown_table(COLUMNS, ROWS).splitlines() == [
        "| prompt | response | score |", "|---|---|---|", "| 1+1= | 2 | 1.000 |", "| 2\\|3 | a<br>b | 0.250 |"]


# ------------------------------------------------------------------------------------------------------ console


def show_three_steps(cfg: Config) -> None:
    with tracker(cfg) as tracker_:
        tracker_.start_progress(1)  # resumed from step 1
        for step in (2, 3):
            tracker_.show_step(step, {"reward/mean": step / 10, "timing_s/step": 1.5}, 0.125)
        tracker_.write("step 3: checkpoint saved")


def test_console_without_the_bar_prints_a_line_per_step(tmp_path, capsys):
    show_three_steps(run_config(tmp_path, ["console"], progress_bar=False))
    out, err = capsys.readouterr()
    assert out.splitlines() == ["step 2/4: reward=0.200, avg5=0.125, step_s=1.50",
                                "step 3/4: reward=0.300, avg5=0.125, step_s=1.50", "step 3: checkpoint saved"]
    assert err == ""


def test_console_with_the_bar_shows_the_steps_on_it(tmp_path, capsys):
    show_three_steps(run_config(tmp_path, ["console"], progress_bar=True))
    out, err = capsys.readouterr()
    assert out.splitlines() == ["step 3: checkpoint saved"]
    assert "GRPO:" in err and "3/4" in err and "avg5=0.125, reward=0.300, step_s=1.50" in err


def test_without_console_only_the_trainers_lines_are_printed(tmp_path, capsys):
    show_three_steps(run_config(tmp_path, ["jsonl"]))
    assert capsys.readouterr() == ("step 3: checkpoint saved\n", "")


# ------------------------------------------------------------------------------------------------ config checks


def test_an_unknown_logger_is_refused_naming_the_key_and_the_loggers():
    expected = "trainer.logger='neptune' is unknown: use one of console, tensorboard, jsonl, wandb, mlflow."
    with pytest.raises(ConfigError) as merged:
        load(None, ["model.path=m", "trainer.logger=[console,neptune]"])
    assert str(merged.value) == expected
    cfg = Config()
    cfg.trainer.logger = ["console", "neptune"]  # built in code
    with pytest.raises(ConfigError) as checked:
        check_fields(cfg, RULES)
    assert str(checked.value) == expected


def test_a_single_name_must_be_a_list():
    with pytest.raises(ConfigError, match=r"trainer.logger='wandb' must be a list, e.g. trainer.logger=\[wandb\]"):
        load(None, ["model.path=m", "trainer.logger=wandb"])


def test_a_logger_whose_library_is_missing_names_its_extra():
    check_loggers_installed(ALL)  # installed here (requirements-cpu.txt)
    with pytest.raises(ConfigError) as info:
        check_installed("wandb", ("wandb", "no_such_module_rl_megatron"))
    assert str(info.value) == ("trainer.logger names wandb, whose library is not installed (no module "
                               "'no_such_module_rl_megatron'): pip install -e .[wandb], or take wandb out of "
                               "trainer.logger.")
