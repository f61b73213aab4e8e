"""The config's data section (`rl_megatron.config.schema.DataConfig`): its derived values and its checks.

`resolve_data_section` is what `rl_megatron.config.resolve` and the loader builder use; `check_data_section` is
the data package's part of the pre-flight check. File contents are checked when they are read.
"""
from __future__ import annotations

import dataclasses

from rl_megatron.data import DEFAULT_TASK
from rl_megatron.data.parquet_files import check_data_file, path_list
from rl_megatron.errors import ConfigError


def resolve_data_section(data):
    """The section with data.train_files / data.val_files as lists and data.task's default (the built-in task)
    filled in when no train files are set."""
    train_files = path_list(data.train_files, "data.train_files")
    val_files = path_list(data.val_files, "data.val_files")
    task = DEFAULT_TASK if data.task is None and not train_files else data.task
    return dataclasses.replace(data, train_files=train_files, val_files=val_files, task=task)


def check_data_section(data) -> None:
    """A resolved data section: its files exist, and the train files and the built-in task do not both ask to be
    trained on."""
    for key in ("data.train_files", "data.val_files"):
        for index, path in enumerate(getattr(data, key.removeprefix("data."))):
            check_data_file(path, f"{key}[{index}]")
    if data.train_files and data.task is not None:
        # Both set is ambiguous (a config's task: line left over when pointing it at files): say which wins.
        raise ConfigError(f"data.task='{data.task}' and data.train_files are both set: the files replace the "
                          "built-in task, so remove data.task (data.task=null), or data.train_files to train on it.")
