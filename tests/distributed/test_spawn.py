"""Local processes started by `run_distributed` (convert, bench reshard, these tests): each takes its own device, and
they meet at a port no other process can take; a `LocalWorld` kept between runs gives each run what fresh ranks would."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from rl_megatron.workers.distributed import local_rank
from rl_megatron.workers.spawn import LocalWorld, run_distributed


def _rank_and_device():
    return dist.get_rank(), os.environ["LOCAL_RANK"], local_rank()


def test_ranks_meet_at_a_port_that_no_other_process_can_take_first_and_each_takes_its_own_device(monkeypatch):
    """Parallel test processes (pytest -n) met at one port: each found it free, let go of it, and its ranks bound it
    later. Here another process takes every port this one lets go of, at once: the ranks must still meet. On a GPU
    machine every spawned process sees every GPU: rank r must set cuda:r, or NCCL finds one GPU twice."""
    let_go = socket.socket.close
    squatters = []

    def close_and_lose_the_port(sock):
        port = sock.getsockname()[1] if sock.family in (socket.AF_INET, socket.AF_INET6) else 0
        let_go(sock)
        if port:
            squatter = socket.socket()
            try:
                squatter.bind(("", port))
                squatter.listen()
                squatters.append(squatter)
            except OSError:  # still held (a closed connection's TIME_WAIT): no process can take it either
                let_go(squatter)

    monkeypatch.setattr(socket.socket, "close", close_and_lose_the_port)
    try:
        assert run_distributed(_rank_and_device, world_size=3, timeout=120) == [(0, "0", 0), (1, "1", 1), (2, "2", 2)]
    finally:
        for squatter in squatters:
            let_go(squatter)


def test_a_process_without_a_launcher_rank_uses_its_first_visible_device(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # a Ray worker: its one GPU is device 0
    assert local_rank() == 0


def _layout_and_a_leftover_variable():
    from megatron.core import parallel_state

    seen = os.environ.get("SET_BY_AN_EARLIER_RUN")
    os.environ["SET_BY_AN_EARLIER_RUN"] = "1"
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(), seen, torch.randint(1 << 30, ()).item(),
            len(distributed_c10d._world.pg_map))


def _leave_the_world():
    dist.destroy_process_group()  # as closing a vLLM engine in-process does


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one gives up")
    dist.barrier()  # rank 0 waits for a peer that never comes: the world must still come down


def test_a_kept_world_lays_out_each_run_anew_rejoins_a_lost_group_and_a_failure_takes_it_down():
    world = LocalWorld(2)
    try:
        tp2 = world.run(_layout_and_a_leftover_variable, tp=2)
        pp2 = world.run(_layout_and_a_leftover_variable, pp=2)
        # The layout each run asked for, the environment and the seeds as fresh ranks have them.
        assert [r[:3] for r in tp2] == [(2, 1, None)] * 2 and [r[:3] for r in pp2] == [(1, 2, None)] * 2
        assert [r[3] for r in tp2] == [r[3] for r in pp2]
        # The earlier layouts' process groups were destroyed, not left behind (each gloo group polls on a thread).
        assert world.run(_layout_and_a_leftover_variable, tp=2) == tp2
        world.run(_leave_the_world)
        assert [r[0] for r in world.run(_rank_and_device, tp=2)] == [0, 1]  # the ranks joined the world again
        with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*rank one gives up"):
            world.run(_raise_on_rank_one, timeout=120)
        assert not world.alive()
    finally:
        world.close(kill=True)
