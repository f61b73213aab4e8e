"""Prompt rows from parquet files in verl's column layout (what verl's and TinyZero's preprocessing scripts write).

    data_source   string: selects the reward function
    prompt        list of {"role", "content"} chat messages, or a plain string
    reward_model  struct with a `ground_truth` field of any JSON-like type (a string, or e.g. TinyZero's countdown
                  {"target": int, "numbers": [int]})
    extra_info    optional, any type: handed to the batch unchanged (reward functions may use it)

Every problem is reported as a DataFileError naming the config key, the file, and where it can the row and column.
"""
from __future__ import annotations

import hashlib
import os

import pyarrow as pa
import pyarrow.parquet as pq

from rl_megatron.errors import ConfigError, one_line

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
LAYOUT_HINT = ("verl's layout has the columns data_source (string), prompt (list of {role, content} messages, or a "
               "string), reward_model (struct with a ground_truth field) and optionally extra_info; "
               "`python -m rl_megatron.data.prepare --help` writes such files")
READ_FIX = ("Write it with pyarrow.parquet.write_table or pandas.DataFrame.to_parquet (or "
            "`python -m rl_megatron.data.prepare`), or remove it from the list.")


class DataFileError(ConfigError):
    """A data file that cannot be used, with the config key, file, row (0-based) and column it concerns."""

    def __init__(self, key: str, path: str, problem: str, fix: str, row: int | None = None,
                 column: str | None = None):
        where = f"file '{path}'"
        if row is not None:
            where += f", row {row} (0-based)"
        if column is not None:
            where += f", column '{column}'"
        super().__init__(f"{key}: {where}: {problem}. {fix}")
        self.key, self.path, self.row, self.column = key, path, row, column


def path_list(value, key: str) -> list[str]:
    """The config value of data.train_files / data.val_files as a list (one path is accepted too, as verl's command
    lines pass it); `check_data_file` checks each."""
    if value is None:
        return []
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, (list, tuple)):
        raise ConfigError(f"{key}={value!r} must be a list of parquet paths (or one path), e.g. "
                          f"{key}=[data/train.parquet].")
    return list(paths)


def check_data_file(path, key: str) -> None:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key}={path!r} must be a non-empty path to a parquet file.")
    if not os.path.exists(path):
        raise DataFileError(key, path, f"does not exist (relative paths count from {os.getcwd()})",
                            "Fix the path, or write the files with `python -m rl_megatron.data.prepare`.")
    if not os.path.isfile(path):
        raise DataFileError(key, path, "is not a file", "Name the parquet files themselves, not a folder.")


