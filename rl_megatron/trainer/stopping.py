"""Stopping cleanly on SIGTERM (a scheduler's preemption, `scancel`) or SIGINT (Ctrl-C): the first signal lets the
running step finish and the trainer save a checkpoint before it exits; a second SIGINT aborts at once."""
from __future__ import annotations

import signal
import threading

from rl_megatron.tracking.console import write

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self):
        self.received: str | None = None  # the name of the first signal received
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or signal.Signals(signum).name
        write(f"{signal.Signals(signum).name} received: finishing this step, saving a checkpoint, then stopping "
              "(Ctrl-C again aborts without saving).")

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
