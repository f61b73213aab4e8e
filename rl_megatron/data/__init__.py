"""Prompt datasets (rows of prompt, ground_truth, data_source) and the loader that batches them."""

from rl_megatron.data.arithmetic import arithmetic_rows

# Built-in tasks generated on the fly, by `data.task` name: each returns rows with "prompt",
# "ground_truth" and "data_source" (which selects the reward function).
TASKS = {"arithmetic": arithmetic_rows}
