"""Offloading on CUDA: the actor's parameters and optimizer state to pinned host memory and back bitwise, gradients
dropped and re-zeroed, host buffers reused, and the next update equal to one without the round trip. Needs torch
with CUDA, megatron-core and transformers only (no vLLM or Ray).

    pytest tests/gpu/test_offload_gpu.py -m gpu -v -rA
"""
import pytest
import torch

from helpers.offload import round_trips
from rl_megatron.doctor.offload_check import offload_problems, update_problems

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]


@pytest.mark.parametrize("tp", [1, 2])
def test_offload_round_trip_on_gpus(tiny_model_dir, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs (has {torch.cuda.device_count()})")
    # The GPU's layout: DDP's parameter buffer, the distributed optimizer's fp32 shards viewing it.
    per_rank = round_trips(tiny_model_dir, tp, layouts=("distributed_optimizer",))
    assert offload_problems(per_rank, "distributed_optimizer") == []
    assert update_problems(per_rank, "distributed_optimizer") == []