def files_fingerprint(paths: list[str]) -> str:
    """A hash of the files' contents, in order: a loader position saved over them is only valid over the same."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0end-of-file\0")  # so that moving bytes from one file to the next changes the hash
    return f"sha256:{digest.hexdigest()[:16]}"


def read_prompt_rows(paths: list[str], key: str) -> list[dict]:
    """The rows of every file, in order, as {"prompt", "ground_truth", "data_source", "extra_info"}."""
    rows = []
    for index, path in enumerate(paths):
        rows += read_parquet_rows(path, f"{key}[{index}]")
    return rows


def read_parquet_rows(path: str, key: str) -> list[dict]:
    check_data_file(path, key)
    table = _read_table(path, key)
    if table.num_rows == 0:
        raise DataFileError(key, path, "has no rows", "Point the key at a file with prompts.")
    missing = [name for name in REQUIRED_COLUMNS if name not in table.column_names]
    if missing:
        raise DataFileError(key, path, f"has no column '{missing[0]}' (its columns: {', '.join(table.column_names)})",
                            f"{LAYOUT_HINT}.", column=missing[0])
    reward_type = table.schema.field("reward_model").type
    if pa.types.is_struct(reward_type) and reward_type.get_field_index("ground_truth") < 0:
        raise DataFileError(key, path, "the struct has no field 'ground_truth' (its fields: "
                            f"{', '.join(f.name for f in reward_type)})", f"{LAYOUT_HINT}.",
                            column="reward_model.ground_truth")

    def values(name):
        return table.column(name).to_pylist()

    sources, prompts, reward_models = values("data_source"), values("prompt"), values("reward_model")
    _check_type(key, path, "data_source", sources, _is_text(table.schema.field("data_source").type), "strings")
    _check_type(key, path, "prompt", prompts, _is_text(table.schema.field("prompt").type)
                or _is_message_list(table.schema.field("prompt").type),
                "lists of {role, content} messages (both strings) or strings")
    _check_type(key, path, "reward_model", reward_models, pa.types.is_struct(reward_type),
                "structs with a ground_truth field")
    extra_infos = values("extra_info") if "extra_info" in table.column_names else [None] * table.num_rows
    rows = []
    for row, (source, prompt, reward_model, extra_info) in enumerate(zip(sources, prompts, reward_models,
                                                                         extra_infos)):
        if not source:
            raise DataFileError(key, path, f"data_source is {source!r}", "Name the dataset (its reward function) "
                                "in every row, e.g. openai/gsm8k.", row=row, column="data_source")
        _check_prompt(key, path, row, prompt)
        if reward_model is None or reward_model["ground_truth"] is None:
            raise DataFileError(key, path, "the ground truth is null", "Give every row its answer.", row=row,
                                column="reward_model.ground_truth")
        rows.append({"prompt": prompt, "ground_truth": reward_model["ground_truth"], "data_source": source,
                     "extra_info": {} if extra_info is None else extra_info})
    return rows


def read_first_prompt(path: str, key: str):
    """The prompt of the file's first row, read alone (only that column's first batch): what the pre-flight check
    encodes. The loader reads and checks every row (`read_parquet_rows`); the problems found here are worded alike."""
    check_data_file(path, key)
    _check_not_empty(path, key)
    try:
        parquet = pq.ParquetFile(path)
        if "prompt" not in parquet.schema_arrow.names:
            raise DataFileError(key, path, f"has no column 'prompt' (its columns: "
                                f"{', '.join(parquet.schema_arrow.names)})", f"{LAYOUT_HINT}.", column="prompt")
        prompt_type = parquet.schema_arrow.field("prompt").type
        first = next(parquet.iter_batches(batch_size=1, columns=["prompt"]), None)
    except (pa.ArrowException, OSError) as err:
        raise DataFileError(key, path, f"is not a readable parquet file ({one_line(err)})", READ_FIX) from None
    if first is None or first.num_rows == 0:
        raise DataFileError(key, path, "has no rows", "Point the key at a file with prompts.")
    prompt = first.column(0)[0].as_py()
    _check_type(key, path, "prompt", [prompt], _is_text(prompt_type) or _is_message_list(prompt_type),
                "lists of {role, content} messages (both strings) or strings")
    _check_prompt(key, path, 0, prompt)
    return prompt


def _check_not_empty(path: str, key: str) -> None:
    if os.path.getsize(path) == 0:
        raise DataFileError(key, path, "is empty (0 bytes)", READ_FIX)


def _read_table(path: str, key: str) -> pa.Table:
    _check_not_empty(path, key)
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise DataFileError(key, path, f"is not a readable parquet file ({one_line(err)})", READ_FIX) from None


def _is_text(arrow_type: pa.DataType) -> bool:
    if pa.types.is_dictionary(arrow_type):  # e.g. a pandas categorical column
        return _is_text(arrow_type.value_type)
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def _is_message_list(arrow_type: pa.DataType) -> bool:
    if not (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
        return False
    message = arrow_type.value_type
    return pa.types.is_struct(message) and all(
        message.get_field_index(name) >= 0 and _is_text(message.field(name).type) for name in ("role", "content"))


def _check_type(key: str, path: str, column: str, values: list, matches: bool, expected: str) -> None:
    if matches:
        return
    row = next((i for i, value in enumerate(values) if value is not None), 0)
    raise DataFileError(key, path, f"holds {type(values[row]).__name__} values (e.g. {values[row]!r:.80}), not "
                        f"{expected}", f"{LAYOUT_HINT}.", row=row, column=column)


def _check_prompt(key: str, path: str, row: int, prompt) -> None:
    if prompt is None or prompt == "" or prompt == []:
        raise DataFileError(key, path, f"the prompt is {prompt!r}", "Give every row a prompt, or drop the row.",
                            row=row, column="prompt")
    if isinstance(prompt, str):
        return
    for index, message in enumerate(prompt):
        for field in ("role", "content"):
            # A chat template needs both; an empty content is fine (e.g. an empty system message).
            if message[field] is None or (field == "role" and not message[field]):
                raise DataFileError(key, path, f"message {index} has {field}={message[field]!r}",
                                    "Give every message a role (system, user, assistant) and a string content.",
                                    row=row, column=f"prompt[{index}].{field}")
