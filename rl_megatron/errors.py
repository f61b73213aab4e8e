"""The errors rl_megatron raises for the user to act on: each message names what is wrong, where, and the fix.

A leaf module (nothing of the project imported), so that every package can raise them without importing
another package's machinery; the command-line entry points print them as one `error: ...` line.
"""


class ConfigError(ValueError):
    """A configuration problem, worded for the user: what is wrong, where, and how to fix it."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked, worded for the user: the path and what is wrong."""


class LaunchError(ValueError):
    """The launch environment does not match the config; the message names the variable or key and the fix."""


def one_line(text) -> str:
    """Any (multi-line) message as one line."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())
