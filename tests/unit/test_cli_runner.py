"""rl_megatron.cli.run_command, the runner the three command-line entry points share: the project's user-facing
errors become one `error: ...` line on stderr and exit code 2; anything else keeps its traceback."""
import pytest

from rl_megatron.checkpoint import CheckpointError
from rl_megatron.cli import run_command
from rl_megatron.config import ConfigError
from rl_megatron.errors import one_line


def fail(err: Exception):
    def body():
        raise err
    return body


def test_the_body_s_exit_code_and_none_as_zero(capsys):
    assert run_command(lambda: 3, ConfigError) == 3
    assert run_command(lambda: None, ConfigError) == 0
    assert capsys.readouterr().err == ""


def test_a_listed_error_is_one_error_line_and_exit_code_2(capsys):
    assert run_command(fail(CheckpointError("'ckpt' is missing.")), ConfigError, CheckpointError) == 2
    assert capsys.readouterr().err == "error: 'ckpt' is missing.\n"


def test_the_message_function_shapes_the_line(capsys):
    err = ConfigError("model.path='x':\n  no config.json\n")
    assert run_command(fail(err), ConfigError, message=one_line) == 2
    assert capsys.readouterr().err == "error: model.path='x': no config.json\n"
    assert run_command(fail(err), ConfigError) == 2  # by default the message as it is (rl_megatron.convert's)
    assert capsys.readouterr().err == f"error: {err}\n"


def test_other_exceptions_propagate(capsys):
    with pytest.raises(KeyError):
        run_command(fail(KeyError("bug")), ConfigError, CheckpointError)
    assert capsys.readouterr().err == ""
