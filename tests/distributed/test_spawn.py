"""Local processes started by `run_distributed` (convert, bench reshard, these tests): each takes its own device."""
import os

from rl_megatron.workers.distributed import local_rank
from rl_megatron.workers.spawn import run_distributed


def _device_of_this_rank():
    return os.environ["LOCAL_RANK"], local_rank()


def test_each_spawned_rank_takes_its_own_device_index():
    # On a GPU machine every spawned process sees every GPU: rank r must set cuda:r, or NCCL finds one GPU twice.
    assert run_distributed(_device_of_this_rank, world_size=3) == [("0", 0), ("1", 1), ("2", 2)]


def test_a_process_without_a_launcher_rank_uses_its_first_visible_device(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # a Ray worker: its one GPU is device 0
    assert local_rank() == 0
