"""Per-trajectory generation over the engines, for agent loops: many trajectories in flight per engine, each turn
decoded in a continuous batch with whatever other turns are running, so that a trajectory waiting on a tool holds
no batch back.

    trajectory coroutines --generate(engine, TurnRequest)--> TurnScheduler --serve(engine, requests)--> engines
                                                              one driver per engine: adds the waiting requests,
                                                              decodes until one finishes, hands it back

This is the pattern of verl's AgentLoop over its asynchronous rollout servers and of slime's custom generate
functions over SGLang: the agent code is a coroutine per trajectory, and the engine batches across trajectories
and turns. Here the engines stay in-process vLLM engines inside the workers (`VLLMEngine.serve`), driven by the
controller one decode burst at a time, so that an engine's TP shards (vLLM's SPMD mode) get identical calls.

`turn_synchronous=True` is the baseline it replaces: every live trajectory's turn k is decoded as one batch, and
handed back only when the whole batch is done, before any turn k + 1 starts.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from rl_megatron.rollout.completions import Completion, TurnRequest

# serve(engine index, requests to add) -> the requests that finished, by id (see VLLMEngine.serve)
ServeFn = Callable[[int, list[TurnRequest]], Awaitable[list[tuple[str, Completion]]]]


class TurnScheduler:
    def __init__(self, serve: ServeFn, engines: int, turn_synchronous: bool = False):
        self.serve, self.engines, self.turn_synchronous = serve, engines, turn_synchronous

    async def run(self, trajectories: list[Callable[[], Coroutine]]) -> list[Any]:
        """Run the trajectory coroutines (each built by a call that may use `generate`) to their ends; their
        results in order. A trajectory's exception is its result (the caller decides what a failed sample is)."""
        self._waiting: list[list[tuple[TurnRequest, asyncio.Future]]] = [[] for _ in range(self.engines)]
        self._futures: dict[str, asyncio.Future] = {}
        self._running = [0] * self.engines
        self._wake = [asyncio.Event() for _ in range(self.engines)]
        self._live = len(trajectories)
        self._round_done: list[tuple[asyncio.Future, Completion]] = []
        self._engine_error: BaseException | None = None
        drivers = [asyncio.ensure_future(self._drive(engine)) for engine in range(self.engines)]
        try:
            results = await asyncio.gather(*(self._trajectory(make) for make in trajectories))
        finally:
            for driver in drivers:
                driver.cancel()
            await asyncio.gather(*drivers, return_exceptions=True)
        if self._engine_error is not None:  # an engine's failure is the run's, not its trajectories'
            raise self._engine_error
        return results

    async def generate(self, engine: int, request: TurnRequest) -> Completion:
        """The completion of `request` on engine `engine` (its turn of a trajectory)."""
        if self._engine_error is not None:
            raise self._engine_error
        future = asyncio.get_running_loop().create_future()
        self._waiting[engine].append((request, future))
        self._futures[request.request_id] = future
        self._release()
        return await future

    async def _trajectory(self, make: Callable[[], Coroutine]) -> Any:
        try:
            return await make()
        except Exception as error:  # noqa: BLE001 - one sample's failure is reported with its index by the caller
            return error
        finally:
            self._live -= 1
            self._release()

    def _release(self) -> None:
        """Wake the drivers that have work. Turn-synchronous: only once every live trajectory waits and no engine
        is decoding (the next round starts together)."""
        if self.turn_synchronous:
            waiting = sum(len(w) for w in self._waiting)
            if waiting == 0 or waiting < self._live or any(self._running):
                return
        for engine in range(self.engines):
            if self._waiting[engine]:
                self._wake[engine].set()

    async def _drive(self, engine: int) -> None:
        try:
            await self._serve_forever(engine)
        except Exception as error:  # noqa: BLE001 - handed to every waiting trajectory, then raised by `run`
            self._engine_error = self._engine_error or error
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(error)

    async def _serve_forever(self, engine: int) -> None:
        while True:
            if not self._running[engine]:
                await self._wake[engine].wait()
            self._wake[engine].clear()
            adding, self._waiting[engine] = self._waiting[engine], []
            self._running[engine] += len(adding)
            finished = await self.serve(engine, [request for request, _ in adding])
            self._running[engine] -= len(finished)
            done = [(self._futures.pop(request_id), completion) for request_id, completion in finished]
            if not self.turn_synchronous:
                for future, completion in done:
                    future.set_result(completion)
                continue
            self._round_done += done
            if not any(self._running):  # the round is over: every trajectory gets its turn back at once
                for future, completion in self._round_done:
                    future.set_result(completion)
                self._round_done = []
