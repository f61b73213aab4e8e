"""Run a function on N local processes that form a gloo world with Megatron's parallel state (benchmarks and
tests: the same process-group setup the Ray workers use, without Ray)."""
from __future__ import annotations

import io
import os
import traceback

import torch
import torch.multiprocessing as mp

from rl_megatron.workers.distributed import connect_store, init_distributed, listen_store

HOST = "127.0.0.1"


def _entry(rank, world_size, port, layout, fn, args, results):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Every process sees every GPU of the machine: each takes its own (all on cuda:0, NCCL finds duplicate GPUs).
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    try:
        init_distributed(rank, world_size, connect_store(HOST, port), seed=0, **layout)
        # As bytes: tensors put on a queue as-is live in shared memory that dies with this process.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        results.put((rank, buffer.getvalue(), None))
    except Exception:
        results.put((rank, None, traceback.format_exc()))


def run_distributed(fn, world_size: int, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, args=(),
                    timeout: float = 600, etp: int | None = None, cp: int = 1) -> list:
    """fn(*args) on every rank after init_distributed (meeting at a store this process holds); returns the results
    in rank order. A rank that raises stops them all and its traceback is raised here."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = listen_store(HOST)  # listens until this function returns, after every rank is done
    port = store.port
    layout = {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "etp": etp, "cp": cp}
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, layout, fn, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, value, error = results.get(timeout=timeout)
        if error:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{error}")
        out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    for p in procs:
        p.join()
    return [out[r] for r in range(world_size)]
