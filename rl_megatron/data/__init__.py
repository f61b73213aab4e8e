"""Prompt datasets (rows of prompt, ground_truth, data_source) and the loader that batches them.

The trainer builds its loader with `rl_megatron.data.build.build_prompt_loader`: a built-in task (below) or
parquet files in verl's layout (`rl_megatron.data.parquet_files`, written by `python -m rl_megatron.data.prepare`).
"""

from rl_megatron.data.arithmetic import arithmetic_rows
from rl_megatron.data.lookup import lookup_rows

# Built-in tasks generated on the fly, by `data.task` name: each returns rows with "prompt",
# "ground_truth" and "data_source" (which selects the reward function), and optionally "extra_info".
TASKS = {"arithmetic": arithmetic_rows, "lookup": lookup_rows}
DEFAULT_TASK = "arithmetic"  # what data.task means when neither it nor data.train_files is set
