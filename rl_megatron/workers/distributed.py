"""Process-group setup shared by every process that holds Megatron shards (Ray workers, test processes)."""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from rl_megatron import platform
from rl_megatron.workers.debugging import collective_timeout

MEGATRON_GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # Megatron's own default for the groups it makes


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now (held open together, so none is handed out twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def rendezvous_address() -> tuple[str, int]:
    """This Ray worker's node address and a free port on it: where a process group it leads can meet."""
    import ray

    return ray.util.get_node_ip_address(), free_port()


def local_rank() -> int:
    """This process's device among those it sees: LOCAL_RANK when its launcher set it (`spawn.run_distributed` sets
    the local rank of each process it starts on one machine), else 0 (a Ray worker sees its one GPU only)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     tp: int, pp: int, seed: int, vpp: int = 1, cp: int = 1, ep: int = 1,
                     etp: int | None = None) -> None:
    """torch.distributed (NCCL on GPU, gloo on CPU) + Megatron parallel_state (`vpp` model chunks per pipeline
    stage, sequences split over `cp` ranks, routed experts split over `ep` ranks and each expert over `etp` ranks, by
    default TP) + Megatron's RNG seeds. With Ray's debugger on, the groups' collectives wait a day (a peer may be
    paused at a breakpoint)."""
    from megatron.core import parallel_state, tensor_parallel

    platform.setup()
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank()))
    if platform.has_cuda():
        torch.cuda.set_device(local_rank())
    dist.init_process_group(platform.dist_backend(), rank=rank, world_size=world_size,
                            timeout=collective_timeout(None))
    # None, not 1, selects Megatron's non-interleaved schedules.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                             context_parallel_size=cp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp,
                                             distributed_timeout_minutes=collective_timeout(MEGATRON_GROUP_TIMEOUT)
                                             // datetime.timedelta(minutes=1))
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def owns_dp_output() -> bool:
    """Whether this rank returns the results of its data-parallel slice (last PP stage, first TP and CP rank)."""
    from megatron.core import parallel_state

    return (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0)
