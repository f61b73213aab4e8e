"""Per-trajectory generation over the engines, for agent loops: many trajectories in flight per engine, each turn
decoded in a continuous batch with whatever other turns are running, so that a trajectory waiting on a tool holds
no batch back.

    trajectory coroutines --generate(engine, TurnRequest)--> TurnScheduler --serve(engine, requests)--> engines
                                                              one driver per engine: adds the waiting requests,
                                                              decodes until one finishes, hands it back;
                                                              its next call made before that one's result is back

This is the pattern of verl's AgentLoop over its asynchronous rollout servers and of slime's custom generate
functions over SGLang: the agent code is a coroutine per trajectory, and the engine batches across trajectories
and turns. Here the engines stay in-process engines inside the workers (`RolloutEngine.serve`), driven by the
controller one decode burst at a time, so that an engine's TP shards (vLLM's SPMD mode) get identical calls.

`turn_synchronous=True` is the baseline it replaces: every live trajectory's turn k is decoded as one batch, and
handed back only when the whole batch is done, before any turn k + 1 starts.

With partial rollouts (`Pausing`), a weight update may arrive while requests are being decoded: each engine's
driver then interrupts its requests (keeping the tokens and log-probs sampled so far, with the policy version that
sampled them), lets the update in (`EngineGate`), and continues each request as a new one whose prompt ends with
its tokens so far; the trajectory gets one completion with both parts. This is the interrupt-and-continue of slime's
partial rollouts and AReaL's interruptible generation: the continuation's KV cache is recomputed with the new
weights, so every log-prob is exactly that of the policy version recorded for its token.

Where the update lands is then the schedulers' timing. With rollout.partial_rollout_sync_at_tokens = T
(`Pausing.sync_at_tokens`) it lands at a fixed point instead: while the engines hold a version older than the one the
batch is trained after, every request is decoded to T tokens at most; an engine whose requests have all stopped there
(or finished) ends its use and waits for that version, then continues them. Which weights sampled which token is then
the same in every run, however fast the trainer is (a run reproduces; the suite asserts exact facts).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from dataclasses import dataclass, replace

import numpy as np

from rl_megatron.rollout.completions import Completion, TurnRequest
from rl_megatron.batch import SampleStatus
from rl_megatron.rollout.gate import EngineGate

# serve(engine index, requests to add) -> the requests that finished, by id (see RolloutEngine.serve). One engine's
# calls must run one after another in the order made, as a Ray actor's do: a driver makes the next before the
# current one's result is back.
ServeFn = Callable[[int, list[TurnRequest]], Awaitable[list[tuple[str, Completion]]]]
# interrupt(engine index) -> the engine's unfinished requests, what each sampled so far (RolloutEngine.interrupt)
InterruptFn = Callable[[int], Awaitable[list[tuple[str, Completion]]]]


@dataclass(frozen=True)
class Pausing:
    """Partial rollouts: the gate a weight sync waits at, how to interrupt an engine, and the policy version the
    engines hold (stamped on every token)."""
    gate: EngineGate
    interrupt: InterruptFn
    version: Callable[[], int]
    sync_at_tokens: int | None = None  # rollout.partial_rollout_sync_at_tokens: where the update lands, fixed
    awaited_version: int | None = None  # the version the batch is trained after (None: nothing awaited, validation)

    def awaiting(self, version: int | None) -> Pausing:
        return replace(self, awaited_version=version)

    def holds(self) -> bool:
        """Whether requests stop at `sync_at_tokens` and wait there for the awaited version."""
        return (self.sync_at_tokens is not None and self.awaited_version is not None
                and self.version() < self.awaited_version)


class _GateEntry:
    """One wait to enter the gate, in a thread, that its driver may abandon (cancelled at the batch's end): the use
    is then ended by whichever side comes second, the thread that got it or the driver that gave up on it."""

    def __init__(self, gate: EngineGate):
        self.gate, self._lock = gate, threading.Lock()
        self._entered = self._abandoned = False

    def enter(self, ready: Callable[[], bool]) -> None:
        self.gate.enter(ready)
        with self._lock:
            self._entered = True
            if self._abandoned:
                self.gate.leave()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            if self._entered:
                self.gate.leave()


def continuation_seed(seed: int, part: int) -> int:
    """The seed of part `part` (1, 2, ...) of a request continued after weight updates: a function of the request's
    own seed and the part only."""
    return int(np.random.SeedSequence([seed, part]).generate_state(1, dtype=np.uint32)[0])


class TurnScheduler:
    def __init__(self, serve: ServeFn, engines: int, turn_synchronous: bool = False, pausing: Pausing | None = None):
        if pausing is not None and turn_synchronous:
            raise ValueError("partial rollouts continue requests one by one; they have no turn-synchronous mode")
        self.serve, self.engines, self.turn_synchronous, self.pausing = serve, engines, turn_synchronous, pausing

    async def run(self, trajectories: list[Callable[[], Coroutine]]) -> list[Any]:
        """Run the trajectory coroutines (each built by a call that may use `generate`) to their ends; their
        results in order. A trajectory's exception is its result (the caller decides what a failed sample is)."""
        self.open()
        self._live = len(trajectories)
        try:
            results = await asyncio.gather(*(self._trajectory(make) for make in trajectories))
        finally:
            await self.close()
        if self._engine_error is not None:  # an engine's failure is the run's, not its trajectories'
            raise self._engine_error
        return results

    def open(self) -> None:
        """Start serving (one driver per engine, in the running event loop): `run` for a batch; a stream of
        trajectories (`add`, `rl_megatron.trainer.streaming`) until `close`."""
        self._waiting: list[list[tuple[TurnRequest, asyncio.Future]]] = [[] for _ in range(self.engines)]
        self._futures: dict[str, asyncio.Future] = {}
        self._running = [0] * self.engines
        self._wake = [asyncio.Event() for _ in range(self.engines)]
        self._live = 0
        self._round_done: list[tuple[asyncio.Future, Completion]] = []
        self._engine_error: BaseException | None = None
        self._requests: dict[str, TurnRequest] = {}  # partial rollouts: the unfinished requests, by id
        self._continued: dict[str, tuple[Completion, int]] = {}  # by an interrupted request's id: what its parts
        # sampled, and the latest part's number
        self._origin: dict[str, str] = {}  # a continuation's id -> its original request's id
        self._one_step = [False] * self.engines  # the engine's latest call ends all it holds (see `_call`)
        self._using = [False] * self.engines  # partial rollouts: whether the engine's driver holds a use of the gate
        self._caps: dict[str, int] = {}  # a request stopped at sync_at_tokens -> its tokens there
        self._held: list[list[tuple[str, Completion, int]]] = [[] for _ in range(self.engines)]  # stopped there
        self.interrupted = 0  # requests interrupted by weight updates
        self.idle_s = [0.0] * self.engines  # each engine's time with nothing to decode, up to its latest wake
        self._idle_since: list[float | None] = [None] * self.engines
        self._drivers = [asyncio.ensure_future(self._drive(engine)) for engine in range(self.engines)]

    def idle_seconds(self, now: float) -> float:
        """The engines' time with nothing to decode up to `now` (a perf_counter reading), summed: the stretches still
        going counted to `now`."""
        return sum(self.idle_s) + sum(now - since for since in self._idle_since if since is not None)

    async def add(self, make: Callable[[], Coroutine]) -> Any:
        """One more trajectory of a stream (not turn-synchronous), run to its end: its result, or its exception;
        an engine's failure raised."""
        self._live += 1
        result = await self._trajectory(make)
        if self._engine_error is not None:
            raise self._engine_error
        return result

    async def close(self) -> None:
        """Stop the drivers; every use of the engines they held ends."""
        if self.pausing is not None and self.pausing.awaited_version is not None:
            self.pausing.gate.release(self.pausing.awaited_version)
        for driver in self._drivers:
            driver.cancel()
        await asyncio.gather(*self._drivers, return_exceptions=True)
        if self.pausing is not None:  # a driver cancelled between its turns still held a use of the engines
            for engine in range(self.engines):
                self._leave(engine)

    async def generate(self, engine: int, request: TurnRequest) -> Completion:
        """The completion of `request` on engine `engine` (its turn of a trajectory)."""
        if self._engine_error is not None:
            raise self._engine_error
        future = asyncio.get_running_loop().create_future()
        self._waiting[engine].append((request, future))
        self._futures[request.request_id] = future
        if self.pausing is not None:
            self._requests[request.request_id] = request
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
            if self.pausing is not None:  # a sync must not wait for a dead driver
                self._leave(engine)
            self._engine_error = self._engine_error or error
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(error)

    async def _serve_forever(self, engine: int) -> None:
        ahead = None  # the engine's next call, made before the result of the one awaited came back
        try:
            while True:
                if ahead is None:
                    if not self._running[engine]:
                        self._idle_since[engine] = time.perf_counter()
                        await self._wake[engine].wait()
                        self.idle_s[engine] += time.perf_counter() - self._idle_since[engine]
                        self._idle_since[engine] = None
                    if self.pausing is not None:
                        await self._let_weight_updates_in(engine)
                    call, version = self._call(engine)
                else:
                    (call, version), ahead = ahead, None
                if self._runs_ahead(engine):
                    ahead = self._call(engine)
                finished = await call
                self._running[engine] -= len(finished)
                if self.pausing is not None:
                    finished = self._hold(engine, finished, version)
                    if not self._running[engine] and ahead is None:
                        self._leave(engine)
                        self._release_at_sync_point()
                        if self._held[engine]:
                            await self._continue_held(engine)
                self._hand_back(engine, finished, version)
        finally:
            if ahead is not None:
                ahead[0].cancel()

    def _call(self, engine: int) -> tuple[asyncio.Future, int | None]:
        """Call the engine's `serve` with the requests waiting; the call (its finished requests, to await) and the
        policy version its tokens are sampled with (constant until this engine's use of the gate ends)."""
        self._wake[engine].clear()
        adding, self._waiting[engine] = self._waiting[engine], []
        self._running[engine] += len(adding)
        version = self.pausing.version() if self.pausing else None
        requests = [self._capped(request) for request, _ in adding]
        # A call decodes at least one step: requests of one token that are all the engine holds all end in it.
        self._one_step[engine] = (len(requests) == self._running[engine]
                                  and all(request.max_tokens <= 1 for request in requests))
        return asyncio.ensure_future(self.serve(engine, requests)), version

    def _runs_ahead(self, engine: int) -> bool:
        """Whether to make the engine's next call before the result of the current one is back. An engine's calls
        run one after another in the order made (a Ray actor's), so the engine starts the next decode burst as soon
        as it ends one, instead of waiting for its result's round trip through the controller (which on a loaded
        host costs as much as a burst): what an asynchronous engine's own loop does for verl's and slime's servers.
        Not when nothing would be decoded (the current call ends all the engine holds: turns of one token), nor
        while a weight sync waits for the engines or requests are held at a fixed sync point (the use of the gate
        must end after the current call)."""
        if not self._running[engine] or self._one_step[engine]:
            return False
        return self.pausing is None or not (self.pausing.gate.sync_waiting or self.pausing.holds())

    def _hand_back(self, engine: int, finished: list[tuple[str, Completion]], version: int | None) -> None:
        """Give the finished requests' completions to their trajectories: at once, or turn-synchronous, all of a
        round's together once the round is over."""
        done = [(self._futures.pop(request_id), self._whole(request_id, completion, version))
                for request_id, completion in finished]
        if not self.turn_synchronous:
            for future, completion in done:
                future.set_result(completion)
            return
        self._round_done += done
        if not any(self._running):  # the round is over: every trajectory gets its turn back at once
            for future, completion in self._round_done:
                future.set_result(completion)
            self._round_done = []

    async def _let_weight_updates_in(self, engine: int) -> None:
        """Partial rollouts: when a weight sync waits, interrupt this engine's requests (they wait to be continued)
        and end its use of the engines; a driver starting a use waits for the sync in progress."""
        if self._running[engine] and self.pausing.gate.sync_waiting and not self.pausing.holds():
            version = self.pausing.version()
            interrupted = await self.pausing.interrupt(engine)
            self._continue(engine, [(request_id, part, version) for request_id, part in interrupted])
            self.interrupted += len(interrupted)
            self._running[engine] = 0
            self._leave(engine)
        await self._enter(engine)

    async def _enter(self, engine: int, ready: Callable[[], bool] = lambda: True) -> None:
        if not self._using[engine]:
            entry = _GateEntry(self.pausing.gate)
            try:
                await asyncio.to_thread(entry.enter, ready)
            except asyncio.CancelledError:  # the batch ended while this driver waited: its use must not outlive it
                entry.abandon()
                raise
            self._using[engine] = True

    def _leave(self, engine: int) -> None:
        if self._using[engine]:
            self._using[engine] = False
            self.pausing.gate.leave()

    def _release_at_sync_point(self) -> None:
        """Every engine's requests stopped at the sync point or finished: let the awaited update in."""
        if self.pausing.holds() and not any(self._running) and not any(self._waiting):
            self.pausing.gate.release(self.pausing.awaited_version)

    def _capped(self, request: TurnRequest) -> TurnRequest:
        """`request`, decoded to sync_at_tokens tokens at most (its earlier parts' included) while the engines hold
        an older version than the batch awaits."""
        if self.pausing is None or not self.pausing.holds():
            return request
        origin = self._origin.get(request.request_id, request.request_id)
        sampled = len(self._continued[origin][0].response_ids) if origin in self._continued else 0
        cap = self.pausing.sync_at_tokens - sampled
        if not 0 < cap < request.max_tokens:
            return request
        self._caps[request.request_id] = cap
        return replace(request, max_tokens=cap)

    def _hold(self, engine: int, finished: list[tuple[str, Completion]], version: int
              ) -> list[tuple[str, Completion]]:
        """The finished requests, less those that stopped at their cap (kept to continue after the update)."""
        done = []
        for request_id, completion in finished:
            cap = self._caps.pop(request_id, None)
            if completion.status == SampleStatus.TRUNCATED and len(completion.response_ids) == cap:
                self._held[engine].append((request_id, completion, version))
            else:
                done.append((request_id, completion))
        return done

    async def _continue_held(self, engine: int) -> None:
        """Every request on this engine stopped at its cap or finished: wait for the awaited version, then
        continue the stopped ones with it."""
        await self._enter(engine, lambda: not self.pausing.holds())
        self._continue(engine, self._held[engine])
        self._held[engine] = []
        self._wake[engine].set()

    def _continue(self, engine: int, parts: list[tuple[str, Completion, int]]) -> None:
        """Queue the continuations of interrupted requests (each part: its request id, what it sampled, the version
        that sampled it), ahead of the requests waiting and in the order given (an interrupt gives them in the order
        the engine took them): once an engine holds more requests than it decodes at once (vLLM's max_num_seqs), it
        takes them first come first served, so the oldest (a streaming batch's last groups) are decoded first. A
        request that has used its tokens is handed back as it is."""
        continuations = []
        for request_id, part, version in parts:
            part.versions = [version] * len(part.response_ids)
            origin = self._origin.pop(request_id, request_id)
            request = self._requests[origin]
            sampled, count = self._continued.get(origin, (None, 0))
            sampled = part if sampled is None else sampled.followed_by(part)
            future = self._futures.pop(request_id)
            left = request.max_tokens - len(sampled.response_ids)
            if left <= 0:
                self._continued.pop(origin, None)
                self._requests.pop(origin)
                future.set_result(sampled)
                continue
            continuation = TurnRequest(f"{origin}+{count + 1}", request.token_ids + sampled.response_ids,
                                       continuation_seed(request.seed, count + 1), left, request.temperature)
            self._continued[origin] = (sampled, count + 1)
            self._origin[continuation.request_id] = origin
            self._futures[continuation.request_id] = future
            continuations.append((continuation, future))
        self._waiting[engine][:0] = continuations

    def _whole(self, request_id: str, completion: Completion, version: int | None) -> Completion:
        """A finished request's completion, after what its earlier parts sampled (partial rollouts)."""
        if version is None:
            return completion
        completion.versions = [version] * len(completion.response_ids)
        origin = self._origin.pop(request_id, request_id)
        self._requests.pop(origin)
        if origin not in self._continued:
            return completion
        sampled, _ = self._continued.pop(origin)
        return sampled.followed_by(completion)
