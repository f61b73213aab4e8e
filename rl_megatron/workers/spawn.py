"""Run a function on N local processes that form a gloo world with Megatron's parallel state (benchmarks, conversion
and tests: the same process-group setup the Ray workers use, without Ray). `LocalWorld` keeps its processes between
runs, each run laying Megatron's parallel state out anew: the distributed tests share one world per size instead of
paying the start-up (a process, torch, Megatron and vLLM imported, the world joined) in every test."""
from __future__ import annotations

import io
import os
import queue
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl_megatron import platform
from rl_megatron.config.schema import RolloutConfig
from rl_megatron.rollout.engine import engine_class
from rl_megatron.workers.distributed import connect_store, init_distributed, init_model_parallel, listen_store

HOST = "127.0.0.1"
SEED = 0
# What ranks import, imported once by the server that forks them (CPU only: `rank_context`): the default rollout
# engine's library as an engine process imports it (`RolloutEngine.preload`; vLLM's first quiets the CPU notices
# Megatron's imports print), torch and Megatron.
FORK_SERVER_PRELOAD = [engine_class(RolloutConfig.engine).preload, "rl_megatron.workers.megatron_actor",
                       "rl_megatron.workers.spawn"]


def rank_context():
    """How ranks start. On CUDA, as fresh interpreters (spawn), as the GPU checks ran them: CUDA cannot start in a
    child forked from a process where it had started, and imports (Transformer Engine's) may start it. Without CUDA,
    forked from one server process per parent (multiprocessing's forkserver), which imported torch, Megatron and vLLM
    once: each fresh rank would import them again, 6-8 s of CPU on 2 cores, more than many runs' own work."""
    if platform.has_cuda():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return context


def _serve(rank, world_size, tasks, results, environment):
    """A rank's life: run tasks until told to stop (None). A task that carries a store's port joins the world there
    first: the first task, and the one after a run that took the world's process group down (closing a vLLM
    engine in-process does). `environment`: the starting process's, as a spawned rank inherits it (a forked one has
    its fork server's, from when the server started)."""
    os.environ.clear()
    os.environ.update(environment)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Every process sees every GPU of the machine: each takes its own (all on cuda:0, NCCL finds duplicate GPUs).
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # whoever started this world is gone without closing it
                return
            continue
        if task is None:
            return
        join_port, layout, fn, args = task
        try:
            if join_port is not None:
                if dist.is_initialized():
                    dist.destroy_process_group()
                init_distributed(rank, world_size, connect_store(HOST, join_port), seed=SEED, **layout)
            else:
                init_model_parallel(seed=SEED, **layout)
            environment = dict(os.environ)
            try:
                # As bytes: tensors put on a queue as-is live in shared memory that dies with this process.
                buffer = io.BytesIO()
                torch.save(fn(*args), buffer)
            finally:
                # What one run set in the environment is not the next run's starting point.
                os.environ.clear()
                os.environ.update(environment)
            results.put((rank, buffer.getvalue(), None, dist.is_initialized()))
        except Exception:
            results.put((rank, None, traceback.format_exc(), False))


class LocalWorld:
    """`world_size` local processes meeting at a store this process holds; `run` calls a function on all of them.
    A rank that raises, or a run past its timeout, takes the whole world down (its peers may be waiting in a
    collective); `alive` then says False."""

    def __init__(self, world_size: int):
        ctx = rank_context()
        self.world_size = world_size
        self._stores = [listen_store(HOST)]  # each listens while the world lives
        self._join_port = self._stores[-1].port  # where the next run's ranks join the world first, if anywhere
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        environment = dict(os.environ)
        self._procs = [ctx.Process(target=_serve, args=(r, world_size, self._tasks[r], self._results, environment))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()

    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, args=(), timeout: float = 600,
            etp: int | None = None, cp: int = 1) -> list:
        """fn(*args) on every rank after laying out Megatron's parallel state (`init_model_parallel`) and seeding
        it; returns the results in rank order. A rank that raises stops them all and its traceback is raised here."""
        layout = {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "etp": etp, "cp": cp}
        for tasks in self._tasks:
            tasks.put((self._join_port, layout, fn, args))
        out, joined = {}, []
        for _ in self._procs:
            try:
                rank, value, error, still_joined = self._results.get(timeout=timeout)
            except queue.Empty:
                self.close(kill=True)
                raise TimeoutError(f"{fn.__name__} did not finish on every rank within {timeout:.0f} s") from None
            if error:
                self.close(kill=True)
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            joined.append(still_joined)
        if all(joined):
            self._join_port = None
        else:  # a fresh store: the old one holds the keys of the group that is gone
            self._stores.append(listen_store(HOST))
            self._join_port = self._stores[-1].port
        return [out[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Let the ranks finish and exit, or (`kill`) kill them at once."""
        for tasks, p in zip(self._tasks, self._procs):
            if kill:
                p.kill()
            elif p.is_alive():
                tasks.put(None)
        for p in self._procs:
            p.join()
        self._procs = []


def run_distributed(fn, world_size: int, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, args=(),
                    timeout: float = 600, etp: int | None = None, cp: int = 1) -> list:
    """fn(*args) on `world_size` fresh ranks (`LocalWorld.run`), which exit when it returns."""
    world = LocalWorld(world_size)
    try:
        return world.run(fn, tp, pp, vpp, ep, args=args, timeout=timeout, etp=etp, cp=cp)
    finally:
        world.close()
