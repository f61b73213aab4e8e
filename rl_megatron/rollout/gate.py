"""Who may touch the rollout engines when generation runs ahead of training (trainer.rollout_staleness > 0): the
generation thread's rollouts use them, the trainer's weight syncs write them, never both at once.

A sync waits until no rollout uses the engines and keeps new uses out until the weights are in. Without partial
rollouts a whole batch's generation is one use (all its samples come from one policy version); with them
(rollout.partial_rollout) each engine's decoding between two syncs is a use, and the turn scheduler ends its uses
as soon as a sync waits (`rl_megatron.rollout.serving`), so a weight update lands in the middle of a batch; or, with
rollout.partial_rollout_sync_at_tokens, it ends them at a fixed token and waits there for the update (`enter`'s
`ready`).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class GateClosed(RuntimeError):
    """The run is ending: no sync will come for a use that waits for one."""


class EngineGate:
    def __init__(self):
        self._changed = threading.Condition()
        self._users = 0
        self._syncing = False
        self._sync_version: int | None = None  # what the waiting or running sync installs (None: not named)
        self._held: set[int] = set()  # versions whose sync a batch holds back until its fixed sync point
        self._closed = False

    def enter(self, ready: Callable[[], bool] = lambda: True) -> None:
        """Start a use of the engines (after the sync in progress, if any, unless a batch holds it back), once
        `ready()` holds (evaluated again after every sync: e.g. "the engines hold version v")."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or ((not self._syncing or self._sync_held()) and ready()))
            if self._closed:
                raise GateClosed("the run is ending; no weight update will come")
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

    def hold(self, version: int) -> None:
        """Keep the sync of `version` out until `release(version)`: a batch started with a fixed sync point
        (rollout.partial_rollout_sync_at_tokens) lets it in only once its requests are there."""
        with self._changed:
            self._held.add(version)

    def release(self, version: int) -> None:
        with self._changed:
            self._held.discard(version)
            self._changed.notify_all()

    def close(self) -> None:
        """Wake every use still waiting, with GateClosed (a run that stops before the sync a batch waits for)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def sync_waiting(self) -> bool:
        """Whether a sync waits for the engines (users with partial rollouts end their use when it does)."""
        return self._syncing and not self._sync_held()

    def _sync_held(self) -> bool:
        return self._syncing and self._sync_version in self._held

    @contextmanager
    def sync(self, version: int | None = None) -> Iterator[float]:
        """Hold the engines for a weight sync (installing `version`, which a batch may hold back); yields the
        seconds spent waiting for them."""
        start = time.perf_counter()
        with self._changed:
            self._syncing, self._sync_version = True, version
            self._changed.wait_for(lambda: self._users == 0 and not self._sync_held())
        try:
            yield time.perf_counter() - start
        finally:
            with self._changed:
                self._syncing, self._sync_version = False, None
                self._changed.notify_all()
