"""Whether Ray's debugger is on (RAY_DEBUG, read in this process), and the process groups' timeout that follows:
a rank paused at a breakpoint keeps its peers waiting in their next collective, so while the debugger is on every
process group (Megatron's, the engines', the weight sync's) waits a day. What else the debugger needs and changes
(the workers' environment, the controller's waits, the console's hint) is `rl_megatron.workers.debugging`'s.
"""
from __future__ import annotations

import datetime
import os
from typing import Optional

DEBUGGER_MODES = ("1", "legacy")  # the values of RAY_DEBUG for which Ray 2.60 stops a worker at breakpoint()
# Long enough for any debugging session; a real hang still ends, a day later.
PAUSED_COLLECTIVE_TIMEOUT = datetime.timedelta(days=1)


def ray_debugger() -> Optional[str]:
    """RAY_DEBUG's mode ("1" or "legacy") when it turns Ray's debugger on, else None."""
    mode = os.environ.get("RAY_DEBUG", "")
    return mode if mode in DEBUGGER_MODES else None


def collective_timeout(usual: Optional[datetime.timedelta]) -> Optional[datetime.timedelta]:
    """A process group's timeout: `usual` (None: torch's default), or a day while the debugger is on."""
    return PAUSED_COLLECTIVE_TIMEOUT if ray_debugger() else usual
