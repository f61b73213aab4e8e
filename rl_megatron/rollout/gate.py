"""Who may touch the rollout engines when generation runs ahead of training (trainer.rollout_staleness > 0): the
generation thread's rollouts use them, the trainer's weight syncs write them, never both at once.

A sync waits until no rollout uses the engines and keeps new uses out until the weights are in. Without partial
rollouts a whole batch's generation is one use (all its samples come from one policy version); with them
(rollout.partial_rollout) each engine's decoding between two syncs is a use, and the turn scheduler ends its uses
as soon as a sync waits (`rl_megatron.rollout.serving`), so a weight update lands in the middle of a batch.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class EngineGate:
    def __init__(self):
        self._changed = threading.Condition()
        self._users = 0
        self._syncing = False

    def enter(self) -> None:
        """Start a use of the engines (after the sync in progress, if any)."""
        with self._changed:
            self._changed.wait_for(lambda: not self._syncing)
            self._users += 1

    def leave(self) -> None:
        with self._changed:
            self._users -= 1
            self._changed.notify_all()

    @contextmanager
    def use(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    @property
    def sync_waiting(self) -> bool:
        """Whether a sync waits for the engines (users with partial rollouts end their use when it does)."""
        return self._syncing

    @contextmanager
    def sync(self) -> Iterator[float]:
        """Hold the engines for a weight sync; yields the seconds spent waiting for them."""
        start = time.perf_counter()
        with self._changed:
            self._syncing = True
            self._changed.wait_for(lambda: self._users == 0)
        try:
            yield time.perf_counter() - start
        finally:
            with self._changed:
                self._syncing = False
                self._changed.notify_all()
