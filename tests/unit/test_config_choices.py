"""The schema's fixed choices (rl_megatron/config/choices.py) are the names the packages act on: a choice the schema
accepts has its implementation, and an implementation has its choice."""
from rl_megatron.config.choices import DEFAULT_LOGGERS, LOGGERS, TASK_NAMES
from rl_megatron.data import DEFAULT_TASK, TASKS
from rl_megatron.tracking.tracker import BACKENDS


def test_every_logger_name_is_the_console_or_a_backend():
    assert set(LOGGERS) == {"console", *BACKENDS} and len(LOGGERS) == len(set(LOGGERS))
    assert set(DEFAULT_LOGGERS) <= set(LOGGERS)


def test_every_task_name_is_a_built_in_task():
    assert list(TASK_NAMES) == list(TASKS) and DEFAULT_TASK in TASK_NAMES
