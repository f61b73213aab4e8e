"""The config's data section (`rl_megatron.config.schema.DataConfig`): its derived values and its checks.

`resolve_data_section` is what `rl_megatron.preflight.resolve` and the loader builder use; `check_data_section` and
`check_first_prompt_encodes` are the data package's part of the pre-flight check. File contents are checked when
they are read.
"""
from __future__ import annotations

import dataclasses

from rl_megatron.data import DEFAULT_TASK, TASKS
from rl_megatron.data.loader import tokenize_prompts
from rl_megatron.data.parquet_files import check_data_file, path_list, read_first_prompt
from rl_megatron.errors import ConfigError


def resolve_data_section(data):
    """The section with data.train_files / data.val_files as lists and data.task's default (the built-in task)
    filled in when no train files are set."""
    train_files = path_list(data.train_files, "data.train_files")
    val_files = path_list(data.val_files, "data.val_files")
    task = DEFAULT_TASK if data.task is None and not train_files else data.task
    return dataclasses.replace(data, train_files=train_files, val_files=val_files, task=task)


def check_data_section(data, files: bool = True) -> None:
    """A resolved data section: its files exist (unless not `files`: a dry run's plan reads none), and the train
    files and the built-in task do not both ask to be trained on."""
    for key in ("data.train_files", "data.val_files") if files else ():
        for index, path in enumerate(getattr(data, key.removeprefix("data."))):
            check_data_file(path, f"{key}[{index}]")
    if data.train_files and data.task is not None:
        # Both set is ambiguous (a config's task: line left over when pointing it at files): say which wins.
        raise ConfigError(f"data.task='{data.task}' and data.train_files are both set: the files replace the "
                          "built-in task, so remove data.task (data.task=null), or data.train_files to train on it.")


def check_first_prompt_encodes(data, tokenizer, model_path: str) -> None:
    """The first training prompt (data.train_files[0]'s first row, else data.task's first row) encodes to at least
    one token with the run's tokenizer (model.path's), rendered as the loader renders it (data.apply_chat_template).
    Catches a tokenizer that encodes everything to nothing, and chat prompts without a chat template, before anything
    starts; only that one prompt is read and encoded (the loader encodes them all when the trainer builds it)."""
    if data.train_files:
        source = f"data.train_files[0]='{data.train_files[0]}'"
        prompt = read_first_prompt(data.train_files[0], "data.train_files[0]")
    else:
        source, prompt = f"data.task={data.task}", TASKS[data.task]()[0]["prompt"]
    try:
        [ids] = tokenize_prompts([prompt], tokenizer, data.apply_chat_template)
    except ValueError as err:  # chat messages, but the tokenizer has no chat template
        raise ConfigError(f"{source}: {err}") from None
    if not ids:
        raise ConfigError(f"model.path='{model_path}': its tokenizer encodes the first prompt of {source} "
                          f"({prompt!r:.80}) to no tokens at all. Use the tokenizer saved with the model (its "
                          "tokenizer.json, or tokenizer_config.json with its vocabulary files).")
