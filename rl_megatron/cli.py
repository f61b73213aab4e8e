"""What the command-line entry points share (`rl_megatron.train`, `rl_megatron.convert`, `rl_megatron.launch`): a
problem with the user's input or cluster ends the command with one `error: ...` line on stderr and exit code 2,
without a traceback."""
from __future__ import annotations

import sys
from typing import Callable


def run_command(body: Callable[[], int | None], *errors: type[Exception], message: Callable[[Exception], str] = str
                ) -> int:
    """Run `body()` and return its exit code (0 when it returns None). One of `errors` raised by it is printed as
    `error: <message(err)>` on stderr instead, and the exit code is 2; any other exception propagates."""
    try:
        code = body()
    except errors as err:
        print(f"error: {message(err)}", file=sys.stderr)
        return 2
    return 0 if code is None else code
