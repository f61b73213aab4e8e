"""Process-group setup shared by every process that holds Megatron shards (Ray workers, test processes)."""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from rl_megatron import platform
from rl_megatron.platform.debugger import collective_timeout

MEGATRON_GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # Megatron's own default for the groups it makes

_led_stores: list[dist.TCPStore] = []  # the stores of the groups this Ray worker leads (`rendezvous_address`)


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


def listen_store(host: str) -> dist.TCPStore:
    """A process group's rendezvous store, listening at `host` on a port the OS picks as the store binds it: no other
    process can be handed that port meanwhile, as it can a port found free and bound later (parallel test processes
    met at the same port that way). Whoever starts the group holds it while the group lives; its ranks connect to it
    (`connect_store`)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_store_timeout())


def connect_store(host: str, port: int) -> dist.TCPStore:
    """A rank's connection to its group's rendezvous store (`listen_store`)."""
    return dist.TCPStore(host, port, is_master=False, timeout=_store_timeout())


def _store_timeout() -> datetime.timedelta:
    # How long a rank waits for its peers at the store: as long as in a collective.
    return collective_timeout(MEGATRON_GROUP_TIMEOUT)


def rendezvous_address() -> tuple[str, int]:
    """Where a process group this Ray worker leads meets: a store it starts at its node's address (`listen_store`),
    which serves the group as long as the worker lives (its world, the weight group of separate engines)."""
    import ray

    store = listen_store(ray.util.get_node_ip_address())
    _led_stores.append(store)
    return store.host, store.port


def local_rank() -> int:
    """This process's device among those it sees: LOCAL_RANK when its launcher set it (`spawn.run_distributed` sets
    the local rank of each process it starts on one machine), else 0 (a Ray worker sees its one GPU only)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(rank: int, world_size: int, store: dist.TCPStore, tp: int, pp: int, seed: int, vpp: int = 1,
                     cp: int = 1, ep: int = 1, etp: int | None = None) -> None:
    """torch.distributed (NCCL on GPU, gloo on CPU) meeting at `store` (`connect_store`; in a world of one rank, its
    `listen_store`, which the process group then keeps alive) + Megatron's parallel state and seeds
    (`init_model_parallel`). With Ray's debugger on, the groups' collectives wait a day (a peer
    may be paused at a breakpoint)."""
    platform.setup()
    # The variables of a torchrun launch, which vLLM's external launcher reads; the group meets at `store`.
    os.environ.update(MASTER_ADDR=store.host, MASTER_PORT=str(store.port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank()))
    if platform.has_cuda():
        torch.cuda.set_device(local_rank())
    dist.init_process_group(platform.dist_backend(), store=store, rank=rank, world_size=world_size,
                            timeout=collective_timeout(None))
    init_model_parallel(tp, pp, seed, vpp=vpp, cp=cp, ep=ep, etp=etp)


def init_model_parallel(tp: int, pp: int, seed: int, vpp: int = 1, cp: int = 1, ep: int = 1,
                        etp: int | None = None) -> None:
    """Megatron's parallel_state over the process group's world (`vpp` model chunks per pipeline stage, sequences
    split over `cp` ranks, routed experts split over `ep` ranks and each expert over `etp` ranks, by default TP),
    laid out anew: a layout left by an earlier call is taken down first. Then Megatron's RNG seeds."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        destroy_subgroups()
    # None, not 1, selects Megatron's non-interleaved schedules.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                             context_parallel_size=cp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp,
                                             distributed_timeout_minutes=collective_timeout(MEGATRON_GROUP_TIMEOUT)
                                             // datetime.timedelta(minutes=1))
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_subgroups() -> None:
    """Every process group but the default one, destroyed. Megatron's `destroy_model_parallel` forgets its groups
    without destroying them (all but its gloo data-parallel ones): each gloo group keeps a TCP thread polling, so
    ranks that lay out a layout per run (`spawn.LocalWorld`) piled up a hundred of them, ~a quarter of a core per
    idle rank."""
    default = distributed_c10d._get_default_group()
    for group in list(distributed_c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)


def owns_dp_output() -> bool:
    """Whether this rank returns the results of its data-parallel slice (last PP stage, first TP and CP rank)."""
    from megatron.core import parallel_state

    return (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0)
