"""The user's agent function (rollout.agent.function) run in processes of its own: rollout.agent.num_workers of
them, each an asyncio event loop with any number of episodes in flight, called from the gateway's loop
(rl_megatron/agents/gateway/loop.py) over a socket pair.

Why processes: an agent harness spends its own CPU on every call (the official `openai` client's Python: building
the request, its connection pool, parsing the reply into its models), several times the gateway's own cost
(docs/benchmarks.md: py-spy of the controller's event loop). In the controller's event loop that CPU and the
gateway's share one core and one GIL, and every call waits behind every other episode's client. In workers it runs
beside the gateway, on other cores, as a harness deployed on its own does (verl's `rollout.agent.num_workers`
agent-loop workers are the same idea). num_workers=0 keeps the episodes in the controller's event loop (state shared
with the caller, a debugger's breakpoints).

A worker is started with `python -m rl_megatron.agent_workers FD SPEC` (`plugins.module_process`, as the reward
scorer's processes are), loads the function by its spec, and exits when the controller's end of the socket closes.
Messages (pickled by multiprocessing.connection):
    controller -> worker   ("run", episode, base_url, row)   ("cancel", episode)
    worker -> controller   (episode, error or None, result)
A worker that dies fails the episodes it held (each names its exit code); the next episode starts a new one.

This module imports no more than the standard library and rl_megatron.plugins, so that a worker starts in the time
the agent's own imports take.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

from rl_megatron.plugins import load_callable, module_process, with_absolute_path

KEY = "rollout.agent.function"


class AgentWorkerFailed(Exception):
    """An episode's failure reported by its worker: the message says what happened (the error as `Type: text`)."""


async def call_agent(function, base_url: str, row: dict):
    """`function(base_url, row)` awaited: a coroutine function in the running loop, a plain one in a thread of its own
    (a blocking client cannot stall the loop)."""
    if asyncio.iscoroutinefunction(function):
        return await function(base_url, row)
    result = await _in_own_thread(function, base_url, row)
    return await result if asyncio.iscoroutine(result) else result


