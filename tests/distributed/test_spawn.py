"""Local processes started by `run_distributed` (convert, bench reshard, these tests): each takes its own device, and
they meet at a port no other process can take."""
import os
import socket

import torch.distributed as dist

from rl_megatron.workers.distributed import local_rank
from rl_megatron.workers.spawn import run_distributed


def _device_of_this_rank():
    return os.environ["LOCAL_RANK"], local_rank()


def _rank():
    return dist.get_rank()


def test_ranks_meet_at_a_port_that_no_other_process_can_take_first(monkeypatch):
    """Parallel test processes (pytest -n) met at one port: each found it free, let go of it, and its ranks bound it
    later. Here another process takes every port this one lets go of, at once: the ranks must still meet."""
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
        assert run_distributed(_rank, world_size=2, timeout=120) == [0, 1]
    finally:
        for squatter in squatters:
            let_go(squatter)


def test_each_spawned_rank_takes_its_own_device_index():
    # On a GPU machine every spawned process sees every GPU: rank r must set cuda:r, or NCCL finds one GPU twice.
    assert run_distributed(_device_of_this_rank, world_size=3) == [("0", 0), ("1", 1), ("2", 2)]


def test_a_process_without_a_launcher_rank_uses_its_first_visible_device(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # a Ray worker: its one GPU is device 0
    assert local_rank() == 0