def _in_own_thread(function, *args) -> asyncio.Future:
    """`function(*args)` in a daemon thread of its own. Not asyncio.to_thread: its executor runs CPUs + 4 calls at
    once, and an event loop joins it when it closes (asyncio.run), so a function still running past
    rollout.agent.timeout_s would hold the whole rollout until it returned."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            outcome = (None, function(*args))
        except Exception as error:  # noqa: BLE001 - the episode's failure, handed to it
            outcome = (error, None)
        _call_soon(loop, _settle, future, *outcome)

    threading.Thread(target=run, name="rl_megatron-agent", daemon=True).start()
    return future


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that event loop has ended (its rollout is over): nothing waits for the outcome
        pass


def _settle(future: asyncio.Future, error: BaseException | str | None, result) -> None:
    """`future` given `result`, or `error` (a worker's message: AgentWorkerFailed)."""
    if future.done():  # cancelled (timed out) before the answer came
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(AgentWorkerFailed(error) if isinstance(error, str) else error)


class AgentWorkers:
    """`count` worker processes of the agent function `spec`, started on first use; `run` one episode on the least
    busy one."""

    def __init__(self, spec: str, count: int):
        self.spec, self.count = with_absolute_path(spec), count
        self._workers: list[_Worker | None] = [None] * count
        self._episodes = itertools.count()
        self._lock = threading.Lock()  # rollouts of two event loops (threads) may start episodes at once

    async def run(self, base_url: str, row: dict):
        """The function's result for one episode; AgentWorkerFailed if it raised or its worker died. Cancelled (a
        timeout), it cancels the episode in its worker."""
        with self._lock:
            index = min(range(self.count), key=lambda i: self._load(i))
            worker = self._workers[index]
            if worker is None or not worker.alive:
                worker = self._workers[index] = _Worker(self.spec, index)
        return await worker.run(next(self._episodes), base_url, row)

    def _load(self, index: int) -> int:
        worker = self._workers[index]
        return len(worker.pending) if worker is not None and worker.alive else 0

    def close(self) -> None:
        for worker in self._workers:
            if worker is not None:
                worker.close()
        self._workers = [None] * self.count


class _Worker:
    def __init__(self, spec: str, index: int):
        ours, theirs = socket.socketpair()
        try:
            self.process = module_process("rl_megatron.agent_workers", [str(theirs.fileno()), spec],
                                          (theirs.fileno(),))
        finally:
            theirs.close()
        self.index, self.alive = index, True
        self.socket, self.connection = ours, Connection(os.dup(ours.fileno()))
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"rl_megatron-agent-worker-{index}", daemon=True).start()

    async def run(self, episode: int, base_url: str, row: dict):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if not self.alive:
                raise AgentWorkerFailed(self._died())
            self.pending[episode] = (loop, future)
        try:
            self._send(("run", episode, base_url, row))
            return await future
        except asyncio.CancelledError:
            if self.alive:
                self._send(("cancel", episode))
            raise
        finally:
            with self._lock:
                self.pending.pop(episode, None)

    def _send(self, message) -> None:
        try:
            with self._lock:
                self.connection.send(message)
        except OSError:  # the worker is gone: its reader fails what it held
            pass

    def _read(self) -> None:
        try:
            while True:
                episode, error, result = self.connection.recv()
                with self._lock:
                    waiting = self.pending.get(episode)
                if waiting is not None:
                    _call_soon(waiting[0], _settle, waiting[1], error, result)
        except (EOFError, OSError):
            pass
        self.connection.close()
        self.process.wait()
        with self._lock:
            self.alive = False
            held = list(self.pending.values())
        for loop, future in held:
            _call_soon(loop, _settle, future, self._died(), None)

    def _died(self) -> str:
        return (f"the agent worker process {self.process.pid} (rollout.agent.num_workers) exited with code "
                f"{self.process.returncode} while the episode ran")

    def close(self) -> None:
        self.alive = False
        try:
            self.socket.shutdown(socket.SHUT_RDWR)  # the worker exits at the end of its input; our reader wakes up
        except OSError:  # it has gone already
            pass
        self.socket.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# -- the worker process ---------------------------------------------------------------------------------------------

def serve(connection: Connection, spec: str) -> None:
    try:
        function, problem = load_callable(spec, KEY), None
    except Exception as error:  # noqa: BLE001 - every episode reports it
        function, problem = None, f"{type(error).__name__}: {error}"
    asyncio.run(_serve(connection, function, problem))


async def _serve(connection: Connection, function, problem: str | None) -> None:
    loop = asyncio.get_running_loop()
    incoming: asyncio.Queue = asyncio.Queue()
    episodes: dict[int, asyncio.Task] = {}

    def read() -> None:
        try:
            while True:
                _call_soon(loop, incoming.put_nowait, connection.recv())
        except (EOFError, OSError):
            os._exit(0)  # the controller is gone: so is every episode (plain functions' threads included)

    async def episode(number: int, base_url: str, row: dict) -> None:
        try:
            if problem is not None:
                raise AgentWorkerFailed(problem)
            reply = (number, None, await call_agent(function, base_url, row))
        except asyncio.CancelledError:
            return  # timed out: the controller has moved on
        except AgentWorkerFailed as error:
            reply = (number, str(error), None)
        except Exception as error:  # noqa: BLE001 - the episode's failure, reported to the controller
            reply = (number, f"{type(error).__name__}: {error}", None)
        finally:
            episodes.pop(number, None)
        try:
            connection.send(reply)
        except Exception as error:  # noqa: BLE001 - a result that cannot be pickled fails its episode only
            connection.send((number, f"returned {type(reply[2]).__name__}, which cannot be sent back from the "
                                     f"agent worker ({type(error).__name__}: {error}): return a number, a dict of "
                                     "numbers or None", None))

    threading.Thread(target=read, name="rl_megatron-agent-worker-reader", daemon=True).start()
    while True:
        kind, number, *rest = await incoming.get()
        if kind == "run":
            episodes[number] = loop.create_task(episode(number, *rest))
        elif number in episodes:  # "cancel"
            episodes[number].cancel()


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), sys.argv[2])
